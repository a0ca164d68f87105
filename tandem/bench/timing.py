"""Wall-clock timing that waits for the device: a CUDA call returns before its kernels finish, so an unsynchronised
timer measures the launch. Shared by the offline bench, the step profile's GEMM yardstick and the GPU check."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


def timed(fn: Callable[[], Any], device: str = "cpu") -> float:
    """Seconds of ``fn()``, synchronised with ``device``."""
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t


def best_of(repeats: int, fn: Callable[[], Any], device: str = "cpu") -> float:
    """The fastest of ``repeats`` timed runs of ``fn()``."""
    return min(timed(fn, device) for _ in range(repeats))


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
