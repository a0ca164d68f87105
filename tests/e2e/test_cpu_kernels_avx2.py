"""The kernels' AVX2 + FMA paths (Zen 1-3, Intel's cores from Haswell to Alder Lake) on a CPU with AVX-512.

A build for this CPU compiles its AVX-512 loops and never the AVX2 ones, which would then be checked only when CI
happens to land on an older machine. Here the kernels are built for ``x86-64-v3`` (``TANDEM_CPU_MARCH``, a cache
folder of their own) and test_cpu_kernels.py and test_quantization.py run against that build in a child process:
every kernel against the eager reference, the engine end to end included.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from engine import cpu_ops

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or "avx512f" not in cpu_ops.cpu_flags(),
    reason="this CPU's own build already runs the AVX2 paths (or it is not x86)")


def _child(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TANDEM_CPU_MARCH": "x86-64-v3"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)


def test_the_x86_64_v3_build_has_no_avx512():
    """The build really is the older target's: 8-lane kernels, no bfloat16 dot products; prefill attention is
    served there too (its AVX2 form)."""
    probe = ("import torch; from engine import cpu_ops; ops = cpu_ops.load(); "
             "print(cpu_ops.MARCH, ops.SIMD, ops.DOT_BF16, ops.prefill_attention_supported(torch.empty(1, 1, 64)))")
    done = _child("-c", probe)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["x86-64-v3", "avx2", "False", "True"]


def test_the_avx2_kernels_pass_the_kernel_tests():
    done = _child("-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/unit/test_cpu_kernels.py",
                  "tests/unit/test_quantization.py")
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " passed" in done.stdout.splitlines()[-1]
