"""What the prefill and decode workers share: the engine in its role behind an ``AsyncEngine``,
the ``Info`` and ``Stats`` RPCs, the status table of their errors, and the process entry point.

A worker is a thin shell: it converts protobuf at the edge, hands the request to
the engine, and turns the engine's outputs into messages. Requests end in the
engine however the call ends (finished, cancelled, deadline, client gone),
because ``AsyncEngine.generate`` aborts on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily

from common import telemetry
from common.engine_args import add_engine_args, engine_config
from common.metrics import TTFT_BUCKETS, add_metrics_args, counter, gauge, register_state
from common.pb_convert import sampling_from_pb
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
from common.status import DEFAULT_STATUSES, handled_view, internal
from common.tls import ServiceTLS, add_tls_args, setup
from engine.block_hash import prompt_block_hashes
from engine.errors import EngineDeadError
from engine.request import RequestHandedBack, RequestOptions, RequestOutput
from engine.sampling_params import SamplingParams
from protos import common_pb2 as cpb
from protos import worker_pb2 as wpb
from protos import worker_pb2_grpc as wpb_grpc

if TYPE_CHECKING:  # the engine loads torch: only the process that serves pays for it, not `tandem --help`
    from engine import EngineConfig
    from engine.async_engine import AsyncEngine
    from engine.engine import Engine
    from engine.kv_transfer import KVConnector, KVConnectorWorkerSide

log = logging.getLogger("tandem.worker")
ConnectorT = TypeVar("ConnectorT", bound="KVConnector")  # the service's connector class: both sides of the seam


class WorkerMetrics:
    def __init__(self) -> None:
        self.queue = Histogram("tandem_request_queue_time_seconds", "Time requests waited in this engine's queue",
                               buckets=TTFT_BUCKETS)
        self.outcomes = handled_view("tandem_worker_requests", "Prefill / Decode calls by final status",
                                     SERVICE_NAME, ("Prefill", "Decode"))


SERVICE_NAME = wpb.DESCRIPTOR.services_by_name["Worker"].full_name
METRICS = WorkerMetrics()
STATUSES = DEFAULT_STATUSES.extend({
    RuntimeError: internal(),  # the engine step failed: a bug, not the caller's fault (its message says which)
    # A tensor-parallel rank died: this worker is going away, the gateway moves the request elsewhere.
    EngineDeadError: lambda exc: (grpc.StatusCode.UNAVAILABLE, f"this worker's engine died: {exc}"),
    # Decode catches it to answer FINISH_REASON_MIGRATE; escaping anywhere else, the gateway should retry.
    RequestHandedBack: lambda exc: (grpc.StatusCode.UNAVAILABLE, f"this worker handed request {exc} back"),
})


class WorkerServicer(wpb_grpc.WorkerServicer):
    """Info, Stats and the shared plumbing; a subclass serves Prefill or Decode."""

    role = "worker"

    def __init__(self, engine: AsyncEngine, connector: KVConnectorWorkerSide | None, kvstore_address: str,
                 max_waiting: int) -> None:
        self.engine = engine
        self.core: Engine = engine.engine
        self.connector = connector  # None in aggregated mode
        self.kvstore_address = kvstore_address
        self.max_waiting = max_waiting
        self.active_rpcs = 0
        self.requests_total = 0
        self.active: set[str] = set()  # request ids of the calls in progress
        self.draining = False
        self.server: Any = None  # the RunningServer, for health during a drain

    async def Info(self, request: wpb.WorkerInfoRequest, context: grpc.aio.ServicerContext) -> wpb.WorkerInfoResponse:
        cfg, mc = self.core.config, self.core.model_config
        return wpb.WorkerInfoResponse(
            role=self.role,
            model=Path(cfg.model).name,
            model_fingerprint=self.core.fingerprint,
            block_size=cfg.block_size,
            max_model_len=cfg.max_model_len,
            vocab_size=mc.vocab_size,
            dtype=cfg.dtype,
            kvstore_address=self.kvstore_address,
            eos_token_ids=mc.eos_token_ids,
            num_kv_blocks=self.core.num_total_blocks,
        )

    async def Stats(
        self, request: wpb.WorkerStatsRequest, context: grpc.aio.ServicerContext
    ) -> wpb.WorkerStatsResponse:
        # The queues come from the engine thread's published snapshot; the counters are plain integers
        # (one atomic read each), so a reply may mix two steps but never reads a queue mid-change.
        load, stats = self.engine.load, self.core.stats
        return wpb.WorkerStatsResponse(
            num_running=load.num_running,
            num_waiting=load.num_waiting,
            num_loading=load.num_loading,
            num_requests=load.num_unfinished,
            active_rpcs=self.active_rpcs,
            used_kv_blocks=load.used_blocks,
            total_kv_blocks=load.total_blocks,
            pending_kv_pushes=self.connector.num_pending_saves if self.connector else 0,
            pending_kv_pulls=self.connector.num_pending_loads if self.connector else 0,
            requests_total=self.requests_total,
            prompt_tokens_computed=stats.prompt_tokens_computed,
            generation_tokens=stats.generation_tokens,
            kv_blocks_saved=stats.kv_blocks_saved,
            kv_blocks_loaded=stats.kv_blocks_loaded,
            kv_load_failures=stats.kv_load_failures,
            prefix_cache_hit_rate=stats.prefix_cache.hit_rate,
            num_preemptions=stats.num_preemptions,
            queued_prompt_tokens=load.queued_prompt_tokens,
            kv_staging_blocks_in_use=self.core.staging.in_use if self.core.staging else 0,
            kv_staging_fallbacks=self.core.staging.fallbacks if self.core.staging else 0,
        )

    async def Prefill(self, request: wpb.PrefillRequest, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"this is a {self.role} worker: it does not prefill")

    async def Decode(self, request: wpb.DecodeRequest, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"this is a {self.role} worker: it does not decode")

    async def Drain(self, request: wpb.DrainRequest, context: grpc.aio.ServicerContext) -> wpb.DrainResponse:
        return wpb.DrainResponse(handed_back=await self.drain())

    async def drain(self) -> int:
        """Stop admitting; hand running decodes back to the gateway (prefills just finish)."""
        self.draining = True
        if self.server is not None:
            await self.server.set_serving(False)
        if self.role == "prefill":
            return 0
        ids = list(self.active)
        for rid in ids:
            self.engine.hand_back(rid)
        log.info("draining: handed %d requests back", len(ids))
        return len(ids)

    async def wait_idle(self, timeout: float) -> bool:
        """Until no call is in progress (a drain's hand-backs reached the gateway), or ``timeout``."""
        deadline = asyncio.get_running_loop().time() + timeout
        while self.active_rpcs and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        return self.active_rpcs == 0

    async def _admit(self, context: grpc.aio.ServicerContext) -> None:
        """Refuse at the door when draining or when the queue is full: the gateway tries another worker."""
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"this {self.role} worker is draining")
        if self.engine.load.num_waiting >= self.max_waiting:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.role} worker queue is full ({self.max_waiting} waiting)"
            )

    def _params(self, p: cpb.SamplingParams, prompt_len: int) -> SamplingParams:
        """The engine's parameters, converted once at this edge; bad values raise ValueError, which the
        server's status interceptor turns into INVALID_ARGUMENT."""
        return sampling_from_pb(p, max(1, self.core.config.max_model_len - prompt_len))

    def _block_keys(self, token_ids: list[int], salt: str | None) -> list[bytes]:
        """The keys of the full blocks of ``token_ids``, hashed once per request in this process: the engine
        gets them through ``RequestOptions.block_hashes`` instead of hashing again. They are hashed before the
        engine has checked the tokens: an id a key cannot hold is a ValueError (INVALID_ARGUMENT)."""
        return prompt_block_hashes(self.core.fingerprint, token_ids, self.core.config.block_size, salt)

    async def _outputs(
        self, ctx: Any, prompt: list[int], params: SamplingParams, request_id: str, options: RequestOptions,
    ) -> AsyncIterator[RequestOutput]:
        """The engine's outputs for one call, counted in Stats and metrics; what the engine raises is the
        call's status (``STATUSES``: bad input INVALID_ARGUMENT, an engine failure INTERNAL).

        ``ctx`` is the request's trace context: its KV transfers are traced under it.
        """
        self.active_rpcs += 1
        self.requests_total += 1
        self.active.add(request_id)
        if self.connector is not None:
            self.connector.trace(request_id, ctx)
        try:
            stream = self.engine.generate(prompt, params, request_id, options)
            async with contextlib.aclosing(stream):
                async for out in stream:
                    if out.times is not None:
                        METRICS.queue.observe(out.times.queue)
                    yield out
        finally:
            self.active_rpcs -= 1
            self.active.discard(request_id)
            if self.connector is not None:
                self.connector.trace(request_id, None)

    def engine_state(self) -> list[Any]:
        """What /metrics reads of the engine at scrape time."""
        load, stats = self.engine.load, self.core.stats
        pc = stats.prefix_cache
        return [
            gauge("tandem_num_requests_running", "Requests in the engine's running batch", load.num_running),
            gauge("tandem_num_requests_waiting", "Requests waiting for the engine", load.num_waiting),
            gauge("tandem_num_requests_loading_kv", "Requests waiting for KV from the kvstore", load.num_loading),
            gauge("tandem_kv_cache_usage_perc", "Fraction of KV blocks held by requests",
                  load.used_blocks / load.total_blocks if load.total_blocks else 0.0),
            counter("tandem_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", pc.query_tokens),
            counter("tandem_prefix_cache_hits", "Prompt tokens found in the prefix cache", pc.hit_tokens),
            counter("tandem_engine_prompt_tokens_computed", "Prompt tokens run through the model",
                    stats.prompt_tokens_computed),
            counter("tandem_engine_generation_tokens", "Tokens sampled by the engine", stats.generation_tokens),
            counter("tandem_num_preemptions", "Requests preempted for lack of KV blocks", stats.num_preemptions),
            counter("tandem_kv_load_failures", "KV loads that failed and were recomputed", stats.kv_load_failures),
            gauge("tandem_num_requests_compiling_grammar", "Requests waiting for their structured-output grammar",
                  self.engine.num_compiling),
            counter("tandem_structured_output_tokens", "Tokens sampled under a structured-output constraint",
                    stats.structured_tokens),
            counter("tandem_grammar_compiles", "Structured-output grammars compiled (cache misses)",
                    self.core.grammars.compiles),
            counter("tandem_grammar_cache_hits", "Structured-output grammars found compiled",
                    self.core.grammars.cache_hits),
            counter("tandem_grammar_errors", "Requests ended because their grammar allowed no further token",
                    stats.grammar_errors),
            *self._spec_metrics(),
        ]

    def _spec_metrics(self) -> list[Any]:
        """Speculative decoding, with vLLM's names; none without it."""
        spec = self.core.spec
        if spec is None:
            return []
        s = spec.stats
        per_position = CounterMetricFamily("tandem_spec_decode_num_accepted_tokens_per_pos",
                                           "Drafts whose token at this position was accepted", labels=["position"])
        for position, n in enumerate(s.accepted_per_position):
            per_position.add_metric([str(position)], n)
        return [
            counter("tandem_spec_decode_num_drafts", "Verifications of a draft", s.num_drafts),
            counter("tandem_spec_decode_num_draft_tokens", "Tokens proposed by the draft", s.num_draft_tokens),
            counter("tandem_spec_decode_num_accepted_tokens", "Proposed tokens the target accepted",
                    s.num_accepted_tokens),
            per_position,
        ]


def trace_prefill(ctx: Any, out: RequestOutput, prompt_len: int) -> None:
    """``prefill.queue`` and ``prefill.compute`` from the engine's own stamps."""
    t = out.times
    if t is None:
        return
    telemetry.span_at("prefill.queue", ctx, t.arrival, t.scheduled)
    telemetry.span_at("prefill.compute", ctx, t.scheduled, t.first_token, {
        "gen_ai.usage.input_tokens": prompt_len,
        "tandem.cached_tokens": out.num_cached_tokens,
        "tandem.computed_tokens": prompt_len - out.num_cached_tokens,
        "tandem.kv_load_ms": t.kv_load * 1000,
    })


def ms(seconds: float) -> float:
    return seconds * 1000.0


def add_worker_args(p: argparse.ArgumentParser, kvstore_required: bool) -> None:
    add_engine_args(p)
    g = p.add_argument_group("worker")
    g.add_argument("--host", default=env_default("--host", "127.0.0.1"), help="address to bind")
    g.add_argument("--port", type=int, default=env_default("--port", 0), help="gRPC port (0: pick a free one)")
    help_kv = "the kvstore node's gRPC address" + ("" if kvstore_required else " (none: aggregated mode)")
    g.add_argument("--kvstore", default=env_default("--kvstore", None, str), required=kvstore_required and
                   env_default("--kvstore", None, str) is None, help=help_kv)
    g.add_argument("--max-waiting", type=int, default=env_default("--max-waiting", 1024),
                   help="requests queued in the engine beyond which new ones are refused (RESOURCE_EXHAUSTED)")
    g.add_argument("--drain-timeout-s", type=float, default=env_default("--drain-timeout-s", 10.0),
                   help="on SIGTERM, how long running calls may take to finish or be handed back")
    g.add_argument("--push-generated-blocks", action=argparse.BooleanOptionalAction,
                   default=env_default("--push-generated-blocks", True, bool),
                   help="decode: push full blocks of generated tokens to the kvstore as they fill, so that a "
                        "migrated request pulls them instead of recomputing (on by default: `tandem bench "
                        "migration` measured pulling 2-6x faster)")
    add_metrics_args(g)
    add_tls_args(p)


def build_engine(
    args: argparse.Namespace, role: str, make_connector: Callable[[str, EngineConfig], ConnectorT] | None = None
) -> tuple[AsyncEngine, ConnectorT | None]:
    """The engine in ``role``, with ``make_connector(kvstore_address, config)``'s connector when
    ``--kvstore`` is given (the service passes the kvstore's: this floor never imports a service).

    The connector comes back as the service's own class, not as one side of the seam: the engine
    drives it as a ``KVConnector``, the servicer as a ``KVConnectorWorkerSide``, and a type checker
    checks both where the service passes it on."""
    from engine.async_engine import AsyncEngine
    from engine.engine import Engine

    config = engine_config(args)
    config.role = role
    config.push_generated_blocks = args.push_generated_blocks
    connector = make_connector(args.kvstore, config) if args.kvstore and make_connector else None
    return AsyncEngine(Engine(config, connector)), connector


async def serve(name: str, servicer: WorkerServicer, args: argparse.Namespace, tls: ServiceTLS | None = None) -> bool:
    """Serve until SIGTERM (then drain; True) or until the engine dies (False: the process should exit
    with an error, so that it is restarted)."""
    server = await start_server(
        [Service(SERVICE_NAME, wpb_grpc.add_WorkerServicer_to_server, servicer, STATUSES)],
        args.host,
        args.port,
        tls,
    )
    stop = stop_signal()
    loop = asyncio.get_running_loop()
    servicer.engine.engine.on_dead(lambda why: loop.call_soon_threadsafe(stop.set))  # a rank died: exit
    servicer.server = server
    register_state(servicer.engine_state)
    extra = start_observability(name, args.host, server.port, args.metrics_port)
    announce(name, grpc=f"{args.host}:{server.port}", role=servicer.role, **server.ready_fields(args.host), **extra)
    await stop.wait()
    if servicer.engine.dead is not None:  # its calls already failed UNAVAILABLE: nothing to drain
        log.error("the %s worker stops: %s", name, servicer.engine.dead)
        await server.stop(grace=1)
        stop_observability()
        return False
    # SIGTERM drains: readiness goes false, running decodes are handed back to the gateway (which
    # moves them to other workers), running prefills finish; then the server stops.
    await servicer.drain()
    await servicer.wait_idle(args.drain_timeout_s)
    await server.stop(grace=1)
    stop_observability()
    return True


def run(name: str, args: argparse.Namespace, make: Callable[[argparse.Namespace], WorkerServicer]) -> int:
    setup_logging()
    tls = setup(args, name)  # before make: the kvstore connector opens its channel there
    try:
        servicer = make(args)
    except ValueError as exc:  # no model yet, a bad engine flag: say so, no traceback
        log.error("the %s worker cannot start: %s", name, exc)
        return 1
    try:
        ok = asyncio.run(serve(name, servicer, args, tls))
    finally:
        servicer.engine.shutdown()
        if servicer.connector is not None:
            servicer.connector.close()
    return 0 if ok else 1
