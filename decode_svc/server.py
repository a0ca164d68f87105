"""``tandem serve decode``: continuous-batching decode that pulls the prompt's KV from the kvstore.

A request arrives with the prefill's first token and a handoff naming its blocks;
the engine (consumer role) admits it when blocks are free, pulls them, and the
worker streams one message per step. Without ``--kvstore`` the worker is
aggregated: it prefills requests itself (chunked, mixed into decode steps).
"""

from __future__ import annotations

import argparse
import logging
import time

import grpc

from common import telemetry, worker
from common.pb_convert import finish_reason, token_output
from common.status import outcome
from engine.request import RequestHandedBack, RequestOptions, RequestOutput
from kvstore.connector import KVStoreConnector
from protos import common_pb2 as cpb
from protos import worker_pb2 as wpb

log = logging.getLogger("tandem.decode")


class DecodeServicer(worker.WorkerServicer):
    @property
    def role(self) -> str:
        return "decode" if self.connector is not None else "aggregated"

    async def Decode(self, request: wpb.DecodeRequest, context: grpc.aio.ServicerContext):
        await self._admit(context)
        prompt, outputs = list(request.prompt_token_ids), list(request.output_token_ids)
        params = self._params(request.sampling, len(prompt))
        external, keys = 0, None
        if request.HasField("handoff"):
            external, keys = await self._check_handoff(request, prompt + outputs, context)
        options = RequestOptions(priority=request.priority, cache_salt=request.cache_salt, output_token_ids=outputs,
                                 num_external_tokens=external, block_hashes=keys)
        ctx = telemetry.incoming(context.invocation_metadata())
        stream = StreamTrace(ctx, len(prompt), prefills=not request.HasField("handoff") and not outputs)
        try:
            async for out in self._outputs(ctx, prompt, params, request.request_id, options):
                first = stream.step(out)
                yield _message(out, first)
            stream.finish("OK")
        except RequestHandedBack:
            stream.finish("HANDED_BACK")
            if self.connector is not None:  # the blocks it pushed are in the store for the next worker
                await self.connector.wait_saved(request.request_id)
            yield wpb.DecodeResponse(finish_reason=cpb.FINISH_REASON_MIGRATE)
        except BaseException as exc:  # the status the server's interceptor ends the call with
            stream.finish(outcome(exc, context, worker.STATUSES)[0])
            raise

    async def _check_handoff(self, request: wpb.DecodeRequest, tokens: list[int],
                             context: grpc.aio.ServicerContext) -> tuple[int, list[bytes]]:
        """How many leading tokens of ``tokens`` (prompt + outputs) to pull: what the handoff names, unless
        its blocks are not ours (then everything is recomputed here); and this worker's own keys of the
        full blocks among them, which the engine takes instead of hashing those tokens again.

        Only the handoff's range is hashed: a trailing partial block it names is pulled by request, not
        by key, so the engine must not be given a key for it (``Engine.add_request`` refuses one).
        """
        if self.connector is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this aggregated worker has no kvstore: send the request without a handoff")
        n, total, bs = request.handoff.num_tokens, len(tokens), self.core.config.block_size
        if not 0 <= n < total:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the handoff covers {n} tokens; the request "
                                f"has {total}, and at least the last one is computed here")
        if n % bs and n != len(request.prompt_token_ids):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"a handoff covers whole blocks of {bs} tokens, or the whole prompt; got {n}")
        mine = self._block_keys(tokens[:n], request.cache_salt)
        if list(request.handoff.block_keys) != mine:
            # Another model, dtype or block size produced them: pulling would load foreign bytes.
            log.warning("request %s: the handed-off block keys are not this worker's; recomputing",
                        request.request_id)
            return 0, mine
        return n, mine


class StreamTrace:
    """The decode side of a request's trace: its queue, first step (or, aggregated, its prefill) and
    the stream, with inter-token percentiles; no span per token."""

    def __init__(self, ctx, prompt_len: int, prefills: bool) -> None:
        self.ctx = ctx
        self.prompt_len = prompt_len
        self.prefills = prefills
        self.stamps: list[float] = []
        self.start: float | None = None
        self.tokens = 0
        self.first_tokens = 0  # in the first message: the inter-token time counts the others
        self.finish_reason = ""
        self.spec = (0, 0)  # speculative decoding: tokens proposed, tokens accepted
        self.done = False

    def step(self, out: RequestOutput) -> bool:
        """Record one output; True for the first."""
        first = not self.stamps
        self.stamps.append(time.monotonic())
        self.tokens += len(out.new_token_ids)
        if first:
            self.first_tokens = len(out.new_token_ids)
        self.finish_reason = out.finish_reason or ""
        self.spec = (out.num_draft_tokens, out.num_accepted_tokens)
        if first and out.times is not None:
            self._first(out)
        return first

    def _first(self, out: RequestOutput) -> None:
        t = out.times
        self.start = t.first_token
        if self.prefills:  # aggregated: this worker did the prefill
            worker.trace_prefill(self.ctx, out, self.prompt_len)
            return
        telemetry.span_at("decode.queue", self.ctx, t.arrival, t.scheduled)
        telemetry.span_at("decode.first_step", self.ctx, t.loaded, t.first_token,
                          {"tandem.cached_tokens": out.num_cached_tokens})

    def finish(self, code: str) -> None:
        if self.done or not self.stamps:
            return
        self.done = True
        gaps = sorted(b - a for a, b in zip(self.stamps, self.stamps[1:], strict=False))
        attrs = {"gen_ai.usage.output_tokens": self.tokens, "tandem.finish_reason": self.finish_reason,
                 "rpc.grpc.status_code": code}
        if gaps:
            attrs.update({f"itl_p{p}_ms": 1000 * gaps[min(len(gaps) - 1, int(len(gaps) * p / 100))]
                          for p in (50, 90, 99)})
            # per token, not per message: a speculative step streams several tokens in one message
            attrs["tpot_ms"] = 1000 * (self.stamps[-1] - self.stamps[0]) / max(1, self.tokens - self.first_tokens)
        drafted, accepted = self.spec
        if drafted:
            attrs.update({"tandem.spec.draft_tokens": drafted, "tandem.spec.accepted_tokens": accepted,
                          "tandem.spec.acceptance_rate": accepted / drafted})
        end = time.monotonic()
        span = telemetry.tracer().start_span("decode.stream", context=self.ctx, attributes=attrs,
                                             start_time=telemetry.wall_ns(self.start or self.stamps[0]))
        if code != "OK":
            telemetry.fail(span, code)
        span.end(end_time=telemetry.wall_ns(end))


def _message(out: RequestOutput, first: bool) -> wpb.DecodeResponse:
    msg = wpb.DecodeResponse(
        output=token_output(out.new_token_ids, out.new_logprobs),
        finish_reason=finish_reason(out.finish_reason),
    )
    if first:
        msg.num_cached_tokens = out.num_cached_tokens
        if out.times is not None:
            msg.queue_ms = worker.ms(out.times.queue)
            msg.kv_pull_ms = worker.ms(out.times.kv_load)
            msg.prefill_ms = worker.ms(out.times.prefill)
    return msg


def add_args(p: argparse.ArgumentParser) -> None:
    worker.add_worker_args(p, kvstore_required=False)


def make_servicer(args: argparse.Namespace) -> DecodeServicer:
    engine, connector = worker.build_engine(args, role="consumer" if args.kvstore else "both",
                                            make_connector=KVStoreConnector)
    return DecodeServicer(engine, connector, args.kvstore or "", args.max_waiting)


def run(args: argparse.Namespace) -> int:
    return worker.run("decode", args, make_servicer)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem serve decode")
    add_args(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
