"""``tandem serve tokenizer``: text and chat messages to token ids, and incremental
detokenization of generated ids, for one model folder over gRPC (``tandem.v1.Tokenizer``).

The service keeps no state between calls except an open Detokenize stream's, so the gateway
may run as many replicas as it likes. Tokenizing is CPU work: large inputs go to a worker
thread so that one long prompt does not stall every other stream on the event loop.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc
from prometheus_client import Gauge, Histogram

from common import telemetry
from common.engine_args import resolve_model
from common.metrics import TTFT_BUCKETS, add_metrics_args
from common.service import (
    Service,
    announce,
    setup_logging,
    start_observability,
    start_server,
    stop_observability,
    stop_signal,
)
from common.settings import env_default
from common.status import DEFAULT_STATUSES, internal
from common.tls import ServiceTLS, add_tls_args, setup
from protos import tokenizer_pb2 as pb
from protos import tokenizer_pb2_grpc as pb_grpc
from tokenizer_svc.tokenizer import IncrementalDetokenizer, TextTokenizer, TokenizerInputError

log = logging.getLogger("tandem.tokenizer")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Tokenizer"].full_name
# Below these sizes a thread hop costs more than the work itself: run inline on the event loop.
INLINE_CHARS = 4096
INLINE_IDS = 1024
MAX_TOKEN_STRINGS = 4096
# A caller's mistake is a TokenizerInputError (a ValueError: INVALID_ARGUMENT); anything else is a bug here.
STATUSES = DEFAULT_STATUSES.extend({Exception: internal("tokenizer service bug; see its log")})

T = TypeVar("T")


@dataclass(slots=True)
class Counters:
    tokenize_calls: int = 0
    detokenize_streams: int = 0  # opened since start
    active_detokenize_streams: int = 0


class TokenizerService(pb_grpc.TokenizerServicer):
    """The servicer: protobuf in and out here, ``TextTokenizer`` and ``IncrementalDetokenizer`` inside."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer
        self.counters = Counters()

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        self.counters.tokenize_calls += 1
        kind = request.WhichOneof("input")
        with telemetry.server_span("tokenizer.tokenize", context.invocation_metadata(),
                                   {"tandem.input": kind or ""}) as span, METRICS.tokenize_seconds.time():
            if kind == "text":
                res = await self._tokenize_text(request.text, request.add_special_tokens)
            elif kind == "chat":
                res = await self._tokenize_chat(request.chat)
            else:
                raise TokenizerInputError("the request has no input: set `text` or `chat`")
            span.set_attribute("gen_ai.usage.input_tokens", len(res.token_ids))
            return res

    async def Detokenize(
        self, request_iterator: AsyncIterator[pb.DetokenizeRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.DetokenizeResponse]:
        """One response per request; the stream ends after the request with ``finish``."""
        self.counters.detokenize_streams += 1
        self.counters.active_detokenize_streams += 1
        METRICS.active.inc()
        try:
            async for response in self._detokenize(request_iterator):
                yield response
        finally:  # gRPC ends the requests or cancels this handler at its await when the client goes away
            self.counters.active_detokenize_streams -= 1
            METRICS.active.dec()

    async def TokenStrings(
        self, request: pb.TokenStringsRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenStringsResponse:
        ids = list(request.token_ids)
        if len(ids) > MAX_TOKEN_STRINGS:
            raise TokenizerInputError(f"at most {MAX_TOKEN_STRINGS} token ids per call, not {len(ids)}")
        self.tokenizer.check_ids(ids)
        tok = self.tokenizer
        return pb.TokenStringsResponse(texts=[tok.token_text(i) for i in ids], raw=[tok.token_bytes(i) for i in ids])

    async def Info(
        self, request: pb.TokenizerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizerInfoResponse:
        tok = self.tokenizer
        return pb.TokenizerInfoResponse(
            vocab_size=tok.vocab_size, has_chat_template=tok.has_chat_template, eos_token_ids=tok.eos_token_ids
        )

    async def Stats(
        self, request: pb.TokenizerStatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizerStatsResponse:
        c = self.counters
        return pb.TokenizerStatsResponse(
            tokenize_calls=c.tokenize_calls,
            detokenize_streams=c.detokenize_streams,
            active_detokenize_streams=c.active_detokenize_streams,
        )

    async def _tokenize_text(self, text: str, add_special_tokens: bool) -> pb.TokenizeResponse:
        if not text:
            raise TokenizerInputError("`text` is empty; send the prompt to tokenize")
        ids = await _cpu(functools.partial(self.tokenizer.encode, text, add_special_tokens), len(text), INLINE_CHARS)
        return pb.TokenizeResponse(token_ids=ids)

    async def _tokenize_chat(self, chat: pb.ChatMessages) -> pb.TokenizeResponse:
        messages = [{"role": m.role, "content": m.content} for m in chat.messages]
        size = sum(len(m.content) for m in chat.messages)
        work = functools.partial(self._render_and_encode, messages, chat.continue_final_message)
        rendered, ids = await _cpu(work, size, INLINE_CHARS)
        return pb.TokenizeResponse(token_ids=ids, rendered=rendered)

    def _render_and_encode(self, messages: list[dict[str, str]], continue_final: bool) -> tuple[str, list[int]]:
        rendered = self.tokenizer.render_chat(messages, continue_final_message=continue_final)
        # The template writes any BOS itself, as transformers' apply_chat_template assumes.
        return rendered, self.tokenizer.encode(rendered, add_special_tokens=False)

    async def _detokenize(self, requests: AsyncIterator[pb.DetokenizeRequest]) -> AsyncIterator[pb.DetokenizeResponse]:
        detok: IncrementalDetokenizer | None = None
        async for request in requests:
            if detok is None:
                detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=not request.keep_special_tokens)
            ids = list(request.token_ids)
            self.tokenizer.check_ids(ids)
            text = await _cpu(functools.partial(_step, detok, ids, request.finish), len(ids), INLINE_IDS)
            yield pb.DetokenizeResponse(text=text)
            if request.finish:
                return


def _step(detok: IncrementalDetokenizer, ids: list[int], finish: bool) -> str:
    text = detok.push(ids)
    return text + detok.flush() if finish else text


async def _cpu(fn: Callable[[], T], size: int, inline_limit: int) -> T:
    """Small jobs inline, large ones on a worker thread so the event loop keeps serving."""
    return fn() if size <= inline_limit else await asyncio.to_thread(fn)


class TokenizerMetrics:
    def __init__(self) -> None:
        self.tokenize_seconds = Histogram("tandem_tokenizer_tokenize_seconds", "Time to tokenize one prompt",
                                          buckets=TTFT_BUCKETS)
        self.active = Gauge("tandem_tokenizer_active_detokenize_streams", "Detokenize streams open now")


METRICS = TokenizerMetrics()


def build_service(tokenizer: TextTokenizer) -> Service:
    """The servicer as ``start_server`` takes it (tests start one in-process with this)."""
    return Service(SERVICE_NAME, pb_grpc.add_TokenizerServicer_to_server, TokenizerService(tokenizer), STATUSES)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=env_default("--model", None, str), help="local Hugging Face folder with "
                   "tokenizer.json (default: the bundled SmolLM2-135M-Instruct; env TANDEM_MODEL)")
    p.add_argument("--host", default=env_default("--host", "127.0.0.1"), help="address to bind and advertise")
    p.add_argument("--port", type=int, default=env_default("--port", 0), help="gRPC port (0: pick a free one)")
    add_metrics_args(p)
    add_tls_args(p)


async def serve(args: argparse.Namespace, tls: ServiceTLS | None = None) -> None:
    """Serve until SIGINT / SIGTERM, then stop gracefully (health NOT_SERVING first, then drain)."""
    tls = tls or setup(args, "tokenizer")
    model = resolve_model(args.model)
    tokenizer = TextTokenizer(model)
    running = await start_server([build_service(tokenizer)], args.host, args.port, tls)
    stop = stop_signal()
    log.info("model %s: vocab %d, eos ids %s, chat template %s", model, tokenizer.vocab_size,
             list(tokenizer.eos_token_ids), "yes" if tokenizer.has_chat_template else "no")
    extra = start_observability("tokenizer", args.host, running.port, args.metrics_port)
    announce("tokenizer", grpc=f"{args.host}:{running.port}", **running.ready_fields(args.host), **extra)
    await stop.wait()
    await running.stop()
    stop_observability()


def run(args: argparse.Namespace) -> int:
    setup_logging()
    tls = setup(args, "tokenizer")
    try:
        asyncio.run(serve(args, tls))
    except (OSError, ValueError) as exc:  # no model or tokenizer.json, port taken
        log.error("the tokenizer service cannot start: %s", exc)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem serve tokenizer")
    add_args(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
