"""Errors the engine raises that callers answer differently from a bug."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine cannot step any more (a tensor-parallel rank died): its requests fail as UNAVAILABLE,
    so the gateway moves them to another worker, and the worker exits to be restarted."""
