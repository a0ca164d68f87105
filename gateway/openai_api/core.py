"""What the HTTP front uses of the gateway (``gateway.server.Gateway``), as a type: the front depends on this
and the gateway on the front's app, never the two on each other."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from gateway.auth import ApiKey
from gateway.validation import ModelLimits
from protos import gateway_pb2 as gpb
from protos import tokenizer_pb2_grpc as tpb_grpc


class GatewayCore(Protocol):
    tokenizer: tpb_grpc.TokenizerStub
    draining: bool

    def Generate(self, request: gpb.GenerateRequest, context: Any) -> AsyncIterator[gpb.GenerateResponse]: ...  # noqa: N802

    def limits(self) -> ModelLimits | None: ...

    @property
    def fingerprint(self) -> bytes: ...

    def authenticate(self, context: Any) -> ApiKey | None: ...
