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
from collections.abc import AsyncIterator, Callable

import grpc
from google.protobuf.message import DecodeError, Message

from common.metrics import RequestMetrics, add_metrics_args
from common.service import (
    Service,
    announce,
    channel,
    setup_logging,
    start_observability,
    start_server,
    stop_observability,
    stop_signal,
)
from common.settings import env_default
from common.status import outcome
from common.tls import ServiceTLS, add_tls_args, setup
from engine.block_hash import prompt_block_hashes
from gateway.auth import RETRY_AFTER, ApiKey, AuthError, KeyRing, KeysFileError, Lease
from gateway.detokenizer import RemoteDetokenizer
from gateway.generation import Backends, Clock, Generation, GenerationError, Output, Plan
from gateway.observe import RequestRecord, Reroutes
from gateway.stop_strings import StopMatcher
from gateway.validation import MAX_REQUEST_BYTES, InvalidRequest, ModelLimits, check_constraint, check_length, validate
from gateway.workers import Resolver, WorkerPool, parse_dns, resolve_dns
from protos import gateway_pb2 as gpb
from protos import gateway_pb2_grpc as gpb_grpc
from protos import kvstore_pb2 as kpb
from protos import kvstore_pb2_grpc as kpb_grpc
from protos import tokenizer_pb2 as tpb
from protos import tokenizer_pb2_grpc as tpb_grpc

log = logging.getLogger("tandem.gateway")

MODES = ("disaggregated", "aggregated")
CONTROL_TIMEOUT_S = 5.0
RETRY_AFTER_FULL_S = 1.0  # the hint when the gateway is at --max-inflight
SERVICE_NAME = gpb.DESCRIPTOR.services_by_name["Gateway"].full_name


class Gateway(gpb_grpc.GatewayServicer):
    def __init__(self, args: argparse.Namespace, metrics: RequestMetrics | None = None,
                 resolver: Resolver = resolve_dns) -> None:
        self.mode = args.mode
        self.aggregated = args.mode == "aggregated"
        self.pool = WorkerPool([] if self.aggregated else _split(args.prefill_workers), _split(args.decode_workers),
                               args.probe_interval_s, args.discovery_interval_s, resolver)
        self.tokenizer = tpb_grpc.TokenizerStub(channel(args.tokenizer))
        self.kvstore = None if self.aggregated else kpb_grpc.KVStoreStub(channel(args.kvstore))
        self.max_inflight = args.max_inflight
        self.inflight = 0
        self.requests_total = 0
        self.draining = False
        self.metrics = metrics or RequestMetrics()
        self.reroutes = Reroutes(self.metrics)
        self.backends = Backends(self.pool, self.stored_blocks, self.reroutes, self.aggregated, args.migration_limit,
                                 args.kvstore or "")
        self.metrics.running.set_function(lambda: self.inflight)  # read at scrape time, as other state
        # API keys (gateway.auth): None, no authentication.
        self.keys = KeyRing.load(args.api_keys_file) if args.api_keys_file else None
        self.max_prompt_tokens = args.max_prompt_tokens
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
            max_prompt_tokens=self.max_prompt_tokens,
        )

    @property
    def block_size(self) -> int:
        return self.pool.any_info().block_size

    @property
    def fingerprint(self) -> bytes:
        return self.pool.any_info().model_fingerprint

    # -- RPCs ---------------------------------------------------------------------------------

    async def drain(self, server, timeout: float) -> None:
        """Stop admitting (readiness false first, then UNAVAILABLE to new calls) and let the streams
        in flight finish, for up to ``timeout`` seconds: what SIGTERM does before the process exits."""
        self.draining = True
        await server.set_serving(False)
        deadline = asyncio.get_running_loop().time() + timeout
        while self.inflight and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        if self.inflight:
            log.warning("drain timeout: %d streams still in flight are cut", self.inflight)

    async def Generate(self, request: gpb.GenerateRequest, context: grpc.aio.ServicerContext):
        self.requests_total += 1
        if self.draining:
            self.finished_by_code["UNAVAILABLE"] += 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this gateway is shutting down; retry (another "
                                "replica, or this one once it is back)")
        record = RequestRecord(self.metrics, context.invocation_metadata(), self.inflight)
        if isinstance(request, gpb.GenerateRequest) and request.request_id:  # a refused request is found by id too
            record.attributes(**{"tandem.request_id": request.request_id[:128]})
        tenant: ApiKey | None = None
        lease: Lease | None = None
        try:
            tenant = self.authenticate(context, record)
            lease = self.keys.admit(tenant) if tenant is not None else None
        except AuthError as exc:
            await self._refuse(context, record, tenant, exc.code, exc.message, exc.retry_after)
        if self.inflight >= self.max_inflight:
            if lease is not None:
                lease.release()
            await self._refuse(context, record, tenant, grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"the gateway is at its limit of {self.max_inflight} requests in flight; retry later",
                               RETRY_AFTER_FULL_S)
        self.inflight += 1
        code, message, last = "CANCELLED", "", None
        try:
            async with contextlib.aclosing(self._generate(request, context, record, tenant)) as stream:
                async for msg in stream:
                    record.sent(msg)
                    last = msg
                    yield msg
            code = "OK"
        except BaseException as exc:  # the server's status interceptor ends the call with this status
            code, message = outcome(exc, context)
            raise
        finally:
            self.inflight -= 1
            self.finished_by_code[code] += 1
            if lease is not None:
                lease.release()
            self._count_key(tenant, code)
            record.finish(code, message, last)

    def authenticate(self, context: grpc.aio.ServicerContext, record: RequestRecord | None = None
                     ) -> ApiKey | None:
        """The caller's key (None with authentication off); AuthError when it is missing or unknown."""
        if self.keys is None:
            return None
        key = self.keys.authenticate(context.invocation_metadata())
        if record is not None:
            record.attributes(**{"tandem.api_key": key.name})  # the key's name; the key itself never
        return key

    async def _refuse(self, context: grpc.aio.ServicerContext, record: RequestRecord, tenant: ApiKey | None,
                      code: grpc.StatusCode, message: str, retry_after: float | None = None) -> None:
        """End a Generate call before it is admitted; ``retry_after`` (seconds) goes out as the trailing
        metadata ``retry-after``, HTTP's Retry-After on the OpenAI-compatible front."""
        if retry_after is not None:
            context.set_trailing_metadata(((RETRY_AFTER, f"{retry_after:.3f}"),))
        self.finished_by_code[code.name] += 1
        self._count_key(tenant, code.name)
        record.finish(code.name, message, None)
        await context.abort(code, message)

    def _count_key(self, tenant: ApiKey | None, code: str) -> None:
        if tenant is not None:
            self.metrics.api_key_requests.labels(tenant.name, code).inc()

    async def _check_call(self, request: object, context: grpc.aio.ServicerContext) -> None:
        """The checks of the unary RPCs: an API key (when on; an AuthError carries its status), a message
        that parsed."""
        self.authenticate(context)
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)

    async def _generate(self, request: gpb.GenerateRequest, context: grpc.aio.ServicerContext,
                        record: RequestRecord, tenant: ApiKey | None) -> AsyncIterator[gpb.GenerateResponse]:
        if isinstance(request, Malformed):
            raise InvalidRequest(request.error)
        limits = self.limits()
        if limits is None:
            raise GenerationError(grpc.StatusCode.UNAVAILABLE, "no workers are ready yet")
        clock = Clock()
        valid = validate(request, limits)
        await check_constraint(valid)
        if valid.request_id in self._active_ids:
            raise InvalidRequest(f"request_id {valid.request_id!r} is already in flight")
        self._active_ids.add(valid.request_id)
        if not request.request_id:  # a given one is on the span since admission
            record.attributes(**{"tandem.request_id": valid.request_id})
        if valid.params.structured is not None:  # which constraint, never its text (a schema can be large)
            record.attributes(**{"tandem.structured_output": valid.params.structured.kind})
        try:
            if valid.token_ids is not None:
                prompt = valid.token_ids
            else:
                prompt = await self._tokenize(request, context, record.metadata())
            clock.mark("tokenized")
            check_length(valid, len(prompt), limits)
            salt = tenant.salt(request.cache_salt) if tenant is not None else request.cache_salt
            fingerprint, block_size = self.fingerprint, self.block_size
            keys = prompt_block_hashes(fingerprint, prompt, block_size, salt)  # "" and None: no salt alike
            stored = await self.stored_blocks(keys, record.start_route())
            plan = Plan(valid, prompt, keys, stored, salt, request.priority, block_size, fingerprint)
            async for msg in self._run(plan, request, context, clock, record):
                yield msg
        finally:
            self._active_ids.discard(valid.request_id)

    async def _run(self, plan: Plan, request: gpb.GenerateRequest, context: grpc.aio.ServicerContext,
                   clock: Clock, record: RequestRecord) -> AsyncIterator[gpb.GenerateResponse]:
        detok = RemoteDetokenizer(self.tokenizer, request.keep_special_tokens, context.time_remaining())
        stop = StopMatcher(plan.valid.stop, request.include_stop_str_in_output)
        output = Output(plan.valid.request_id, detok, stop, len(plan.prompt), plan.valid.params.stop_token_ids)
        gen = Generation(self.backends, plan, output, context, clock, record)
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
        await self._check_call(request, context)
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
        await self._check_call(request, context)
        return gpb.GatewayStatsResponse(
            inflight=self.inflight,
            requests_total=self.requests_total,
            finished_by_code=dict(self.finished_by_code),
            workers=[gpb.WorkerState(address=w.address, role=w.info.role if w.info else w.kind, healthy=w.healthy,
                                     inflight=w.inflight) for w in self.pool.all],
            prefill_retries=self.reroutes.prefill_retries,
            migrations=self.reroutes.migrations,
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


class Malformed:
    """Stands in for a request message that does not parse: the RPC answers INVALID_ARGUMENT with ``error``
    (the generated parsers raise, which gRPC answers with UNKNOWN)."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


def _parser(cls: type[Message]) -> Callable[[bytes], Message | Malformed]:
    def parse(data: bytes) -> Message | Malformed:
        try:
            return cls.FromString(data)
        except DecodeError as exc:
            reason = str(exc).rpartition(": ")[2] or "it does not parse"
            return Malformed(f"the request is not a valid {cls.DESCRIPTOR.full_name} message: {reason}")

    return parse


def add_gateway_servicer(servicer: Gateway, server: grpc.aio.Server) -> None:
    """``add_GatewayServicer_to_server`` with parsers that make a malformed message the client's mistake."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, _parser(gpb.GenerateRequest), gpb.GenerateResponse.SerializeToString),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            servicer.ListModels, _parser(gpb.ListModelsRequest), gpb.ListModelsResponse.SerializeToString),
        "Stats": grpc.unary_unary_rpc_method_handler(
            servicer.Stats, _parser(gpb.GatewayStatsRequest), gpb.GatewayStatsResponse.SerializeToString),
    }
    assert set(handlers) == set(gpb.DESCRIPTOR.services_by_name["Gateway"].methods_by_name)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)  # as the generated code: the faster dispatch


def _split(addresses: str | None) -> list[str]:
    return [a.strip() for a in (addresses or "").split(",") if a.strip()]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default=env_default("--host", "127.0.0.1"), help="address to bind")
    p.add_argument("--port", type=int, default=env_default("--port", 50051), help="gRPC port (0: pick a free one)")
    p.add_argument("--mode", default=env_default("--mode", "disaggregated"), choices=MODES)
    p.add_argument("--tokenizer", default=env_default("--tokenizer", None, str), help="tokenizer_svc address")
    p.add_argument("--prefill-workers", default=env_default("--prefill-workers", "", str),
                   help="comma-separated prefill worker addresses (disaggregated mode): host:port, or "
                        "dns:///HOST:PORT for every address HOST resolves to (e.g. a Kubernetes headless Service), "
                        "resolved again every --discovery-interval-s")
    p.add_argument("--decode-workers", default=env_default("--decode-workers", "", str),
                   help="comma-separated decode worker addresses: host:port or dns:///HOST:PORT (see "
                        "--prefill-workers)")
    p.add_argument("--discovery-interval-s", type=float, default=env_default("--discovery-interval-s", 5.0),
                   help="how often dns:/// worker entries are resolved again: new addresses are health-checked "
                        "and then routed to, addresses gone get no new requests (their streams finish)")
    p.add_argument("--kvstore", default=env_default("--kvstore", None, str),
                   help="a kvstore node's gRPC address, for prefix lookups (disaggregated mode)")
    p.add_argument("--max-inflight", type=int, default=env_default("--max-inflight", 1024),
                   help="Generate calls in flight beyond which new ones get RESOURCE_EXHAUSTED")
    p.add_argument("--probe-interval-s", type=float, default=env_default("--probe-interval-s", 1.0),
                   help="how often workers are health-checked and their load read")
    p.add_argument("--drain-timeout-s", type=float, default=env_default("--drain-timeout-s", 30.0),
                   help="on SIGTERM, how long streams in flight may take to finish before the gateway exits")
    p.add_argument("--migration-limit", type=int, default=env_default("--migration-limit", 3),
                   help="times a request may move to another decode worker (death or drain) before it fails "
                        "with UNAVAILABLE")
    p.add_argument("--api-keys-file", default=env_default("--api-keys-file", None, str),
                   help="YAML or JSON file of API key entries (name, sha256 of the key, optional limits; "
                        "`tandem keys add NAME` writes one); read again when it changes. Unset: no authentication")
    p.add_argument("--max-prompt-tokens", type=int, default=env_default("--max-prompt-tokens", 0),
                   help="longest prompt in tokens a client may send (0: what the model and the KV cache take)")
    p.add_argument("--max-request-bytes", type=int, default=env_default("--max-request-bytes", MAX_REQUEST_BYTES),
                   help="largest request message on the public ports; gRPC refuses larger ones (RESOURCE_EXHAUSTED), "
                        "HTTP with 413")
    g = p.add_argument_group("OpenAI-compatible HTTP API (gateway/openai_api)")
    g.add_argument("--http-port", type=int, default=env_default("--http-port", 8000),
                   help="port of /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics "
                        "(0: a free one, announced on the READY line; -1: off)")
    g.add_argument("--http-keepalive-s", type=float, default=env_default("--http-keepalive-s", 5.0),
                   help="a stream waits this long for its first token before it answers 200 and sends SSE "
                        "keep-alive comments at this interval (earlier refusals keep their own HTTP status)")
    g.add_argument("--http-stream-buffer", type=int, default=env_default("--http-stream-buffer", 1024),
                   help="messages an HTTP client may fall behind its stream before its request is cancelled")
    add_metrics_args(p)
    add_tls_args(p, public=True)


def check_args(args: argparse.Namespace) -> None:
    if not args.tokenizer:
        raise SystemExit("tandem serve gateway: --tokenizer is required")
    if not _split(args.decode_workers):
        raise SystemExit("tandem serve gateway: give at least one --decode-workers address")
    for entry in _split(args.decode_workers) + _split(args.prefill_workers):
        try:
            parse_dns(entry)
        except ValueError as exc:
            raise SystemExit(f"tandem serve gateway: {exc}") from exc
    if args.http_keepalive_s <= 0 or args.http_stream_buffer < 1:
        raise SystemExit("tandem serve gateway: --http-keepalive-s must be > 0 and --http-stream-buffer >= 1")
    if args.discovery_interval_s <= 0:
        raise SystemExit("tandem serve gateway: --discovery-interval-s must be > 0")
    if args.mode == "disaggregated" and not (_split(args.prefill_workers) and args.kvstore):
        raise SystemExit("tandem serve gateway: disaggregated mode needs --prefill-workers and --kvstore")
    if args.api_keys_file:
        try:
            KeyRing.load(args.api_keys_file)
        except KeysFileError as exc:
            raise SystemExit(f"tandem serve gateway: {exc}") from exc


async def serve(args: argparse.Namespace, tls: ServiceTLS | None = None) -> None:
    tls = tls or setup(args, "gateway", public=True)  # before Gateway: it opens the internal channels
    gateway = Gateway(args)
    name = gpb.DESCRIPTOR.services_by_name["Gateway"].full_name
    server = await start_server([Service(name, add_gateway_servicer, gateway)], args.host,
                                args.port, tls, max_receive_bytes=args.max_request_bytes)
    await gateway.pool.discover()
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
    http = await _start_http(gateway, args)
    extra = start_observability("gateway", args.host, server.port, args.metrics_port)
    if http is not None:
        extra["http"] = f"{args.host}:{http.port}"
    announce("gateway", grpc=f"{args.host}:{server.port}", mode=args.mode, **server.ready_fields(args.host), **extra)
    await stop.wait()
    watcher.cancel()
    await gateway.drain(server, args.drain_timeout_s)  # both APIs: HTTP calls are Generate calls too
    if http is not None:
        await http.stop()
    await server.stop(grace=1)
    await gateway.close()
    stop_observability()


async def _start_http(gateway: Gateway, args: argparse.Namespace):
    """The OpenAI-compatible API on --http-port (None when -1); FastAPI is imported only when it is on."""
    if args.http_port < 0:
        return None
    from gateway.openai_api.app import HttpSettings, create_app
    from gateway.openai_api.http_server import start_http

    settings = HttpSettings(args.http_keepalive_s, args.http_stream_buffer, args.max_request_bytes)
    return await start_http(create_app(gateway, settings), args.host, args.http_port, args)


def run(args: argparse.Namespace) -> int:
    check_args(args)
    setup_logging()
    tls = setup(args, "gateway", public=True)
    asyncio.run(serve(args, tls))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem serve gateway")
    add_args(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
