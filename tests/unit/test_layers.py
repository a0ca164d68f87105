"""The package layers, checked from the source: imports only point down, and no modules import each other
in a circle (imports inside functions count: they only hide a circle).

    tandem/                      CLI, launcher, client, benchmarks: may import anything below
    gateway/ tokenizer_svc/ prefill_svc/ decode_svc/ kvstore/
                                 the services: common, engine, protos and themselves; a service never imports
                                 another, except the kvstore's client and connector
    common/                      what services share: engine and protos only
    engine/   protos/            the bottom: nothing of ours above them (the engine never sees protobuf)
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BOTTOM = {"engine": set(), "protos": set()}
FLOOR = {"common": {"engine", "protos"}}
SERVICES = ("gateway", "tokenizer_svc", "prefill_svc", "decode_svc", "kvstore")
KVSTORE_CLIENT_SIDE = ("kvstore.client", "kvstore.connector")
ALLOWED = {**BOTTOM, **FLOOR, **{s: {"common", "engine", "protos"} for s in SERVICES}}
PACKAGES = (*ALLOWED, "tandem")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module of ours that ``path`` imports, at any depth of its code; ``from a import b`` counts as
    ``a.b`` when that is a module, else ``a``."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.update(f"{base}.{alias.name}" if _is_module(f"{base}.{alias.name}") else base
                         for alias in node.names)
    return {name for name in found if name.split(".")[0] in PACKAGES}


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            edges[module_name(path)] = imports_of(path)
    return edges


def layer_violations(edges: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, targets in edges.items():
        top = module.split(".")[0]
        if top == "tandem":
            continue
        for target in sorted(targets):
            to = target.split(".")[0]
            if to == top or to in ALLOWED[top]:
                continue
            if top in SERVICES and target.startswith(KVSTORE_CLIENT_SIDE):
                continue
            bad.append(f"{module} -> {target}")
    return bad


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in edges:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _without_package_inits(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """A package's ``__init__`` that re-exports its modules is not a circle with them: drop edges from a
    package to its own submodules."""
    return {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in edges.items()}


def test_imports_only_point_down():
    assert layer_violations(graph()) == []


def test_no_import_circles():
    assert cycles(_without_package_inits(graph())) == []


def test_the_checks_catch_what_they_forbid():
    """The rules themselves, on a made-up graph: an upward import, a service importing another service,
    and a circle hidden by an import inside a function are all found."""
    edges = defaultdict(set, {
        "engine.cpu_ops": {"common.settings"},
        "gateway.server": {"decode_svc.server", "kvstore.client", "common.service"},
        "prefill_svc.server": {"kvstore.connector", "kvstore.server"},
        "tandem.cli": {"tandem.launcher"},
        "tandem.launcher": {"tandem.cli"},
    })
    assert layer_violations(edges) == [
        "engine.cpu_ops -> common.settings", "gateway.server -> decode_svc.server",
        "prefill_svc.server -> kvstore.server",
    ]
    assert cycles(edges) == [["tandem.cli", "tandem.launcher"]]
    assert imports_of(ROOT / "common" / "worker.py") >= {"common.engine_args", "engine.request"}
