"""The gateway's view of its workers: reachability, load, and which prefixes each one holds.

Routing is least-loaded with prefix awareness. A worker's load is the prompt
tokens it still has to compute plus its running streams; a prompt costs a
worker the tokens that neither its own prefix cache (tracked here from the
prompts it served, an LRU as large as its KV pool) nor the kvstore (the
gateway's Lookup) already holds. A worker that fails a call is taken out of
routing at once and comes back when its health check answers SERVING.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import worker_pb2 as wpb
from protos import worker_pb2_grpc as wpb_grpc
from tandem.service import channel

log = logging.getLogger("tandem.gateway.workers")

DECODE_STREAM_COST = 32  # prompt tokens a running stream is worth when one worker does both phases
PROBE_TIMEOUT_S = 2.0


class PrefixAffinity:
    """Block keys a worker computed recently, LRU-bounded like its KV pool."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def match(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` the worker probably still holds."""
        n = 0
        for k in keys:
            if k not in self._keys:
                break
            n += 1
        return n

    def insert(self, keys: Sequence[bytes]) -> None:
        for k in keys:
            self._keys[k] = None
            self._keys.move_to_end(k)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)


@dataclass(eq=False)
class WorkerClient:
    address: str
    kind: str  # "prefill" or "decode" (decode workers prefill too in aggregated mode)
    channel: grpc.aio.Channel = field(init=False)
    stub: wpb_grpc.WorkerStub = field(init=False)
    health: health_pb2_grpc.HealthStub = field(init=False)
    info: wpb.WorkerInfoResponse | None = None
    healthy: bool = False
    inflight: int = 0  # this gateway's calls on it now
    pending_prompt_tokens: int = 0  # prompt tokens of those calls still to compute
    polled: wpb.WorkerStatsResponse | None = None
    affinity: PrefixAffinity = field(default_factory=lambda: PrefixAffinity(1))

    def __post_init__(self) -> None:
        self.channel = channel(self.address)
        self.stub = wpb_grpc.WorkerStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    @property
    def ready(self) -> bool:
        return self.healthy and self.info is not None

    def load(self, new_prompt_tokens: int, streams_cost: int) -> int:
        queued = max(self.pending_prompt_tokens, self.polled.queued_prompt_tokens if self.polled else 0)
        return queued + new_prompt_tokens + streams_cost * self.inflight

    async def probe(self) -> None:
        """Health, then Info once and Stats each time; any failure marks it down."""
        try:
            res = await self.health.Check(health_pb2.HealthCheckRequest(), timeout=PROBE_TIMEOUT_S)
            if res.status != health_pb2.HealthCheckResponse.SERVING:
                self._set_healthy(False, "not serving")
                return
            if self.info is None:
                self.info = await self.stub.Info(wpb.WorkerInfoRequest(), timeout=PROBE_TIMEOUT_S)
                self.affinity = PrefixAffinity(self.info.num_kv_blocks)
            self.polled = await self.stub.Stats(wpb.WorkerStatsRequest(), timeout=PROBE_TIMEOUT_S)
            self._set_healthy(True)
        except grpc.aio.AioRpcError as exc:
            self._set_healthy(False, exc.code().name)

    def mark_down(self, reason: str) -> None:
        self._set_healthy(False, reason)

    def _set_healthy(self, healthy: bool, reason: str = "") -> None:
        if healthy != self.healthy:
            if healthy:
                log.info("%s worker %s is up", self.kind, self.address)
            else:
                log.warning("%s worker %s is down: %s", self.kind, self.address, reason)
        self.healthy = healthy


class WorkerPool:
    def __init__(self, prefill: Sequence[str], decode: Sequence[str], probe_interval_s: float = 1.0) -> None:
        self.prefill = [WorkerClient(a, "prefill") for a in prefill]
        self.decode = [WorkerClient(a, "decode") for a in decode]
        self.probe_interval_s = probe_interval_s
        self._rr = itertools.count()
        self._task: asyncio.Task | None = None

    @property
    def all(self) -> list[WorkerClient]:
        return self.prefill + self.decode

    async def probe_all(self) -> None:
        await asyncio.gather(*(w.probe() for w in self.all))

    def start(self) -> None:
        self._task = asyncio.create_task(self._monitor())

    async def _monitor(self) -> None:
        while True:
            await self.probe_all()
            await asyncio.sleep(self.probe_interval_s)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for w in self.all:
            await w.channel.close()

    def any_info(self) -> wpb.WorkerInfoResponse | None:
        """The model facts, from a prefill worker when there are any (their keys are the ones stored)."""
        for w in self.prefill + self.decode:
            if w.info is not None:
                return w.info
        return None

    def pick(
        self,
        workers: list[WorkerClient],
        keys: Sequence[bytes],
        stored_blocks: int,
        prompt_len: int,
        streams_cost: int,
        exclude: Sequence[WorkerClient] = (),
    ) -> tuple[WorkerClient, int] | None:
        """The ready worker with the least load after this prompt; and the tokens it will compute."""
        ready = [w for w in workers if w.ready and w not in exclude]
        if not ready:
            return None
        start = next(self._rr) % len(ready)  # ties go round-robin
        best, best_cost, best_new = None, None, 0
        for w in ready[start:] + ready[:start]:
            bs = w.info.block_size
            new = 0 if prompt_len == 0 else max(0, prompt_len - max(w.affinity.match(keys), stored_blocks) * bs)
            cost = w.load(new, streams_cost)
            if best_cost is None or cost < best_cost:
                best, best_cost, best_new = w, cost, new
        return best, best_new
