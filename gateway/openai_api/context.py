"""An HTTP request as the gateway's ``Generate`` sees a gRPC call.

The HTTP front has no orchestration of its own: each choice of a request is one ``Gateway.Generate`` call,
made in-process with this context in place of gRPC's. So an HTTP request is admitted, authenticated,
limited, routed, traced and counted by the very code that serves gRPC clients. The context carries what
``Generate`` reads of a call: its metadata (the HTTP headers: ``authorization``, ``traceparent``), its
deadline, and how it was aborted.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import grpc

from gateway.auth import RETRY_AFTER


class HttpAbort(grpc.aio.AbortError):
    """``context.abort`` of an HTTP call: the handler stops here, as gRPC's abort stops it."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class HttpCallContext:
    """The part of ``grpc.aio.ServicerContext`` that ``Gateway.Generate`` uses."""

    def __init__(self, headers: Iterable[tuple[str, str]], timeout_s: float | None = None) -> None:
        self._metadata = tuple((name.lower(), value) for name, value in headers)
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._code: grpc.StatusCode | None = None
        self._details = ""
        self._trailing: tuple[tuple[str, str], ...] = ()

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Sequence = ()) -> None:
        if trailing_metadata:
            self.set_trailing_metadata(trailing_metadata)
        self._code, self._details = code, details
        raise HttpAbort(code, details)

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, str]]) -> None:
        self._trailing = tuple(metadata)

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def details(self) -> str:
        return self._details

    @property
    def retry_after(self) -> float | None:
        """The refusal's retry hint in seconds (``Gateway._refuse``), None without one."""
        for name, value in self._trailing:
            if name == RETRY_AFTER:
                return float(value)
        return None
