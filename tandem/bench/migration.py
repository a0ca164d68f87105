"""``tandem bench migration``: the pause a client sees when its decode worker dies mid-stream.

For each way of restoring the generated tokens' KV on the next worker, recompute
(decode workers push nothing) and pull (``--push-generated-blocks``: they push
every full block of generated tokens as it fills), a ``tandem up`` cluster with
two decode workers streams one request at a time; after N tokens the worker
serving it is SIGKILLed, the gateway moves the request, and the pause is the gap
between the last token before the kill and the first one after. The killed worker
is restarted before the next request. Reported with the steady inter-token
latency of the same streams, for N = 128 and 1,024 by default.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import time
from pathlib import Path

from protos import common_pb2 as cpb
from protos import gateway_pb2 as gpb
from protos import worker_pb2 as wpb
from protos import worker_pb2_grpc as wpb_grpc
from tandem.client import stream_generate

VARIANTS = {"recompute": ["--no-push-generated-blocks"], "pull": ["--push-generated-blocks"]}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--generated", default="128,1024", help="tokens streamed before the kill (comma-separated)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--variants", default="recompute,pull")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="bench-results")


def _busy_worker(cluster) -> object:
    import grpc

    for w in cluster.decode:
        if not w.alive:
            continue
        with grpc.insecure_channel(w.address) as ch:
            if wpb_grpc.WorkerStub(ch).Stats(wpb.WorkerStatsRequest(), timeout=5).num_requests:
                return w
    raise RuntimeError("no decode worker is serving the request")


async def one_migration(cluster, prompt: list[int], n: int) -> dict[str, float]:
    """Stream ``n`` + 16 tokens, SIGKILL the decode worker after ``n``; the pause and the steady ITL."""
    req = gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=prompt), sampling=cpb.SamplingParams(
        max_tokens=n + 16, temperature=0, ignore_eos=True))
    stamps, killed_at = [], None
    async for msg in stream_generate(cluster.gateway.address, req, timeout=900):
        stamps += [time.perf_counter()] * len(msg.token_ids)
        if killed_at is None and len(stamps) >= n:
            victim = _busy_worker(cluster)
            victim.kill(signal.SIGKILL)
            killed_at = len(stamps)
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    pause = stamps[killed_at] - stamps[killed_at - 1]
    steady = [g for i, g in enumerate(gaps) if i != killed_at - 1]
    return {"pause_ms": pause * 1000, "itl_ms": statistics.median(steady) * 1000, "tokens": len(stamps)}


def measure(variant: str, flags: list[str], ns: list[int], args: argparse.Namespace) -> dict[int, list[dict]]:
    from common.engine_args import engine_flags
    from tandem.launcher import Cluster, ClusterConfig

    config = ClusterConfig(num_prefill=1, num_decode=2, gateway_port=0, engine_args=engine_flags(args),
                           extra_args={"decode": flags})
    rng = random.Random(args.seed)
    results: dict[int, list[dict]] = {n: [] for n in ns}
    with Cluster(config) as cluster:
        cluster.wait_healthy(60)
        for n in ns:
            for r in range(args.repeats):
                prompt = [rng.randrange(100, 40000) for _ in range(args.prompt_len)]
                res = asyncio.run(one_migration(cluster, prompt, n))
                results[n].append(res)
                print(f"  {variant}: {n} tokens, run {r + 1}: pause {res['pause_ms']:.0f} ms "
                      f"(ITL {res['itl_ms']:.0f} ms)", flush=True)
                cluster.restart(*[w for w in cluster.decode if not w.alive])
                time.sleep(2.5)  # the gateway's health checks see the restarted worker
    return results


def run(args: argparse.Namespace) -> int:
    ns = [int(x) for x in args.generated.split(",")]
    variants = [v.strip() for v in args.variants.split(",")]
    figures = {v: measure(v, VARIANTS[v], ns, args) for v in variants}
    print("| restore | tokens generated | pause median ms | pause runs ms | steady ITL median ms |")
    print("|---|---|---|---|---|")
    for v, by_n in figures.items():
        for n, runs in by_n.items():
            pauses = [r["pause_ms"] for r in runs]
            print(f"| {v} | {n} | {statistics.median(pauses):.0f} | {', '.join(f'{p:.0f}' for p in pauses)} | "
                  f"{statistics.median(r['itl_ms'] for r in runs):.0f} |")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"migration-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "func"}, "figures": figures},
                               indent=1, default=str))
    print(f"wrote {path}")
    return 0
