"""Answering one completions request over HTTP: a whole JSON response, or a server-sent event stream.

The answer is an ASGI app of its own so that it owns the connection from the first moment: it watches
for the client going away (before the first token, mid-stream, or while a whole response is being
built) and then cancels the request's Generate calls, which free their blocks and leases exactly as a
cancelled gRPC call does.

A stream waits for its first message up to ``keepalive_s`` before it sends its headers, so a request
refused early (a bad parameter, a key over its limit, no worker) gets its own HTTP status. A prefill
that takes longer gets ``200`` and an SSE comment every ``keepalive_s`` until the first token, so that
proxies and clients do not time the connection out; an error after that is an ``error`` event.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from gateway.openai_api.convert import Plan
from gateway.openai_api.errors import ApiError, from_exception
from gateway.openai_api.fanout import Event, Fanout
from gateway.openai_api.observe import HttpRecord
from gateway.openai_api.render import Render

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]
KEEPALIVE = b": keep-alive\n\n"
DONE = b"data: [DONE]\n\n"


class Exchange:
    def __init__(self, plan: Plan, fanout: Fanout, render: Render, echoes: dict[int, str], keepalive_s: float,
                 record: HttpRecord) -> None:
        self.plan = plan
        self.fanout = fanout
        self.render = render
        self.echoes = echoes
        self.keepalive_s = keepalive_s
        self.record = record  # the request's span and its count by status
        self.started = False  # the response's headers are out

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.fanout.start()
        answer = asyncio.create_task(self._answer(send))  # answers errors itself: it never raises
        gone = asyncio.create_task(_disconnect(receive))
        try:
            await asyncio.wait((answer, gone), return_when=asyncio.FIRST_COMPLETED)
            if not answer.done():
                self.record.status(499)  # nginx's "client closed request": the status nobody is left to see
        finally:
            for task in (answer, gone):
                task.cancel()
            await asyncio.gather(answer, gone, return_exceptions=True)
            await self.fanout.close()
            self.record.end()

    async def _answer(self, send: Send) -> None:
        try:
            if self.plan.stream:
                await self._stream(send)
            else:
                await self._whole(send)
        except Exception as exc:
            error = exc if isinstance(exc, ApiError) else from_exception(exc)
            if self.started:
                await _write(send, _event(error.body()) + DONE, more=False)
            else:
                await send_json(send, error.status, error.body(), error.headers())
            self.record.status(error.status)

    async def _whole(self, send: Send) -> None:
        while self.fanout.pending:
            event = await self.fanout.next()
            self._raise(event)
            if event.message is not None:
                state = await self.render.absorb(event.index, event.message)
                self.render.keep(state, event.message)
        await send_json(send, 200, self.render.response(self.echoes))
        self.record.status(200)

    async def _stream(self, send: Send) -> None:
        first = await self.fanout.next(self.keepalive_s)
        self._raise(first)
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        self.started = True
        event = first
        echoed: set[int] = set()
        while True:
            if event is None:
                await _write(send, KEEPALIVE)
            elif event.message is not None:
                state = await self.render.absorb(event.index, event.message)
                echo = "" if event.index in echoed else self.echoes.get(event.index, "")
                echoed.add(event.index)
                await _write(send, _event(self.render.chunk(state, event.message, echo)))
            if not self.fanout.pending:
                break
            event = await self.fanout.next(self.keepalive_s)
            self._raise(event)
        tail = _event(self.render.usage_chunk()) if self.plan.include_usage else b""
        await _write(send, tail + DONE, more=False)
        self.record.status(200)

    def _raise(self, event: Event | None) -> None:
        if event is not None and event.error is not None:
            raise from_exception(event.error, event.retry_after)


async def _disconnect(receive: Receive) -> None:
    """Returns when the client has gone (the request's body was read before the exchange began)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def send_json(send: Send, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
    data = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": data})


async def _write(send: Send, data: bytes, more: bool = True) -> None:
    await send({"type": "http.response.body", "body": data, "more_body": more})


def _event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"

