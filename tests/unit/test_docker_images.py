"""The container images (docker/*.Dockerfile), without a container engine.

No engine runs here or in CI, so the CPU image's build is replayed step by step: its COPY steps into a
temporary build context, then the RUN steps of its build stage through ``sh -c`` in a fresh virtualenv, with
the Dockerfile's ARG defaults and ENV (paths under the image's root moved into a temporary folder). The one
adaptation is the torch index: the PyTorch CPU index is not reachable here, so TORCH_INDEX_URL is this
machine's package index, where ``torch==2.13.0`` resolves to the same CPU wheel `make run` installs. The GPU
image cannot be built without CUDA, flash-attn's compiler and the network, so its Dockerfile is checked
against the CPU one and the project: same sources copied, same project install step, CUDA base and torch
index of one CUDA version, non-root user, no weights.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
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
    """The RUN step that installs the project from the copied sources."""
    steps = [r for r in runs(stage) if re.search(r"pip install \"?\.", r)]
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
    assert project_install(cpu) == project_install(cuda) == 'pip install ".${TANDEM_EXTRAS:+[$TANDEM_EXTRAS]}"'
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
    # The install steps below run with this interpreter: the image must use the same minor version.
    build = stages(CPU)[0]
    assert build.base == f"python:{sys.version_info.major}.{sys.version_info.minor}-slim-bookworm"


# ---- the CPU image's install steps, run here -----------------------------------------------------------------


def _index_url() -> str:
    """This machine's package index, standing in for the PyTorch CPU index."""
    if os.environ.get("PIP_INDEX_URL"):
        return os.environ["PIP_INDEX_URL"]
    proc = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"], capture_output=True,
                          text=True)
    return proc.stdout.strip() or "https://pypi.org/simple"


@pytest.fixture(scope="module")
def cpu_build(tmp_path_factory) -> Iterator[Path]:
    """Replay the CPU image's build stage; yields the virtualenv it made (1.6 GB, removed afterwards)."""
    root = tmp_path_factory.mktemp("image")  # stands for the image's "/"
    build = next(s for s in stages(CPU, {"TORCH_INDEX_URL": _index_url()}) if s.name == "build")

    def host(path: str) -> Path:
        return root / path.lstrip("/")

    # The base image's PATH: its python first (the same minor version, checked above).
    base_bin = host("/usr/local/bin")
    base_bin.mkdir(parents=True)
    interpreter = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    for name in ("python", "python3"):
        (base_bin / name).symlink_to(interpreter)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON", "TANDEM_"))}
    env["PATH"] = f"{base_bin}:{os.environ['PATH']}"
    env.update(build.args)  # ARGs are environment variables of the RUN steps
    venv = build.env["VIRTUAL_ENV"]  # the one path the build creates outside its WORKDIR
    for key, value in build.env.items():
        if key != "PIP_NO_CACHE_DIR":  # it keeps the image small; here pip's cache saves minutes
            env[key] = expand(value, env).replace(venv, str(host(venv)))

    workdir = root
    for ins in build.steps:
        if ins.keyword == "WORKDIR":
            workdir = host(ins.args)
            workdir.mkdir(parents=True, exist_ok=True)
        elif ins.keyword == "COPY":
            *sources, dest = shlex.split(ins.args)
            target = workdir / dest
            for src in sources:
                if (ROOT / src).is_dir():
                    shutil.copytree(ROOT / src, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
                else:
                    shutil.copy2(ROOT / src, target)
        elif ins.keyword == "RUN":
            proc = subprocess.run(["sh", "-c", ins.args], cwd=workdir, env=env, capture_output=True, text=True)
            assert proc.returncode == 0, f"RUN {ins.args}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    yield Path(env["VIRTUAL_ENV"])
    # 1.6 GB in tens of thousands of files: removed in the background rather than holding up the run.
    subprocess.Popen(["rm", "-rf", str(root)], start_new_session=True)


def _run(venv: Path, *cmd: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON", "TANDEM_"))}
    env["PATH"] = f"{venv / 'bin'}:{env['PATH']}"
    proc = subprocess.run(cmd, cwd=venv, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return proc.stdout


def test_cpu_image_venv_runs_every_service(cpu_build):
    assert "serve" in _run(cpu_build, str(cpu_build / "bin" / "tandem"), "--help")
    for service in ("gateway", "tokenizer", "kvstore", "prefill", "decode"):
        assert "--host" in _run(cpu_build, "tandem", "serve", service, "--help")


def test_cpu_image_venv_is_a_regular_install_with_the_cpu_torch(cpu_build):
    code = (
        "import importlib, torch, ucxx, transformers, gguf, tandem\n"
        "from pathlib import Path\n"
        "for m in ('gateway.server', 'tokenizer_svc.server', 'kvstore.server', 'prefill_svc.server',"
        " 'decode_svc.server', 'protos.gateway_pb2'):\n"
        "    importlib.import_module(m)\n"
        "print(torch.__version__, torch.version.cuda, Path(tandem.__file__).resolve())\n"
        "print(sorted(p.parent.name for p in (Path(tandem.__file__).parent / 'configs').glob('*/config.json')))\n"
    )
    versions, configs = _run(cpu_build, "python", "-c", code).splitlines()
    torch_version, cuda, location = versions.split()
    assert torch_version == f"{makefile_torch_pin()}+cpu" and cuda == "None"
    assert Path(location).is_relative_to(cpu_build.resolve()), "installed into the venv, not linked to the sources"
    assert "smollm2-135m" in configs  # package data made it into the wheel
