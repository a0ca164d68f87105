"""tests/unit is fast and in process: no test here starts a process (no model worker, no redis-server, no CLI,
no pip) or loads the default model's weights; tiny random checkpoints (tests/conftest.py) stand in for models.
What needs processes or the real model lives in tests/e2e.

The hooks below hold every unit test to that: starting a process in a unit test's setup (its fixtures) or
body fails the test with a message that names the rule, even where the code under test catches the error.
"""

from __future__ import annotations

import _posixsubprocess
import multiprocessing.process
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

import pytest

RULE = "tests/unit starts no process; a test that needs one (or the real model) belongs in tests/e2e"


class ProcessStartedInUnitTest(AssertionError):
    """A unit test (or one of its fixtures) tried to start a process."""


@cache
def _warm_caches() -> None:
    """What the code under test caches after starting a process once, done before any guard. torch's extension
    loader runs ninja and the compiler even when the build is cached: the CPU kernels (built by `make model`)
    are loaded once (``cpu_ops.load`` caches by build folder). ``platform.platform()`` (the benchmarks' JSON)
    runs ``uname -p`` once. matplotlib's font cache (the benchmarks' plots) runs ``fc-list`` once per machine."""
    import platform

    import matplotlib.font_manager

    from engine import cpu_ops

    cpu_ops.load()
    platform.platform()
    matplotlib.font_manager.findfont("DejaVu Sans")


@contextmanager
def _no_processes(item: pytest.Item) -> Iterator[None]:
    attempts: list[str] = []

    def refuse(what: str):
        def refused(*args, **kwargs):
            call = f"subprocess.Popen({args[1]!r})" if what == "subprocess.Popen" else what  # (self, args, ...)
            attempts.append(call)
            raise ProcessStartedInUnitTest(f"{call} in {item.nodeid}: {RULE}")

        return refused

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(subprocess.Popen, "_execute_child", refuse("subprocess.Popen"))  # run, check_output, asyncio
        mp.setattr(multiprocessing.process.BaseProcess, "start", refuse("multiprocessing.Process.start"))
        mp.setattr(_posixsubprocess, "fork_exec", refuse("_posixsubprocess.fork_exec"))  # multiprocessing's spawn
        for name in ("system", "fork", "forkpty", "posix_spawn", "posix_spawnp"):
            if hasattr(os, name):
                mp.setattr(os, name, refuse(f"os.{name}"))
        try:
            yield
        finally:
            if attempts:  # also when the code under test caught the error, or raised its own
                raise ProcessStartedInUnitTest(f"{item.nodeid} tried to start a process: {', '.join(attempts)}. {RULE}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    _warm_caches()
    with _no_processes(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    with _no_processes(item):
        return (yield)
