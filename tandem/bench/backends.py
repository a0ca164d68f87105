"""How ``tandem bench serve`` talks to a server: tandem's gateway over gRPC, or any
OpenAI-compatible completions server over HTTP (llama-cpp-python's, vLLM's, llama.cpp's), so
that peers are measured by the same tool on the same workload.

A backend sends one ``BenchRequest`` and fills its ``RequestRecord`` as tokens arrive; it never
raises for a failed request (the record carries the error), so one bad request does not end a run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import time
from collections.abc import AsyncIterator
from typing import Protocol
from urllib.parse import urlsplit

import grpc

from common.service import channel
from protos import common_pb2 as cpb
from protos import gateway_pb2 as gpb
from protos import gateway_pb2_grpc as gpb_grpc
from tandem.bench.datasets import BenchRequest
from tandem.bench.metrics import RequestRecord
from tandem.client import auth_metadata, stream_generate

MAX_ERROR_BODY = 300


class Backend(Protocol):
    name: str

    async def send(self, request: BenchRequest, record: RequestRecord) -> None:
        """Run ``request`` to its end, stamping ``record.token_times`` as tokens arrive."""

    async def close(self) -> None: ...


class GatewayBackend:
    """tandem's gateway: prompts as token ids (no tokenization in the measurement), greedy, and
    ``ignore_eos`` so that every request produces exactly its ``output_len`` tokens."""

    name = "tandem"

    def __init__(self, address: str, timeout: float = 600.0, api_key: str | None = None) -> None:
        self.address = address
        self.timeout = timeout
        self.metadata = auth_metadata(api_key)
        self.channel = channel(address)  # one HTTP/2 connection, one stream per request
        self.cache_salt = ""  # sent with every request: runs with different salts share no cached blocks

    async def vocab_size(self) -> int:
        """The served model's vocabulary, so that a run needs no local copy of the model."""
        try:
            reply = await gpb_grpc.GatewayStub(self.channel).ListModels(gpb.ListModelsRequest(), timeout=10,
                                                                          metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise ConnectionError(f"the gateway at {self.address} asks for an API key (UNAUTHENTICATED: "
                                      f"{exc.details()}): pass --api-key or set TANDEM_API_KEY") from exc
            raise ConnectionError(f"no gateway answers at {self.address} ({exc.code().name}): start one with "
                                  "`tandem up`, or pass --gateway") from exc
        return reply.models[0].vocab_size

    async def send(self, request: BenchRequest, record: RequestRecord) -> None:
        sampling = cpb.SamplingParams(max_tokens=request.output_len, temperature=0, ignore_eos=True)
        msg = gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=request.prompt_ids), sampling=sampling,
                                  cache_salt=self.cache_salt)
        try:
            async for reply in stream_generate(self.channel, msg, timeout=self.timeout, metadata=self.metadata):
                if reply.token_ids:
                    now = time.perf_counter()
                    record.token_times.extend([now] * len(reply.token_ids))
                if reply.HasField("usage"):
                    record.prompt_tokens = reply.usage.prompt_tokens
                    record.cached_tokens = reply.usage.cached_tokens
                if reply.HasField("timings"):
                    record.server_ttft_ms = reply.timings.ttft_ms
        except grpc.aio.AioRpcError as exc:
            record.error = exc.code().name
        record.end = time.perf_counter()

    async def close(self) -> None:
        await self.channel.close()


class HttpError(RuntimeError):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body}")
        self.status = status


class OpenAIBackend:
    """An OpenAI-compatible ``/v1/completions`` (or ``/v1/chat/completions``) server, streamed
    over server-sent events with a small asyncio HTTP/1.1 client (no extra dependency).

    The output length is forced with ``max_tokens`` = ``min_tokens`` and ``ignore_eos``: servers
    ignore the fields they do not know (llama-cpp-python honours ``min_tokens``, vLLM both).
    Every streamed chunk counts as one token, which is how these servers stream;
    ``extra_body`` adds or overrides request fields.
    """

    name = "openai"

    def __init__(self, url: str, model: str = "", extra_body: dict | None = None, timeout: float = 600.0,
                 prompt_format: str = "text", api_key: str | None = None) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--url {url!r}: expected http(s)://host:port/v1/completions")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.path = parts.path or "/v1/completions"
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.chat = self.path.rstrip("/").endswith("chat/completions")
        if self.chat and prompt_format == "ids":
            raise ValueError("chat completions take text: use --prompt-format text with a chat/completions URL")
        self.model = model
        self.extra_body = extra_body or {}
        self.timeout = timeout
        self.prompt_format = prompt_format
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.cache_salt = ""  # vLLM's and tandem's field; sent when set

    def body(self, request: BenchRequest) -> dict:
        n = request.output_len
        body: dict = {"max_tokens": n, "min_tokens": n, "ignore_eos": True, "temperature": 0.0, "stream": True,
                      "stream_options": {"include_usage": True}}
        if self.model:  # vLLM refuses a model it does not serve, "" included
            body["model"] = self.model
        prompt = request.prompt_ids if self.prompt_format == "ids" else request.prompt_text
        if prompt is None:
            raise ValueError("the request has no text prompt (datasets.attach_text was not called)")
        if self.chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if self.cache_salt:
            body["cache_salt"] = self.cache_salt
        body.update(self.extra_body)
        return body

    async def send(self, request: BenchRequest, record: RequestRecord) -> None:
        try:
            await asyncio.wait_for(self._stream(request, record), self.timeout)
        except (OSError, HttpError, ValueError, asyncio.TimeoutError, asyncio.IncompleteReadError) as exc:
            record.error = type(exc).__name__ if not isinstance(exc, HttpError) else str(exc)[:MAX_ERROR_BODY]
        record.end = time.perf_counter()

    async def _stream(self, request: BenchRequest, record: RequestRecord) -> None:
        body = json.dumps(self.body(request)).encode()
        async with contextlib.aclosing(post_sse(self.host, self.port, self.path, body, self.ssl,
                                                    self.headers)) as events:
            async for data in events:
                if data == "[DONE]":
                    break
                arrived = time.perf_counter()  # before parsing: the client's own work is not the server's latency
                event = json.loads(data)
                usage = event.get("usage") or {}
                if choices := event.get("choices"):
                    count_tokens(choices[0], usage, record, arrived)
                    if extension := choices[0].get("tandem"):  # tandem's own TTFT of the request
                        record.server_ttft_ms = extension["timings_ms"]["ttft"]
                if usage:
                    record.prompt_tokens = usage.get("prompt_tokens") or 0
                    details = usage.get("prompt_tokens_details") or {}
                    record.cached_tokens = details.get("cached_tokens") or 0

    async def close(self) -> None:
        pass


def count_tokens(choice: dict, usage: dict, record: RequestRecord, arrived: float) -> None:
    """Stamp the tokens a streamed chunk carries: as many as its running usage adds when the server sends one
    on every chunk (``continuous_usage_stats``; a chunk may carry several tokens, as a gRPC message may),
    else one per token chunk."""
    if "completion_tokens" in usage:
        record.token_times.extend([arrived] * max(usage["completion_tokens"] - len(record.token_times), 0))
    elif is_token(choice):
        record.token_times.append(arrived)


def is_token(choice: dict) -> bool:
    """A streamed chunk carries one generated token, even one whose text is empty (a special
    token the server does not print); the closing chunk (a finish reason, no text) does not."""
    return bool(chunk_text(choice)) or choice.get("finish_reason") is None


def chunk_text(choice: dict) -> str:
    """The new text of one streamed choice, completions (``text``) or chat (``delta.content``)."""
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def post_sse(host: str, port: int, path: str, body: bytes, ssl_context: ssl.SSLContext | None = None,
                   headers: dict[str, str] | None = None) -> AsyncIterator[str]:
    """POST ``body`` (JSON) and yield the ``data:`` payloads of the server-sent event stream."""
    reader, writer = await asyncio.open_connection(host, port, ssl=ssl_context)
    try:
        head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\nConnection: close\r\n"
                + "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items()) + "\r\n")
        writer.write(head.encode() + body)
        await writer.drain()
        status, headers = await read_head(reader)
        chunks = read_chunked(reader) if "chunked" in headers.get("transfer-encoding", "") else read_to_end(reader)
        if status != 200:
            text = b"".join([c async for c in chunks]).decode("utf-8", "replace")
            raise HttpError(status, text[:MAX_ERROR_BODY])
        buffer = b""
        async for chunk in chunks:
            *lines, buffer = (buffer + chunk).split(b"\n")
            for line in lines:
                if line.startswith(b"data:"):
                    yield line[5:].strip().decode("utf-8")
    finally:
        writer.close()


async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """The status code and the (lower-cased) headers of an HTTP/1.1 response."""
    status_line = (await reader.readline()).decode("latin-1")
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/"):
        raise HttpError(0, f"not an HTTP response: {status_line[:80]!r}")
    headers: dict[str, str] = {}
    while (line := (await reader.readline()).decode("latin-1").strip()):
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip().lower()
    return int(parts[1]), headers


async def read_chunked(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """The body of a ``Transfer-Encoding: chunked`` response, chunk by chunk as it arrives."""
    while True:
        size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
        if size == 0:
            while (await reader.readline()).strip():  # trailers
                pass
            return
        yield await reader.readexactly(size)
        await reader.readexactly(2)  # the CRLF after each chunk


async def read_to_end(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    while chunk := await reader.read(65536):
        yield chunk
