"""Helpers for end-to-end tests of the pipeline: a ``tandem up`` cluster of real processes,
calls through the public API, and each service's ``Stats`` for leak checks."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from protos import common_pb2 as cpb
from protos import gateway_pb2 as gpb
from protos import gateway_pb2_grpc as gpb_grpc
from protos import kvstore_pb2 as kpb
from protos import kvstore_pb2_grpc as kpb_grpc
from protos import tokenizer_pb2 as tpb
from protos import tokenizer_pb2_grpc as tpb_grpc
from protos import worker_pb2 as wpb
from protos import worker_pb2_grpc as wpb_grpc
from tandem.launcher import Cluster, ClusterConfig

# Small enough that four workers and a store fit next to the tests on a 2-core, 24 GB machine.
WORKER_ARGS = ["--num-threads", "1", "--kv-cache-gb", "0.25"]


def start_cluster(model: Path, tmp: Path, mode: str = "disaggregated", num_prefill: int = 1, num_decode: int = 1,
                  gateway_args: list[str] | None = None, worker_args: dict[str, list[str]] | None = None) -> Cluster:
    """``worker_args``: flags of the prefill or decode workers only (e.g. their tensor-parallel degree)."""
    config = ClusterConfig(
        mode=mode,
        num_prefill=num_prefill,
        num_decode=num_decode,
        gateway_port=0,
        engine_args=["--model", str(model), *WORKER_ARGS],
        kv_capacity_gb=0.5,
        extra_args={"gateway": gateway_args or [], **(worker_args or {})},
        log_dir=tmp,
        startup_timeout=240,
    )
    cluster = Cluster(config).start()
    cluster.wait_healthy(60)
    return cluster


def token_request(ids: list[int], max_tokens: int, **kwargs) -> gpb.GenerateRequest:
    sampling = kwargs.pop("sampling", None) or cpb.SamplingParams(max_tokens=max_tokens, temperature=0)
    return gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=ids), sampling=sampling, **kwargs)


def chat_request(text: str, max_tokens: int, **kwargs) -> gpb.GenerateRequest:
    chat = tpb.ChatMessages(messages=[tpb.ChatMessage(role="user", content=text)])
    return gpb.GenerateRequest(chat=chat, sampling=cpb.SamplingParams(max_tokens=max_tokens, temperature=0), **kwargs)


@dataclass
class Reply:
    messages: list[gpb.GenerateResponse] = field(default_factory=list)
    code: grpc.StatusCode = grpc.StatusCode.OK
    details: str = ""
    elapsed_s: float = 0.0

    @property
    def tokens(self) -> list[int]:
        return [t for m in self.messages for t in m.token_ids]

    @property
    def text(self) -> str:
        return "".join(m.text for m in self.messages)

    @property
    def last(self) -> gpb.GenerateResponse:
        return self.messages[-1]


async def call(address: str, request: gpb.GenerateRequest, timeout: float = 120.0,
               on_message: Callable[[gpb.GenerateResponse, Reply], bool] | None = None) -> Reply:
    """One Generate call; ``on_message`` returning True cancels the call there (the client goes away)."""
    reply, start = Reply(), time.monotonic()
    async with grpc.aio.insecure_channel(address) as ch:
        rpc = gpb_grpc.GatewayStub(ch).Generate(request, timeout=timeout)
        try:
            async for msg in rpc:
                reply.messages.append(msg)
                if on_message is not None and on_message(msg, reply):
                    rpc.cancel()
                    reply.code = grpc.StatusCode.CANCELLED
                    break
        except grpc.aio.AioRpcError as exc:
            reply.code, reply.details = exc.code(), exc.details()
    reply.elapsed_s = time.monotonic() - start
    return reply


def generate(address: str, request: gpb.GenerateRequest, timeout: float = 120.0) -> Reply:
    return asyncio.run(call(address, request, timeout))


def worker_stats(address: str) -> wpb.WorkerStatsResponse:
    with grpc.insecure_channel(address) as ch:
        return wpb_grpc.WorkerStub(ch).Stats(wpb.WorkerStatsRequest(), timeout=10)


def gateway_stats(address: str) -> gpb.GatewayStatsResponse:
    with grpc.insecure_channel(address) as ch:
        return gpb_grpc.GatewayStub(ch).Stats(gpb.GatewayStatsRequest(), timeout=10)


def kvstore_stats(address: str) -> kpb.StatsResponse:
    with grpc.insecure_channel(address) as ch:
        return kpb_grpc.KVStoreStub(ch).Stats(kpb.StatsRequest(), timeout=10)


def tokenizer_stats(address: str) -> tpb.TokenizerStatsResponse:
    with grpc.insecure_channel(address) as ch:
        return tpb_grpc.TokenizerStub(ch).Stats(tpb.TokenizerStatsRequest(), timeout=10)


def leftovers(cluster: Cluster) -> list[str]:
    """Everything a finished or cancelled request could have left behind, in any service."""
    found = []
    g = gateway_stats(cluster.gateway.address)
    if g.inflight or g.pending_partial_drops:
        found.append(f"gateway: {g.inflight} in flight, {g.pending_partial_drops} partial drops pending")
    t = tokenizer_stats(cluster.tokenizer.address)
    if t.active_detokenize_streams:
        found.append(f"tokenizer: {t.active_detokenize_streams} detokenize streams open")
    for w in cluster.prefill + cluster.decode:
        if not w.alive:
            continue
        s = worker_stats(w.address)
        for name in ("num_requests", "active_rpcs", "used_kv_blocks", "pending_kv_pushes", "pending_kv_pulls",
                     "kv_staging_blocks_in_use"):
            if getattr(s, name):
                found.append(f"{w.name}: {name}={getattr(s, name)}")
    if cluster.kvstore is not None:
        k = kvstore_stats(cluster.kvstore.address)
        for name in ("active_leases", "active_reservations", "reserved_blocks", "leased_blocks", "partial_blocks"):
            if getattr(k, name):
                found.append(f"kvstore: {name}={getattr(k, name)}")
    return found


def wait_clean(cluster: Cluster, timeout: float = 20.0) -> list[str]:
    """Poll until nothing is left behind; what is still there at the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        found = leftovers(cluster)
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(grpc.RpcError):
            if predicate():
                return True
        time.sleep(interval)
    return False
