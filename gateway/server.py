"""``tandem serve gateway``: the public API (``tandem.v1.Gateway``).

The gateway validates (INVALID_ARGUMENT before any worker is touched), admits
(RESOURCE_EXHAUSTED past ``--max-inflight``), tokenizes through tokenizer_svc,
asks the kvstore index how much of the prompt is stored, and hands the rest to
``gateway.generation``. It reports NOT_SERVING until it knows the model from at
least one worker of each kind it needs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import AsyncIterator

import grpc

from gateway.detokenizer import RemoteDetokenizer
from gateway.generation import Clock, Generation, GenerationError, Output, Plan, plan_keys
from gateway.observe import RequestRecord
from gateway.stop_strings import StopMatcher
from gateway.validation import InvalidRequest, ModelLimits, check_length, validate
from gateway.workers import WorkerPool
from protos import gateway_pb2 as gpb
from protos import gateway_pb2_grpc as gpb_grpc
from protos import kvstore_pb2 as kpb
from protos import kvstore_pb2_grpc as kpb_grpc
from protos import tokenizer_pb2 as tpb
from protos import tokenizer_pb2_grpc as tpb_grpc
from tandem.metrics import RequestMetrics, add_metrics_args
from tandem.service import (
    Service,
    announce,
    channel,
    setup_logging,
    start_observability,
    start_server,
    stop_observability,
    stop_signal,
)
from tandem.settings import env_default

log = logging.getLogger("tandem.gateway")

MODES = ("disaggregated", "aggregated")
CONTROL_TIMEOUT_S = 5.0


class Gateway(gpb_grpc.GatewayServicer):
    def __init__(self, args: argparse.Namespace) -> None:
        self.mode = args.mode
        self.aggregated = args.mode == "aggregated"
        self.pool = WorkerPool([] if self.aggregated else _split(args.prefill_workers), _split(args.decode_workers),
                               args.probe_interval_s)
        self.tokenizer = tpb_grpc.TokenizerStub(channel(args.tokenizer))
        self.kvstore = None if self.aggregated else kpb_grpc.KVStoreStub(channel(args.kvstore))
        self.max_inflight = args.max_inflight
        self.inflight = 0
        self.requests_total = 0
        self.prefill_retries = 0
        self.migrations = 0
        self.migration_limit = args.migration_limit
        self.kvstore_address = args.kvstore or ""
        self.metrics = RequestMetrics()
        self.finished_by_code: Counter[str] = Counter()
        self._active_ids: set[str] = set()
        self._drops: set[asyncio.Task] = set()

    # -- what the workers serve ---------------------------------------------------------------

    def limits(self) -> ModelLimits | None:
        needed = [self.pool.decode] if self.aggregated else [self.pool.prefill, self.pool.decode]
        if not all(any(w.ready for w in ws) for ws in needed):
            return None
        ready = [w for w in self.pool.all if w.ready]
        info = self.pool.any_info()
        return ModelLimits(
            model=info.model,
            vocab_size=info.vocab_size,
            max_model_len=min(w.info.max_model_len for w in ready),
            max_request_tokens=min(w.info.num_kv_blocks * w.info.block_size for w in ready),
        )

    @property
    def block_size(self) -> int:
        return self.pool.any_info().block_size

    @property
    def fingerprint(self) -> bytes:
        return self.pool.any_info().model_fingerprint

    # -- RPCs ---------------------------------------------------------------------------------

    async def Generate(self, request: gpb.GenerateRequest, context: grpc.aio.ServicerContext):
        self.requests_total += 1
        record = RequestRecord(self.metrics, context.invocation_metadata(), self.inflight)
        if request.request_id:  # before validation: a refused request is found by its id too
            record.attributes(**{"tandem.request_id": request.request_id[:128]})
        if self.inflight >= self.max_inflight:
            message = f"the gateway is at its limit of {self.max_inflight} requests in flight; retry later"
            self.finished_by_code["RESOURCE_EXHAUSTED"] += 1
            record.finish("RESOURCE_EXHAUSTED", message, None)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
        self.inflight += 1
        self.metrics.running.inc()
        code, message, last = "CANCELLED", "", None
        try:
            async with contextlib.aclosing(self._generate(request, context, record)) as stream:
                async for msg in stream:
                    record.sent(msg)
                    last = msg
                    yield msg
            code = "OK"
        except InvalidRequest as exc:
            code, message = "INVALID_ARGUMENT", str(exc)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        except GenerationError as exc:
            code, message = exc.code.name, exc.message
            await context.abort(exc.code, exc.message)
        except asyncio.CancelledError:
            remaining = context.time_remaining()
            code = "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0 else "CANCELLED"
            raise
        finally:
            self.inflight -= 1
            self.metrics.running.dec()
            self.finished_by_code[code] += 1
            record.finish(code, message, last)

    async def _generate(self, request: gpb.GenerateRequest, context: grpc.aio.ServicerContext,
                        record: RequestRecord) -> AsyncIterator[gpb.GenerateResponse]:
        limits = self.limits()
        if limits is None:
            raise GenerationError(grpc.StatusCode.UNAVAILABLE, "no workers are ready yet")
        clock = Clock()
        valid = validate(request, limits)
        if valid.request_id in self._active_ids:
            raise InvalidRequest(f"request_id {valid.request_id!r} is already in flight")
        self._active_ids.add(valid.request_id)
        record.attributes(**{"tandem.request_id": valid.request_id})
        try:
            if valid.token_ids is not None:
                prompt = valid.token_ids
            else:
                prompt = await self._tokenize(request, context, record.metadata())
            clock.mark("tokenized")
            check_length(valid, len(prompt), limits)
            keys = plan_keys(self.fingerprint, prompt, self.block_size, request.cache_salt)
            stored = await self.stored_blocks(keys, record.start_route())
            plan = Plan(valid, prompt, keys, stored, request.cache_salt, request.priority)
            async for msg in self._run(plan, request, context, clock, record):
                yield msg
        finally:
            self._active_ids.discard(valid.request_id)

    async def _run(self, plan: Plan, request: gpb.GenerateRequest, context: grpc.aio.ServicerContext,
                   clock: Clock, record: RequestRecord) -> AsyncIterator[gpb.GenerateResponse]:
        detok = RemoteDetokenizer(self.tokenizer, request.keep_special_tokens, context.time_remaining())
        stop = StopMatcher(plan.valid.stop, request.include_stop_str_in_output)
        output = Output(plan.valid.request_id, detok, stop, len(plan.prompt), plan.valid.params.stop_token_ids)
        gen = Generation(self, plan, output, context, clock, record)
        try:
            async with contextlib.aclosing(gen.run()) as stream:
                async for msg in stream:
                    yield msg
        except grpc.aio.AioRpcError as exc:  # the Detokenize stream failed
            raise GenerationError(grpc.StatusCode.UNAVAILABLE, f"tokenizer: {exc.details()}") from exc
        except ConnectionError as exc:
            raise GenerationError(grpc.StatusCode.UNAVAILABLE, f"tokenizer: {exc}") from exc
        finally:
            await detok.close()
            self._drop_partials(gen, len(plan.prompt))

    async def ListModels(self, request: gpb.ListModelsRequest, context: grpc.aio.ServicerContext
                         ) -> gpb.ListModelsResponse:
        limits = self.limits()
        if limits is None:
            return gpb.ListModelsResponse()
        info = self.pool.any_info()
        return gpb.ListModelsResponse(models=[gpb.ModelCard(
            id=limits.model, max_model_len=limits.max_model_len, vocab_size=limits.vocab_size, dtype=info.dtype,
            mode=self.mode,
        )])

    async def Stats(self, request: gpb.GatewayStatsRequest, context: grpc.aio.ServicerContext
                    ) -> gpb.GatewayStatsResponse:
        return gpb.GatewayStatsResponse(
            inflight=self.inflight,
            requests_total=self.requests_total,
            finished_by_code=dict(self.finished_by_code),
            workers=[gpb.WorkerState(address=w.address, role=w.info.role if w.info else w.kind, healthy=w.healthy,
                                     inflight=w.inflight) for w in self.pool.all],
            prefill_retries=self.prefill_retries,
            migrations=self.migrations,
            pending_partial_drops=len(self._drops),
        )

    # -- hops ---------------------------------------------------------------------------------

    async def _tokenize(self, request: gpb.GenerateRequest, context: grpc.aio.ServicerContext,
                        metadata: list[tuple[str, str]]) -> list[int]:
        if request.WhichOneof("input") == "chat":
            req = tpb.TokenizeRequest(chat=request.chat)
        else:
            req = tpb.TokenizeRequest(text=request.prompt, add_special_tokens=request.add_special_tokens)
        try:
            res = await self.tokenizer.Tokenize(req, timeout=context.time_remaining(), metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidRequest(exc.details()) from exc
            code = exc.code() if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED else grpc.StatusCode.UNAVAILABLE
            raise GenerationError(code, f"tokenizer: {exc.details()}") from exc
        return list(res.token_ids)

    async def stored_blocks(self, keys: list[bytes], metadata: list[tuple[str, str]]) -> int:
        """How many leading blocks the kvstore holds; 0 when it cannot say (the prefill recomputes)."""
        if self.kvstore is None or not keys:
            return 0
        try:
            res = await self.kvstore.Lookup(kpb.LookupRequest(keys=keys), timeout=CONTROL_TIMEOUT_S,
                                            metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            log.warning("kvstore lookup failed (%s): routing without it", exc.code().name)
            return 0
        return len(res.blocks)

    def _drop_partials(self, gen: Generation, prompt_len: int) -> None:
        """The request is over: its request-scoped blocks (every prefill attempt's prompt tail) go, whoever
        pulled them (the store keeps them until now, for migrations)."""
        if self.kvstore is None or prompt_len % self.block_size == 0:
            return
        for rid in gen.partial_ids:
            task = asyncio.create_task(self._drop(rid))
            self._drops.add(task)
            task.add_done_callback(self._drops.discard)

    async def _drop(self, request_id: str) -> None:
        try:
            await self.kvstore.Release(kpb.ReleaseRequest(drop_partials_of=request_id), timeout=CONTROL_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:  # they expire by TTL
            log.warning("dropping partial blocks of %s failed: %s", request_id, exc.code().name)

    async def close(self) -> None:
        await self.pool.close()


def _split(addresses: str | None) -> list[str]:
    return [a.strip() for a in (addresses or "").split(",") if a.strip()]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default=env_default("--host", "127.0.0.1"), help="address to bind")
    p.add_argument("--port", type=int, default=env_default("--port", 50051), help="gRPC port (0: pick a free one)")
    p.add_argument("--mode", default=env_default("--mode", "disaggregated"), choices=MODES)
    p.add_argument("--tokenizer", default=env_default("--tokenizer", None, str), help="tokenizer_svc address")
    p.add_argument("--prefill-workers", default=env_default("--prefill-workers", "", str),
                   help="comma-separated prefill worker addresses (disaggregated mode)")
    p.add_argument("--decode-workers", default=env_default("--decode-workers", "", str),
                   help="comma-separated decode worker addresses")
    p.add_argument("--kvstore", default=env_default("--kvstore", None, str),
                   help="a kvstore node's gRPC address, for prefix lookups (disaggregated mode)")
    p.add_argument("--max-inflight", type=int, default=env_default("--max-inflight", 1024),
                   help="Generate calls in flight beyond which new ones get RESOURCE_EXHAUSTED")
    p.add_argument("--probe-interval-s", type=float, default=env_default("--probe-interval-s", 1.0),
                   help="how often workers are health-checked and their load read")
    p.add_argument("--migration-limit", type=int, default=env_default("--migration-limit", 3),
                   help="times a request may move to another decode worker (death or drain) before it fails "
                        "with UNAVAILABLE")
    add_metrics_args(p)


def check_args(args: argparse.Namespace) -> None:
    if not args.tokenizer:
        raise SystemExit("tandem serve gateway: --tokenizer is required")
    if not _split(args.decode_workers):
        raise SystemExit("tandem serve gateway: give at least one --decode-workers address")
    if args.mode == "disaggregated" and not (_split(args.prefill_workers) and args.kvstore):
        raise SystemExit("tandem serve gateway: disaggregated mode needs --prefill-workers and --kvstore")


async def serve(args: argparse.Namespace) -> None:
    gateway = Gateway(args)
    name = gpb.DESCRIPTOR.services_by_name["Gateway"].full_name
    server = await start_server([Service(name, gpb_grpc.add_GatewayServicer_to_server, gateway)], args.host,
                                args.port)
    await gateway.pool.probe_all()
    serving = None

    async def readiness() -> None:
        nonlocal serving
        while True:
            ready = gateway.limits() is not None
            if ready != serving:
                await server.set_serving(ready)
                serving = ready
            await asyncio.sleep(args.probe_interval_s)

    gateway.pool.start()
    watcher = asyncio.create_task(readiness())
    stop = stop_signal()
    extra = start_observability("gateway", args.host, server.port, args.metrics_port)
    announce("gateway", grpc=f"{args.host}:{server.port}", mode=args.mode, **extra)
    await stop.wait()
    watcher.cancel()
    await server.stop(grace=5)
    await gateway.close()
    stop_observability()


def run(args: argparse.Namespace) -> int:
    check_args(args)
    setup_logging()
    asyncio.run(serve(args))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem serve gateway")
    add_args(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
