"""The CPU kernels of ``engine/csrc`` (their Python module is ``bindings.cpp``), compiled once per machine and cached.

They are built with the machine's compiler for its own instruction set (``-march=native``),
so the build happens here rather than in a wheel: on first use, or ahead of time with
``tandem build-kernels`` (``make model`` runs it). Builds go under the engine's
``EngineConfig.kernel_cache_dir`` (tandem's services pass ``$TANDEM_HOME/kernels``; the default is
``~/.cache/tandem/kernels``), keyed by the source's hash and this CPU's feature flags (a cache
shared between machines never hands one a build for another's instruction set); concurrent
builds from several processes wait on torch's build lock. ``TANDEM_CPU_MARCH`` names another target
for ``-march`` (``x86-64-v3``: AVX2 and FMA without AVX-512), for a kernel cache built for the oldest CPU of a
mixed fleet, or to run the AVX2 paths on an AVX-512 machine; like torch's own ``TORCH_CUDA_ARCH_LIST`` it is a
setting of the build, read here, not of the engine (set it where the processes run: the Helm chart's
``extraEnv``). ``EngineConfig.cpu_kernels=False``
(``--no-cpu-kernels``, ``TANDEM_CPU_KERNELS=0``) turns them off, and the engine then runs the same
model in plain torch ops; so does a machine without a compiler, with a warning.
"""

from __future__ import annotations

import hashlib
import logging
import os
from functools import cache
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

# bindings.cpp first: the one file that includes pybind11, the longest compile, starts first.
SOURCES = [Path(__file__).parent / "csrc" / name
           for name in ("bindings.cpp", "cpu_ops.cpp", "quant_ops.cpp", "packed_linear.cpp", "argmax.cpp",
                        "prefill_attention.cpp")]
# Not compiled on their own; part of the build's key.
HEADERS = [Path(__file__).parent / "csrc" / name
           for name in ("cpu_ops.h", "decode_stack.h", "simd_math.h", "amx_tiles.h")]
MARCH = os.environ.get("TANDEM_CPU_MARCH") or "native"  # the instruction set the kernels are built for
# -fno-math-errno lets loops that call exp vectorise (glibc's vector expf); no reassociation is allowed
# beyond the reductions marked `omp simd`, and no FMA contraction, so element-wise results round like
# eager torch's.
CFLAGS = ["-O3", f"-march={MARCH}", "-fopenmp", "-ffp-contract=off", "-fno-math-errno"]
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "tandem" / "kernels"


def build_dir(cache_dir: Path | str | None = None) -> Path:
    """This source's and this CPU's build folder under ``cache_dir``."""
    key = b"".join(src.read_bytes() for src in SOURCES + HEADERS) + " ".join(CFLAGS).encode() + cpu_flags().encode()
    return Path(cache_dir or DEFAULT_CACHE_DIR) / f"cpu_ops-{hashlib.sha256(key).hexdigest()[:16]}"


@cache
def cpu_flags() -> str:
    """This CPU's feature flags line of /proc/cpuinfo ("" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def build(cache_dir: Path | str | None = None) -> ModuleType:
    """Compile (or load the cached build of) the kernels; raises when the toolchain fails."""
    import torch.utils.cpp_extension as ext

    path = build_dir(cache_dir)
    path.mkdir(parents=True, exist_ok=True)
    return ext.load(name="tandem_cpu_ops", sources=[str(src) for src in SOURCES], extra_cflags=CFLAGS,
                    extra_ldflags=["-fopenmp"], build_directory=str(path), verbose=False)


def load(cache_dir: Path | str | None = None) -> ModuleType | None:
    """The kernels, or None when they cannot be built here (with a warning). Loaded once per build folder
    and process, however the folder is named (torch's loader runs ninja again on every call)."""
    return _load(build_dir(cache_dir))


@cache
def _load(path: Path) -> ModuleType | None:
    try:
        return build(path.parent)
    except Exception as exc:  # no compiler, no headers: plain torch ops still serve the model
        log.warning("CPU kernels unavailable, using plain torch ops (slower decode): %s", exc)
        return None
