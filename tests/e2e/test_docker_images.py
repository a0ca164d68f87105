"""The CPU image's build (docker/cpu.Dockerfile), without a container engine.

No engine runs here or in CI, so the CPU image's build is replayed step by step: its COPY steps into a
temporary build context, then the RUN steps of its build stage through ``sh -c`` in a fresh virtualenv, with
the Dockerfile's ARG defaults and ENV (paths under the image's root moved into a temporary folder). The one
adaptation is the torch index: the PyTorch CPU index is not reachable here, so TORCH_INDEX_URL is this
machine's package index, where ``torch==2.13.0`` resolves to the same CPU wheel `make run` installs. The
Dockerfile reader and the static checks of both images: tests/unit/test_docker_images.py.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.test_docker_images import CPU, ROOT, expand, makefile_torch_pin, stages

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
        "from engine import cpu_ops\n"
        "print(sorted(p.name for p in cpu_ops.SOURCES + cpu_ops.HEADERS if not p.exists()))\n"
    )
    versions, configs, missing_kernel_sources = _run(cpu_build, "python", "-c", code).splitlines()
    torch_version, cuda, location = versions.split()
    assert torch_version == f"{makefile_torch_pin()}+cpu" and cuda == "None"
    assert Path(location).is_relative_to(cpu_build.resolve()), "installed into the venv, not linked to the sources"
    assert "smollm2-135m" in configs  # package data made it into the wheel
    assert missing_kernel_sources == "[]"  # the CPU kernels' sources too (built on first use)
