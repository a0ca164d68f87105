"""``tandem bench kv``: kvstore push / pull throughput against a memory copy and gRPC ``bytes``, in one run.

Cross-process on loopback: a kvstore node and a plain gRPC bytes server run as
their own processes; this process is the worker. Block size: one block of the
default model (SmolLM2-135M, float32, 16 tokens). Also the median time of a
1,000-key ``Lookup`` on a Redis index (a real ``redis-server`` on a free port).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np

from kvstore.server import DEFAULT_BLOCK_BYTES

COUNTS = (1, 16, 256)
_ECHO = "/tandem.bench.Bytes/Put"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--block-bytes", type=int, default=DEFAULT_BLOCK_BYTES)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--output-dir", default="bench-results")
    p.add_argument("--no-redis", action="store_true", help="skip the Redis Lookup figure")


def _spawn(args: list[str], ready: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in proc.stdout:
        if line.startswith(ready):
            return proc, line
    raise RuntimeError(f"{args} did not start")


def _memcpy_gbps(total: int, repeats: int) -> float:
    src = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(repeats))
    return total / best / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


async def _atimed(coro) -> float:
    t = time.perf_counter()
    await coro
    return time.perf_counter() - t


async def _kv_figures(address: str, block_bytes: int, repeats: int) -> dict:
    from kvstore.client import KVStoreClient

    client = KVStoreClient(address)
    rng = np.random.default_rng(1)
    out = {}
    try:
        for n in COUNTS:
            push, pull = [], []
            # Like the memory copy's destination: one buffer, faulted in once and reused (a fresh one
            # per pull would time the kernel's page faults, not the transfer).
            dst = np.zeros((n, block_bytes), dtype=np.uint8)
            for r in range(repeats + 1):  # the first round warms the connection up and is not counted
                # Rows of one buffer, as the connector hands them over (an engine's export is one tensor).
                rows = rng.integers(0, 256, (n, block_bytes), dtype=np.uint8)
                blocks = [(rng.bytes(32), row) for row in rows]
                t_push = await _atimed(client.push(blocks))
                t0 = time.perf_counter()
                got = await client.pull([k for k, _ in blocks], out=list(dst))
                t_pull = time.perf_counter() - t0
                assert len(got.blocks) == n
                if r:
                    push.append(t_push)
                    pull.append(t_pull)
            total = n * block_bytes
            out[n] = {"push_gbps": total / statistics.median(push) / 1e9,
                      "pull_gbps": total / statistics.median(pull) / 1e9}
    finally:
        await client.close()
    return out


async def _grpc_figures(address: str, block_bytes: int, repeats: int) -> dict:
    out = {}
    async with grpc.aio.insecure_channel(
        address, options=[("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    ) as channel:
        call = channel.unary_unary(_ECHO)
        for n in COUNTS:
            payload = os.urandom(n * block_bytes)
            await call(b"x")
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                back = await call(payload)  # the server answers with the same bytes: one way each
                times.append((time.perf_counter() - t) / 2)
                assert len(back) == len(payload)
            out[n] = {"gbps": n * block_bytes / statistics.median(times) / 1e9}
    return out


def _redis_lookup_ms(samples: int = 200) -> float:
    from engine.block_hash import prompt_block_hashes
    from kvstore.index import IndexEntry
    from kvstore.redis_index import RedisIndex
    from tandem.redis_server import RedisServer  # the same throwaway server the tests use

    with RedisServer() as server:
        index = RedisIndex(server.url)
        keys = prompt_block_hashes(bytes(32), list(range(16_000)), 16)
        index.register_node("bench", "127.0.0.1:1", 60)
        index.commit([IndexEntry(k, "bench", i, 1, 0) for i, k in enumerate(keys)])
        index.lookup(keys)
        times = [_timed(lambda: index.lookup(keys)) for _ in range(samples)]
        index.close()
    return statistics.median(times) * 1e3


def run(args: argparse.Namespace) -> int:
    kv, line = _spawn(["-m", "kvstore.server", "--block-bytes", str(args.block_bytes), "--capacity-gb",
                       repr(max(1.0, 2.2 * 256 * args.block_bytes / 2**30))], "KVSTORE READY")
    kv_addr = line.split("grpc=")[1].split()[0]
    echo, line = _spawn(["-m", "tandem.bench.bytes_server"], "BYTES READY")
    echo_addr = line.split()[2]
    try:
        kv_fig = asyncio.run(_kv_figures(kv_addr, args.block_bytes, args.repeats))
        grpc_fig = asyncio.run(_grpc_figures(echo_addr, args.block_bytes, args.repeats))
    finally:
        for p in (kv, echo):
            p.terminate()
            p.wait(10)
    memcpy = {n: _memcpy_gbps(n * args.block_bytes, args.repeats) for n in COUNTS}
    lookup_ms = None if args.no_redis else _redis_lookup_ms()
    rows = [{"blocks": n, **kv_fig[n], "memcpy_gbps": memcpy[n], "grpc_bytes_gbps": grpc_fig[n]["gbps"],
             "pull_over_memcpy": kv_fig[n]["pull_gbps"] / memcpy[n],
             "pull_over_grpc": kv_fig[n]["pull_gbps"] / grpc_fig[n]["gbps"]} for n in COUNTS]
    print(_table(rows, args.block_bytes, lookup_ms))
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"kv-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"bench": "kv", "machine": platform.machine(), "block_bytes": args.block_bytes,
                                "results": rows, "redis_lookup_1000_median_ms": lookup_ms}, indent=2))
    print(f"wrote {path}", file=sys.stderr)
    return 0


def _table(rows: list[dict], block_bytes: int, lookup_ms: float | None) -> str:
    lines = [
        f"block: {block_bytes} bytes; GB/s, median of repeats; cross-process on loopback",
        "| blocks | push | pull | memcpy | gRPC bytes | pull/memcpy | pull/gRPC |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['blocks']} | {r['push_gbps']:.2f} | {r['pull_gbps']:.2f} | {r['memcpy_gbps']:.2f} | "
                     f"{r['grpc_bytes_gbps']:.2f} | {r['pull_over_memcpy'] * 100:.0f}% | {r['pull_over_grpc']:.2f}x |")
    if lookup_ms is not None:
        lines.append(f"Redis index Lookup of 1,000 keys: {lookup_ms:.2f} ms median (target <= 2 ms)")
    return "\n".join(lines)
