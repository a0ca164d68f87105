"""The container images (docker/*.Dockerfile), without a container engine: a small Dockerfile reader, and
both Dockerfiles checked against each other and the project: same sources copied, same project install step,
torch pinned as `make run` pins it, CUDA base and torch index of one CUDA version, non-root user, no weights.
The CPU image's build, replayed step by step into a virtualenv: tests/e2e/test_docker_images.py.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from packaging.requirements import Requirement

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
CPU = DOCKER / "cpu.Dockerfile"
CUDA = DOCKER / "cuda.Dockerfile"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

# ---- a small Dockerfile reader ------------------------------------------------------------------------------


@dataclass
class Instruction:
    keyword: str  # upper case: FROM, RUN, COPY, ...
    args: str  # the rest, continuation lines joined


@dataclass
class Stage:
    base: str  # the FROM image, ARGs expanded
    name: str | None
    args: dict[str, str] = field(default_factory=dict)  # ARG defaults in scope
    env: dict[str, str] = field(default_factory=dict)  # ENV set in this stage, in order
    steps: list[Instruction] = field(default_factory=list)


_VAR = re.compile(r"\$(?:\{(\w+)(?::([-+])([^}]*))?\}|(\w+))")


def expand(text: str, variables: dict[str, str], keep_unknown: bool = False) -> str:
    """Docker's substitution: $VAR, ${VAR}, ${VAR:-default}, ${VAR:+alternative}. With ``keep_unknown``,
    variables not given stay as written (the base image's, like PATH, are only known when it runs)."""

    def sub(m: re.Match) -> str:
        name = m.group(1) or m.group(4)
        if keep_unknown and name not in variables and not m.group(2):
            return m.group(0)
        value = variables.get(name, "")
        if m.group(2) == "-":
            return value or m.group(3)
        if m.group(2) == "+":
            return m.group(3) if value else ""
        return value

    return _VAR.sub(sub, text)


def instructions(path: Path) -> list[Instruction]:
    out: list[Instruction] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # comments (and parser directives) never continue an instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, rest = (pending + line).partition(" ")
        out.append(Instruction(keyword.upper(), rest.strip()))
        pending = ""
    assert not pending, f"{path.name} ends inside a continued line"
    return out


def _pairs(text: str, variables: dict[str, str]) -> list[tuple[str, str | None]]:
    pairs = []
    for word in shlex.split(text):
        key, eq, value = word.partition("=")
        pairs.append((key, expand(value, variables, keep_unknown=True) if eq else None))
    return pairs


def stages(path: Path, build_args: dict[str, str] | None = None) -> list[Stage]:
    """The stages with their ARG defaults (``build_args`` win, as with ``--build-arg``) and ENV."""
    build_args = build_args or {}
    global_args: dict[str, str] = {}
    result: list[Stage] = []
    for ins in instructions(path):
        current = result[-1] if result else None
        if ins.keyword == "FROM":
            words = ins.args.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            result.append(Stage(expand(words[0], global_args), name))
        elif ins.keyword == "ARG":
            for key, default in _pairs(ins.args, {**global_args, **(current.args if current else {})}):
                if current is None:
                    global_args[key] = build_args.get(key, default or "")
                else:
                    inherited = default if default is not None else global_args.get(key, "")
                    current.args[key] = build_args.get(key, inherited)
        elif current is None:
            raise AssertionError(f"{path.name}: {ins.keyword} before FROM")
        elif ins.keyword == "ENV":
            for key, value in _pairs(ins.args, {**current.args, **current.env}):
                current.env[key] = value or ""
        else:
            current.steps.append(ins)
    return result


def copies(stage: Stage) -> list[tuple[list[str], str]]:
    """(sources, destination) of the stage's COPY steps from the build context."""
    out = []
    for ins in stage.steps:
        if ins.keyword == "COPY" and "--from=" not in ins.args:
            words = [w for w in shlex.split(ins.args) if not w.startswith("--")]
            out.append((words[:-1], words[-1]))
    return out


def runs(stage: Stage) -> list[str]:
    return [i.args for i in stage.steps if i.keyword == "RUN"]


def final_user(stage: Stage) -> str:
    users = [expand(i.args, {**stage.args, **stage.env}) for i in stage.steps if i.keyword == "USER"]
    assert users, "the final stage sets no USER: the container would run as root"
    return users[-1]


def project_install(stage: Stage) -> str:
    """The RUN step that installs the project from the copied sources (with uv, as `make setup` does)."""
    steps = [r for r in runs(stage) if re.search(r"pip install (--\S+ )*\"?\.", r)]
    assert len(steps) == 1, f"expected one `pip install .` step, found {steps}"
    return steps[0]


def makefile_torch_pin() -> str:
    m = re.search(r"pip install -q torch==(\S+)", (ROOT / "Makefile").read_text())
    assert m, "the Makefile no longer installs a pinned torch first"
    return m.group(1)


# ---- what both images must do ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dockerfile", [CPU, CUDA], ids=["cpu", "cuda"])
def test_copies_exactly_the_installable_project(dockerfile):
    build = next(s for s in stages(dockerfile) if s.name == "build")
    sources = sorted(src for srcs, _ in copies(build) for src in srcs)
    packages = sorted(p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"])
    assert sources == sorted(["pyproject.toml", *packages]), "COPY the project's packages and pyproject.toml only"
    for src in sources:
        assert (ROOT / src).exists(), src
    ignore = [line for line in (DOCKER / f"{dockerfile.name}.dockerignore").read_text().splitlines()
              if line and not line.startswith("#")]
    assert ignore[0] == "*", "the build context holds only what the image copies"
    assert sorted(p[1:] for p in ignore if p.startswith("!")) == sources, "the .dockerignore must let COPY's sources in"


@pytest.mark.parametrize("dockerfile", [CPU, CUDA], ids=["cpu", "cuda"])
def test_runs_as_non_root_without_weights(dockerfile):
    all_stages = stages(dockerfile)
    final = all_stages[-1]
    user = final_user(final)
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0, f"USER {user}: numeric (so runAsNonRoot can check it) and not 0"
    assert gid.isdigit() and int(gid) != 0
    assert final.env["HOME"].startswith("/home/")
    text = dockerfile.read_text()
    assert "fetch-model" not in " ".join(r for s in all_stages for r in runs(s)), "weights are never baked in"
    copied = [src for stage in all_stages for sources, _ in copies(stage) for src in sources]
    assert not [src for src in copied if re.search(r"\.(safetensors|gguf|bin|pt)$", src)]
    assert "ENTRYPOINT [\"tandem\"]" in text
    # The runtime stage carries the build stage's virtualenv, nothing else from it.
    assert [i.args for i in final.steps if i.keyword == "COPY"] == ["--from=build /opt/tandem /opt/tandem"]
    assert final.env["VIRTUAL_ENV"] == "/opt/tandem" and final.env["PATH"].startswith("/opt/tandem/bin:")


@pytest.mark.parametrize("dockerfile", [CPU, CUDA], ids=["cpu", "cuda"])
def test_installs_torch_first_like_make_run(dockerfile):
    build = next(s for s in stages(dockerfile) if s.name == "build")
    pin = makefile_torch_pin()
    assert build.args["TORCH_VERSION"] == pin
    assert f"torch=={pin}" in PYPROJECT["project"]["dependencies"]
    pip_steps = [r for r in runs(build) if "pip install" in r]
    assert 'pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"' in pip_steps[0]
    assert pip_steps[-1] == project_install(build), "the project is installed last, over the pinned torch"


def test_both_images_install_the_project_with_the_same_step():
    cpu = next(s for s in stages(CPU) if s.name == "build")
    cuda = next(s for s in stages(CUDA) if s.name == "build")
    assert " ".join(project_install(cpu).split()) == " ".join(project_install(cuda).split()) == (
        'pip install "uv==${UV_VERSION}" && uv pip install --compile-bytecode ".${TANDEM_EXTRAS:+[$TANDEM_EXTRAS]}" '
        '&& pip uninstall -y uv')
    assert cpu.args["UV_VERSION"] == cuda.args["UV_VERSION"]
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert cpu.args["TANDEM_EXTRAS"] == "convert" and "convert" in extras  # `tandem fetch-model` in the chart
    assert cuda.args["TANDEM_EXTRAS"] == "cuda" and any(d.startswith("flash-attn") for d in extras["cuda"])
    assert cpu.args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"


def test_cuda_image_is_one_cuda_version_from_devel_to_runtime():
    build, final = stages(CUDA)[0], stages(CUDA)[-1]
    version = build.args["TORCH_INDEX_URL"].rsplit("/cu", 1)[1]  # cu130 -> 130
    m = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-devel-ubuntu[\d.]+", build.base)
    assert m, build.base
    assert version == m.group(1) + m.group(2), f"torch for CUDA {version} on a CUDA {m.group(1)}.{m.group(2)} base"
    assert final.base == build.base.replace("-devel-", "-runtime-"), "GPU workers run on the CUDA runtime base"
    [flash_attn] = [Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"]["cuda"]
                    if r.startswith("flash-attn")]
    assert flash_attn.specifier.contains(build.args["FLASH_ATTN_VERSION"])
    assert any("--no-build-isolation" in r and "flash-attn" in r for r in runs(build)), \
        "flash-attn must build against the torch already installed"


def test_cpu_image_python_is_the_one_ci_installs_with():
    # The replayed install steps (tests/e2e/test_docker_images.py) run with this interpreter: the image must
    # use the same minor version.
    build = stages(CPU)[0]
    assert build.base == f"python:{sys.version_info.major}.{sys.version_info.minor}-slim-bookworm"
