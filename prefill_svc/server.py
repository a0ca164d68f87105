"""``tandem serve prefill``: computes prompts' KV, pushes it to the kvstore, answers with the first token.

The prompt's leading blocks that the kvstore already holds (the gateway's Lookup)
are pulled instead of computed; every new block is pushed as soon as its chunk is
done, so only the last chunk's push is left when the first token is sampled. The
first token goes out at once; the handoff follows when the last blocks are
committed, so the push never delays time-to-first-token.
"""

from __future__ import annotations

import argparse
import time

import grpc

from common import telemetry, worker
from common.pb_convert import finish_reason, token_output
from engine.request import RequestOptions, RequestOutput
from kvstore.connector import KVStoreConnector
from protos import common_pb2 as cpb
from protos import worker_pb2 as wpb


class PrefillServicer(worker.WorkerServicer):
    role = "prefill"

    async def Prefill(self, request: wpb.PrefillRequest, context: grpc.aio.ServicerContext):
        await self._admit(context)
        prompt = list(request.prompt_token_ids)
        params = self._params(request.sampling, len(prompt))
        rid = request.request_id
        # The prompt's keys, computed once in this process: the engine files and pushes its blocks under
        # them, and the handoff names them.
        keys = self._block_keys(prompt, request.cache_salt)
        options = RequestOptions(priority=request.priority, cache_salt=request.cache_salt, block_hashes=keys,
                                 num_external_tokens=self._stored_tokens(request.num_stored_tokens, len(prompt)))
        ctx = telemetry.incoming(context.invocation_metadata())
        handed_off = False
        try:
            out = await self._prefill(ctx, prompt, params, rid, options)
            sampled = time.monotonic()
            worker.trace_prefill(ctx, out, len(prompt))
            yield _first_message(out)
            if out.finish_reason != "prefilled":
                return
            failed = await self.connector.wait_saved(rid)
            handoff = wpb.PrefillResponse(
                handoff=self._handoff(prompt, keys, failed), kv_push_ms=worker.ms(time.monotonic() - sampled)
            )
            # Handed off as it is sent: the gateway cancels this call as soon as it has read the handoff,
            # which can close this generator at the yield, before the line after it runs; dropping the
            # partial blocks then would take them from the decode worker about to pull them. (A gateway
            # gone before reading it leaves them to the store's TTL for partial blocks.)
            handed_off = True
            yield handoff
        finally:
            if not handed_off:
                # Nobody will pull its partial block: drop it once the engine is done with the request,
                # i.e. after the step that may still be pushing it (the abort is applied between steps).
                self.engine.abort(rid).add_done_callback(lambda _: self.connector.discard_request(rid))

    async def _prefill(self, ctx, prompt: list[int], params, rid: str, options: RequestOptions) -> RequestOutput:
        last = None
        async for out in self._outputs(ctx, prompt, params, rid, options):
            last = out
        assert last is not None and last.finished, "a producer's request ends with its first token"
        return last

    def _stored_tokens(self, hint: int, prompt_len: int) -> int:
        """Whole stored blocks to pull, leaving at least the last token to compute."""
        bs = self.core.config.block_size
        return min(hint, prompt_len - 1) // bs * bs

    def _handoff(self, prompt: list[int], keys: list[bytes], failed: int) -> cpb.KVHandoff:
        bs = self.core.config.block_size
        return cpb.KVHandoff(
            kvstore_address=self.kvstore_address,
            num_tokens=len(prompt),
            block_keys=keys,
            has_partial=len(prompt) % bs != 0,
            blocks_failed=failed,
        )


def _first_message(out: RequestOutput) -> wpb.PrefillResponse:
    times = out.times
    return wpb.PrefillResponse(
        output=token_output(out.new_token_ids, out.new_logprobs),
        finish_reason=finish_reason(out.finish_reason),
        num_cached_tokens=out.num_cached_tokens,
        queue_ms=worker.ms(times.queue) if times else 0.0,
        compute_ms=worker.ms(times.kv_load + times.prefill) if times else 0.0,
    )


def add_args(p: argparse.ArgumentParser) -> None:
    worker.add_worker_args(p, kvstore_required=True)


def make_servicer(args: argparse.Namespace) -> PrefillServicer:
    engine, connector = worker.build_engine(args, role="producer", make_connector=KVStoreConnector)
    return PrefillServicer(engine, connector, args.kvstore, args.max_waiting)


def run(args: argparse.Namespace) -> int:
    return worker.run("prefill", args, make_servicer)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem serve prefill")
    add_args(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
