"""tests/unit's own rule (tests/unit/conftest.py): a unit test that starts a process fails, saying why, even
when the code under test catches the error."""

from __future__ import annotations

import asyncio
import os
import subprocess
from types import SimpleNamespace

import pytest

from tests.unit.conftest import ProcessStartedInUnitTest, _no_processes

ITEM = SimpleNamespace(nodeid="tests/unit/test_x.py::test_y")


def test_a_subprocess_fails_the_test_and_names_the_rule():
    expected = r"test_y tried to start a process: subprocess.Popen\(\['true'\]\).* belongs in tests/e2e"
    with pytest.raises(ProcessStartedInUnitTest, match=expected):
        with _no_processes(ITEM):
            try:
                subprocess.run(["true"], check=True)
            except ProcessStartedInUnitTest:
                pass  # caught by the code under test: the test fails all the same


@pytest.mark.parametrize("start", [
    lambda: os.system("true"),
    lambda: asyncio.run(asyncio.create_subprocess_exec("true")),
    lambda: os.posix_spawn("/bin/true", ["true"], {}),
], ids=["os.system", "asyncio", "posix_spawn"])
def test_other_ways_to_start_a_process_fail_too(start):
    with pytest.raises(ProcessStartedInUnitTest, match="tried to start a process"):
        with _no_processes(ITEM):
            try:
                start()
            except ProcessStartedInUnitTest:
                pass
