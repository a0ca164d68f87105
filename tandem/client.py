"""A client of the gateway: ``stream_generate`` for programs (benchmarks, tests) and the
terminal printer behind ``tandem generate``.

Everything here speaks only the public API (protos/gateway.proto), so it works the same
against ``tandem up`` on a laptop and a gateway in a cluster.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import grpc

from common.service import channel
from common.tls import ClientTLS
from protos import common_pb2, gateway_pb2, gateway_pb2_grpc, tokenizer_pb2

if TYPE_CHECKING:
    from engine.structured import StructuredOutput

DEFAULT_GATEWAY = "127.0.0.1:50051"

FINISH_PREFIX = "FINISH_REASON_"


def build_request(
    prompt: str,
    *,
    raw: bool = False,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    request_id: str = "",
    structured: common_pb2.StructuredOutput | None = None,
) -> gateway_pb2.GenerateRequest:
    """A Generate request: the prompt as one user chat message (``raw``: as plain text); None leaves a
    sampling field unset so the server's default applies. ``structured``: the answer's constraint."""
    sampling = common_pb2.SamplingParams()
    for name, value in (("max_tokens", max_tokens), ("temperature", temperature), ("top_p", top_p),
                        ("top_k", top_k), ("seed", seed)):
        if value is not None:
            setattr(sampling, name, value)
    if structured is not None:
        sampling.structured.CopyFrom(structured)
    request = gateway_pb2.GenerateRequest(request_id=request_id, sampling=sampling, stop=list(stop))
    if raw:
        request.prompt = prompt
    else:
        request.chat.CopyFrom(tokenizer_pb2.ChatMessages(messages=[tokenizer_pb2.ChatMessage(role="user",
                                                                                             content=prompt)]))
    return request


def structured_output(args: Any) -> StructuredOutput | None:
    """The ``engine.structured.StructuredOutput`` the structured-output flags ask for, or None; a flag's value
    that names a file is read from it. Raises ValueError on a malformed one."""
    from engine.structured import StructuredOutput

    if args.json_object:
        return StructuredOutput("json_object")
    if args.choice:
        return StructuredOutput("choice", choices=tuple(args.choice))
    for kind, value in (("json_schema", args.json_schema), ("regex", args.regex), ("grammar", args.grammar)):
        if value is not None:
            path = Path(value)
            text = path.read_text() if kind != "regex" and len(value) < 4096 and path.is_file() else value
            return StructuredOutput(kind, text)
    return None


async def stream_generate(
    target: str | grpc.aio.Channel,
    request: gateway_pb2.GenerateRequest,
    *,
    timeout: float | None = None,
    metadata: Sequence[tuple[str, str]] | None = None,
    tls: ClientTLS | None = None,
) -> AsyncIterator[gateway_pb2.GenerateResponse]:
    """Yield the gateway's responses to ``request`` as they arrive.

    ``target`` is an address (a channel is opened and closed here) or a channel the caller
    reuses across calls (benchmarks). ``timeout`` is the call's deadline in seconds. Leaving
    the loop early, or cancelling the task, cancels the RPC, which frees the request's blocks
    along the whole chain; wrap in ``contextlib.aclosing`` to make that happen at once on ``break``.
    ``tls``: how to reach a gateway that serves TLS (for an address; a channel brings its own).
    Errors are raised as ``grpc.aio.AioRpcError``.
    """
    owned = channel(target, tls) if isinstance(target, str) else None
    call = gateway_pb2_grpc.GatewayStub(owned or target).Generate(request, timeout=timeout, metadata=metadata)
    try:
        async for response in call:
            yield response
    finally:
        call.cancel()  # a no-op once the stream has ended
        if owned is not None:
            await owned.close()


@dataclass(slots=True)
class StreamStats:
    """What the client itself saw, for when the server's timings are missing."""

    start: float
    first: float | None = None
    end: float | None = None
    tokens: int = 0


def auth_metadata(api_key: str | None) -> list[tuple[str, str]]:
    """The metadata that carries an API key to a gateway that asks for one (``--api-keys-file``)."""
    return [("authorization", f"Bearer {api_key}")] if api_key else []


def finish_name(reason: int) -> str:
    """``FINISH_REASON_LENGTH`` -> ``length``."""
    return common_pb2.FinishReason.Name(reason).removeprefix(FINISH_PREFIX).lower()


def _ttft_breakdown(t: common_pb2.Timings) -> str:
    parts = [("tokenize", t.tokenize_ms), ("route", t.route_ms), ("prefill queue", t.prefill_queue_ms),
             ("prefill", t.prefill_compute_ms or t.prefill_ms), ("kv push", t.kv_push_ms),
             ("first token", t.first_token_ms)]
    shown = [f"{name} {ms:.0f}" for name, ms in parts if ms > 0]
    return f" ({', '.join(shown)})" if shown else ""


def format_summary(last: gateway_pb2.GenerateResponse | None, stats: StreamStats) -> str:
    """One line for stderr: tokens, finish reason, TTFT and its breakdown, decode speed."""
    usage, t = (last.usage, last.timings) if last is not None else (common_pb2.Usage(), common_pb2.Timings())
    tokens = usage.completion_tokens or stats.tokens
    ttft_ms = t.ttft_ms or ((stats.first - stats.start) * 1000 if stats.first else float("nan"))
    e2e_ms = t.e2e_ms or (((stats.end or time.perf_counter()) - stats.start) * 1000)
    decode_s = (e2e_ms - ttft_ms) / 1000
    tps = (tokens - 1) / decode_s if tokens > 1 and decode_s > 0 else float("nan")
    finish = finish_name(last.finish_reason) if last is not None else "none"
    if last is not None and last.stop_reason:
        finish += f" ({last.stop_reason!r})"
    items = [f"{tokens} tokens", f"finish={finish}", f"ttft {ttft_ms:.0f} ms{_ttft_breakdown(t)}"]
    if t.kv_pull_ms or t.decode_queue_ms:
        items.append(f"kv pull {t.kv_pull_ms:.0f} ms, decode queue {t.decode_queue_ms:.0f} ms")
    items += [f"{tps:.1f} tok/s decode", f"e2e {e2e_ms:.0f} ms"]
    if usage.prompt_tokens:
        items.append(f"prompt {usage.prompt_tokens} ({usage.cached_tokens} cached)")
    return "[" + ", ".join(items) + "]"


async def print_stream(
    address: str, request: gateway_pb2.GenerateRequest, timeout: float, out: TextIO, err: TextIO,
    tls: ClientTLS | None = None, api_key: str | None = None,
) -> int:
    """Stream the answer's text to ``out`` and the summary to ``err``; the exit code (1 on an RPC error)."""
    stats = StreamStats(start=time.perf_counter())
    last = None
    try:
        async for response in stream_generate(address, request, timeout=timeout, tls=tls,
                                              metadata=auth_metadata(api_key)):
            stats.first = stats.first or time.perf_counter()
            stats.tokens += len(response.token_ids)
            out.write(response.text)
            out.flush()
            last = response
    except grpc.aio.AioRpcError as exc:
        if stats.first:
            out.write("\n")
        print(f"tandem generate: {exc.code().name}: {exc.details()}{_hint(exc, address, tls)}", file=err)
        return 1
    stats.end = time.perf_counter()
    out.write("\n")
    out.flush()
    print(format_summary(last, stats), file=err)
    return 0


def _hint(exc: grpc.aio.AioRpcError, address: str, tls: ClientTLS | None = None) -> str:
    if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
        return " (give the gateway's API key with --api-key or TANDEM_API_KEY)"
    if exc.code() != grpc.StatusCode.UNAVAILABLE:
        return ""
    if tls is None:
        return (f" (is a gateway running at {address}? start one with `tandem up`, or use --local; "
                "if it serves TLS, give --tls-ca)")
    return (f" (is a gateway running at {address}, serving TLS with a certificate that --tls-ca signed and that "
            "names that host (else --tls-server-name)? start one with `tandem up --tls`)")


def generate_to_terminal(
    address: str,
    request: gateway_pb2.GenerateRequest,
    timeout: float = 300.0,
    out: TextIO | None = None,
    err: TextIO | None = None,
    tls: ClientTLS | None = None,
    api_key: str | None = None,
) -> int:
    """``tandem generate`` without --local; Ctrl-C cancels the call (exit code 130)."""
    out, err = out or sys.stdout, err or sys.stderr
    try:
        return asyncio.run(print_stream(address, request, timeout, out, err, tls, api_key))
    except KeyboardInterrupt:
        print("\ntandem generate: cancelled", file=err)
        return 130
