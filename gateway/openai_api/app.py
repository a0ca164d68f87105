"""The OpenAI-compatible HTTP API of a gateway: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``,
``/health`` and ``/metrics``, as a FastAPI app that shares the gateway object (and event loop) of the gRPC
API. Each choice of a request is one in-process ``Gateway.Generate`` call (``gateway.openai_api.context``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from starlette.exceptions import HTTPException
from starlette.responses import Response

from gateway.auth import AuthError
from gateway.detokenizer import RemoteDetokenizer
from gateway.generation import GenerationError
from gateway.openai_api.context import HttpCallContext
from gateway.openai_api.convert import Plan, chat_plan, completion_plan
from gateway.openai_api.core import GatewayCore
from gateway.openai_api.errors import ApiError, from_exception, from_status, too_large
from gateway.openai_api.exchange import Exchange
from gateway.openai_api.fanout import Fanout
from gateway.openai_api.observe import HTTP_REQUESTS, HttpRecord
from gateway.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from gateway.openai_api.render import Render
from gateway.openai_api.token_names import TokenNames

ECHO_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class HttpSettings:
    keepalive_s: float = 5.0  # a stream's SSE comment interval while it waits for its first token
    stream_buffer: int = 1024  # messages a client may fall behind before its request is cancelled
    max_request_bytes: int = 16 * 2**20


class OpenAIFront:
    def __init__(self, gateway: GatewayCore, settings: HttpSettings) -> None:
        self.gateway = gateway
        self.settings = settings
        self.names = TokenNames(gateway.tokenizer)

    async def generate(self, request: Request, kind: str) -> Response:
        route = request.url.path
        try:
            body = await _read_body(request, self.settings.max_request_bytes)
            if kind == "chat":
                plan = chat_plan(ChatCompletionRequest.model_validate_json(body))
            else:
                plan = completion_plan(CompletionRequest.model_validate_json(body))
            echoes = await self._echoes(plan, request)
        except Exception as exc:
            return _error(route, from_exception(exc))
        record = HttpRecord(route, request.headers.items(), len(plan.choices))
        fanout = Fanout(self.gateway, plan.choices, record.headers, self.settings.stream_buffer)
        limits = self.gateway.limits()
        model = limits.model if limits is not None else ""
        fingerprint = f"fp_{self.gateway.fingerprint.hex()[:12]}" if limits is not None else ""
        render = Render(plan, kind, model, fingerprint, self.names if plan.logprobs is not None else None)
        return AsgiResponse(Exchange(plan, fanout, render, echoes, self.settings.keepalive_s, record))

    async def models(self, request: Request) -> Response:
        try:
            self.gateway.authenticate(HttpCallContext(request.headers.items()))
        except AuthError as exc:
            return _error(request.url.path, from_status(exc.code, exc.message))
        limits = self.gateway.limits()
        data = [] if limits is None else [{
            "id": limits.model, "object": "model", "created": int(time.time()), "owned_by": "tandem",
            "root": limits.model, "max_model_len": limits.max_model_len,
        }]
        return _json(request.url.path, 200, {"object": "list", "data": data})

    def health(self, request: Request) -> Response:
        if self.gateway.draining:
            return _error(request.url.path, from_status(grpc.StatusCode.UNAVAILABLE, "the gateway is shutting down"))
        if self.gateway.limits() is None:
            return _error(request.url.path, from_status(grpc.StatusCode.UNAVAILABLE, "no workers are ready yet"))
        return _json(request.url.path, 200, {"status": "ok"})

    async def _echoes(self, plan: Plan, request: Request) -> dict[int, str]:
        """completions' ``echo``: each choice's prompt as text (token ids are decoded by tokenizer_svc)."""
        echoes: dict[int, str] = {}
        for c in plan.choices:
            if isinstance(c.echo, str):
                echoes[c.index] = c.echo
            elif c.echo is not None:
                echoes[c.index] = await self._decode(c.echo, not c.request.keep_special_tokens)
        return echoes

    async def _decode(self, ids: list[int], skip_special: bool) -> str:
        detok = RemoteDetokenizer(self.gateway.tokenizer, not skip_special, ECHO_TIMEOUT_S)
        try:
            return await detok.push(ids, finish=True)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise from_status(exc.code(), f"`prompt`: {exc.details()}") from exc
            raise GenerationError(grpc.StatusCode.UNAVAILABLE, f"tokenizer: {exc.details()}") from exc
        finally:
            await detok.close()


class AsgiResponse(Response):
    """Hands the connection to an ASGI app of its own (``Exchange``) once FastAPI has routed the request."""

    def __init__(self, app: Exchange) -> None:
        super().__init__()
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        await self.app(scope, receive, send)


def create_app(gateway: GatewayCore, settings: HttpSettings | None = None) -> FastAPI:
    front = OpenAIFront(gateway, settings or HttpSettings())
    app = FastAPI(title="tandem", summary="OpenAI-compatible API of a tandem gateway", docs_url=None,
                  redoc_url=None)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await front.generate(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await front.generate(request, "chat")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await front.models(request)

    @app.get("/health")
    async def health(request: Request) -> Response:
        return front.health(request)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:  # unknown routes, wrong methods
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(request.url.path, ApiError(exc.status_code, str(exc.detail), kind))

    app.state.front = front
    return app


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 past ``limit`` bytes (the gRPC port's --max-request-bytes) before it is
    all read."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise too_large(int(declared), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _json(route: str, status: int, body: dict, headers: dict[str, str] | None = None) -> Response:
    HTTP_REQUESTS.labels(route, str(status)).inc()
    return JSONResponse(body, status, headers)


def _error(route: str, error: ApiError) -> Response:
    return _json(route, error.status, error.body(), error.headers())
