"""Running and waiting requests over a run: the workers' ``Stats`` polled every ~0.5 s, and the
client's own count of requests in flight. Queues that grow while the client keeps its rate are
where latency comes from; the timeline shows when and on which worker they grew.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from common.service import channel
from protos import gateway_pb2 as gpb
from protos import gateway_pb2_grpc as gpb_grpc
from protos import worker_pb2 as wpb
from protos import worker_pb2_grpc as wpb_grpc


@dataclass(slots=True)
class TimelineSample:
    t: float  # seconds since the run's start
    client_inflight: int
    # worker name ("prefill 127.0.0.1:4001") -> (num_running, num_waiting); absent when it did not answer
    workers: dict[str, tuple[int, int]] = field(default_factory=dict)


class StatsPoller:
    """Samples the client's in-flight count and, given a gateway address, every worker's queues."""

    def __init__(self, inflight: Callable[[], int], gateway: str | None = None, interval: float = 0.5,
                 metadata: Sequence[tuple[str, str]] | None = None) -> None:
        self.inflight = inflight
        self.metadata = metadata  # the gateway's API key, when it asks for one
        self.gateway = gateway
        self.interval = interval
        self.samples: list[TimelineSample] = []
        self._workers: dict[str, wpb_grpc.WorkerStub] = {}
        self._channels: list[grpc.aio.Channel] = []

    async def discover(self) -> list[str]:
        """Learn the workers from the gateway's ``Stats`` (none without a gateway or when it fails)."""
        if self.gateway is None:
            return []
        gw = channel(self.gateway)
        self._channels.append(gw)
        try:
            stats = await gpb_grpc.GatewayStub(gw).Stats(gpb.GatewayStatsRequest(), timeout=5,
                                                                  metadata=self.metadata)
        except grpc.aio.AioRpcError:
            return []
        for w in stats.workers:
            ch = channel(w.address)
            self._channels.append(ch)
            self._workers[f"{w.role} {w.address}"] = wpb_grpc.WorkerStub(ch)
        return list(self._workers)

    async def run(self, t0: float, stop: asyncio.Event) -> None:
        """Sample until ``stop`` is set; one last sample after it."""
        while True:
            self.samples.append(await self.sample(t0))
            try:
                await asyncio.wait_for(stop.wait(), self.interval)
                self.samples.append(await self.sample(t0))
                return
            except asyncio.TimeoutError:
                continue

    async def sample(self, t0: float) -> TimelineSample:
        sample = TimelineSample(time.perf_counter() - t0, self.inflight())
        names = list(self._workers)
        replies = await asyncio.gather(*(self._workers[n].Stats(wpb.WorkerStatsRequest(), timeout=self.interval)
                                         for n in names), return_exceptions=True)
        for name, reply in zip(names, replies, strict=True):
            if isinstance(reply, wpb.WorkerStatsResponse):
                sample.workers[name] = (reply.num_running, reply.num_waiting)
        return sample

    async def close(self) -> None:
        for ch in self._channels:
            await ch.close()
