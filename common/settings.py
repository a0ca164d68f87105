"""Flag defaults that can also come from ``TANDEM_*`` environment variables.

The same names serve ``tandem`` on a laptop and the Helm chart in a cluster:
flag ``--max-num-seqs`` <-> ``TANDEM_MAX_NUM_SEQS``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def env_name(flag: str) -> str:
    return "TANDEM_" + flag.lstrip("-").replace("-", "_").upper()


def env_default(flag: str, default: T, cast: Callable[[str], T] | None = None) -> T:
    raw = os.environ.get(env_name(flag))
    if raw is None:
        return default
    cast = cast or (type(default) if default is not None else str)
    if cast is bool:
        return raw.strip().lower() in ("1", "true", "yes", "on")  # type: ignore[return-value]
    try:
        return cast(raw)
    except ValueError as exc:
        raise SystemExit(f"{env_name(flag)}={raw!r} is not a valid value: {exc}") from exc
