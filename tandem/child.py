"""How ``tandem up`` runs a service: ``python -m tandem.child -m MODULE ARGS...`` (or ``-c CODE``).

The launcher's children must die with it and may be pinned to cores. Doing that in
``preexec_fn`` runs Python between fork and exec in a copy of a process whose other
threads (gRPC's among them) hold locks, and such a child can crash before it execs.
So the child sets it up itself, first thing after exec: ``PR_SET_PDEATHSIG`` (Linux),
and the cores named in ``TANDEM_CPUS``; then it runs the service as ``python -m`` would.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    parent = int(os.environ.pop("TANDEM_PARENT_PID", "0") or 0)
    if not sys.platform.startswith("linux") or not parent:
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the launcher died before prctl took effect
        sys.exit(1)


def _pin() -> None:
    cpus = os.environ.pop("TANDEM_CPUS", "")
    if cpus:
        os.sched_setaffinity(0, [int(c) for c in cpus.split(",")])


def main() -> None:
    _die_with_parent()
    _pin()
    mode, target, *rest = sys.argv[1:]
    if mode == "-m":
        sys.argv = [target, *rest]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    elif mode == "-c":
        sys.argv = ["-c", *rest]
        exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})
    else:
        raise SystemExit(f"usage: python -m tandem.child (-m MODULE | -c CODE) [ARGS...], not {mode!r}")


if __name__ == "__main__":
    main()
