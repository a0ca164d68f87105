"""`tandem bench tp`: what tensor parallelism costs in communication, per decode step, and what each
rank moves of a KV block.

On one CPU host this is a correctness-scale figure: the ranks share the same cores and memory, so
TP=2 is not expected to be faster than TP=1 here; what it shows is the all-reduce and broadcast time
per step (rank 0's view: time inside collectives, waiting for the slower rank included) and its share
of the step, and that a rank reads only its heads' byte range of each block: in the engine's import, and
over the network in a real pull from a kvstore node, where every rank reads its own heads over its own
UCX endpoint (``kvstore.rank_agent``) and the bytes each one moved are counted.

Without ``--model`` it runs dummy weights of SmolLM2-135M's geometry with 8 heads and 4 KV heads (the
real model's 9 heads and 3 KV heads split 3 ways, not 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

PROMPT_LEN = 128
DUMMY_CONFIG = {"model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
                "num_hidden_layers": 30, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 72,
                "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 2048,
                "tie_word_embeddings": True}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--degrees", default="1,2", help="tensor-parallel degrees to compare (the first is the base)")
    p.add_argument("--batches", default="1,16", help="decode batch sizes")
    p.add_argument("--steps", type=int, default=20, help="decode steps timed per batch size")
    p.add_argument("--kv-blocks", type=int, default=256, help="blocks of the KV import timed")
    p.add_argument("--output-dir", default="bench-results")


def run(args: argparse.Namespace) -> int:
    from common.engine_args import engine_config

    tmp = None
    if args.model is None:
        tmp = Path(tempfile.mkdtemp(prefix="tandem-bench-tp-"))
        (tmp / "config.json").write_text(json.dumps(DUMMY_CONFIG))
        args.model, args.load_format = str(tmp), "dummy"
    try:
        results = {}
        for tp in [int(x) for x in args.degrees.split(",")]:
            args.tensor_parallel_size = tp
            config = engine_config(args)
            config.num_threads = config.num_threads or max(1, (os.cpu_count() or 1) // tp)
            config.num_kv_blocks = max(args.kv_blocks * 2, 64 * 16)
            config.kv_staging_mb = max(config.kv_staging_mb, _blocks_mb(config, args.kv_blocks) + 1)
            results[tp] = measure(config, [int(b) for b in args.batches.split(",")], args.steps, args.kv_blocks)
            print(f"TP={tp}: {json.dumps(results[tp])}", file=sys.stderr)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    print(format_table(results))
    write_json(args, results)
    return 0


def _blocks_mb(config, n: int) -> int:
    from engine.kv_blocks import wire_block_bytes

    itemsize = torch.empty((), dtype=config.torch_dtype).element_size()
    return -(-n * wire_block_bytes(config.model_config, config.block_size, itemsize) // 2**20)


def measure(config, batches: list[int], steps: int, kv_blocks: int) -> dict:
    from engine import Engine
    from engine.kv_transfer import LocalKVTransfer

    engine = Engine(config, LocalKVTransfer())  # a connector: the engine keeps a staging pool, as workers do
    try:
        out = {"steps": {b: decode_steps(engine, b, steps) for b in batches}}
        if hasattr(engine.runner, "ping"):  # the bare collective, at the step's all-reduce sizes
            hidden = engine.model_config.hidden_size
            out["allreduce_us"] = {b: 1e6 * engine.runner.ping(200, b * hidden) for b in batches}
        out["kv"] = kv_import(engine, kv_blocks)
    finally:
        engine.close()
    out["store"] = store_pull(config, kv_blocks)
    return out


def store_pull(config, n: int) -> dict:
    """A decode worker's load of ``n`` blocks from a real kvstore node (pull + import, the request's
    ``kv_load`` time), and the bytes each rank moved over the network against the whole blocks."""
    import asyncio

    from engine import Engine, RequestOptions, SamplingParams
    from engine.kv_blocks import wire_block_bytes
    from kvstore.connector import KVStoreConnector
    from tandem.bench.kv import _spawn

    mc, bs = config.model_config, config.block_size
    n = min(n, (config.max_model_len - 1) // bs)  # one request's prompt: within the model's length
    block = wire_block_bytes(mc, bs, torch.empty((), dtype=config.torch_dtype).element_size())
    store, line = _spawn(["-m", "kvstore.server", "--block-bytes", str(block), "--capacity-gb",
                          repr(2.5 * n * block / 2**30)], "KVSTORE READY")
    address = line.split("grpc=")[1].split()[0]
    rng = random.Random(n)
    cfg = dataclasses.replace(config, role="consumer")
    engine = None
    try:
        keys = [asyncio.run(_fill(address, n, block, mc.num_kv_heads, seed)) for seed in (1, 2)]
        engine = Engine(cfg, KVStoreConnector(address, cfg))
        ranks = engine.connector.ranks
        loads = []
        for k in keys:  # the first warms the path; the second is timed
            before = {r: dict(v) for r, v in ranks.bytes_by_rank.items()} if ranks else {}
            prompt = [rng.randrange(mc.vocab_size) for _ in range(n * bs + 1)]
            options = RequestOptions(output_token_ids=[], num_external_tokens=n * bs, block_hashes=k)
            rid = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0), options=options)
            times = None
            while engine.has_unfinished():
                times = next((o.times for o in engine.step() if o.request_id == rid and o.times), times)
            loads.append((times.kv_load if times else float("nan"), before))
        seconds, before = loads[-1]
        moved = {r: v["read"] - before[r]["read"] for r, v in ranks.bytes_by_rank.items()} if ranks else {0: n * block}
        return {"blocks": n, "load_ms": 1e3 * seconds, "whole_bytes": n * block,
                "failures": engine.stats.kv_load_failures, "bytes_by_rank": moved,
                "rank_share": {r: b / (n * block) for r, b in moved.items()}}
    finally:
        if engine is not None:
            engine.close()
            engine.connector.close()
        store.terminate()
        store.wait(10)


async def _fill(address: str, n: int, block: int, heads: int, seed: int) -> list[bytes]:
    """``n`` random blocks under random keys, as a prefill worker's push leaves them."""
    import numpy as np

    from kvstore.client import KVStoreClient

    client = KVStoreClient(address)  # its channel belongs to this loop
    rng = np.random.default_rng(seed)
    blocks = [(rng.bytes(32), rng.integers(0, 256, block, dtype=np.uint8)) for _ in range(n)]
    try:
        await client.push(blocks, heads=heads)
    finally:
        await client.close()
    return [k for k, _ in blocks]


def decode_steps(engine, batch: int, steps: int) -> dict:
    """Mean decode-step time at ``batch`` and rank 0's time inside collectives during those steps."""
    from engine import SamplingParams

    rng = random.Random(batch)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True)
    ids = [engine.add_request([rng.randrange(vocab) for _ in range(PROMPT_LEN)], params) for _ in range(batch)]
    started: set[str] = set()
    while len(started) < batch:  # prefill, until every request has its first token
        started.update(o.request_id for o in engine.step())
    group = getattr(engine.runner, "group", None)
    comm0 = (group.comm_seconds, group.comm_calls, group.comm_bytes) if group else (0.0, 0, 0)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    seconds = time.perf_counter() - start
    comm = (group.comm_seconds - comm0[0], group.comm_calls - comm0[1], group.comm_bytes - comm0[2]) if group \
        else (0.0, 0, 0)
    for rid in ids:
        engine.abort(rid)
    step_ms = 1e3 * seconds / steps
    comm_ms = 1e3 * comm[0] / steps
    return {"step_ms": step_ms, "comm_ms": comm_ms, "comm_share": comm_ms / step_ms,
            "collectives_per_step": comm[1] / steps, "comm_bytes_per_step": comm[2] / steps}


def kv_import(engine, n: int) -> dict:
    """An import of ``n`` whole blocks (what a decode worker's connector pulled): time, and the bytes each
    rank reads of a block against the whole block."""
    from engine.kv_blocks import wire_block_bytes, wire_block_shape

    mc, bs = engine.model_config, engine.config.block_size
    staged = engine.staging.take(n)  # where a connector's pull lands: the ranks read it in place
    data = staged.tensor if staged is not None else torch.empty((n, *wire_block_shape(mc, bs)),
                                                                dtype=engine.config.torch_dtype)
    data.copy_(torch.randn(data.shape))
    ids = list(range(n))
    engine.runner.import_blocks(ids, data)  # warm
    start = time.perf_counter()
    engine.runner.import_blocks(ids, data)
    seconds = time.perf_counter() - start
    if staged is not None:
        staged.release()
    itemsize = data.element_size()
    shard = engine.runner.shard
    whole = wire_block_bytes(mc, bs, itemsize)
    return {"blocks": n, "import_ms": 1e3 * seconds, "block_bytes": whole,
            "rank_bytes_per_block": whole * shard.num_kv_heads // mc.num_kv_heads,
            "rank_share_of_block": shard.num_kv_heads / mc.num_kv_heads}


def format_table(results: dict) -> str:
    degrees = list(results)
    base = results[degrees[0]]
    lines = [f"| TP | batch | step ms | vs TP={degrees[0]} | comm ms/step | comm share | collectives/step | "
             "bytes/step |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for tp in degrees:
        for b, r in results[tp]["steps"].items():
            lines.append(f"| {tp} | {b} | {r['step_ms']:.1f} | {r['step_ms'] / base['steps'][b]['step_ms']:.2f}x | "
                         f"{r['comm_ms']:.2f} | {r['comm_share']:.0%} | {r['collectives_per_step']:.0f} | "
                         f"{r['comm_bytes_per_step'] / 1024:.0f} KiB |")
    bare = [(tp, b, us) for tp in degrees for b, us in results[tp].get("allreduce_us", {}).items()]
    if bare:
        lines += ["", "| TP | all-reduce of | alone (no compute around it) |", "|---:|---:|---:|"]
        lines += [f"| {tp} | {b} rows | {us:.0f} us |" for tp, b, us in bare]
    lines += ["", "| TP | KV import of blocks | ms | block bytes | each rank reads | share |",
              "|---:|---:|---:|---:|---:|---:|"]
    for tp in degrees:
        k = results[tp]["kv"]
        lines.append(f"| {tp} | {k['blocks']} | {k['import_ms']:.1f} | {k['block_bytes']} | "
                     f"{k['rank_bytes_per_block']} | {k['rank_share_of_block']:.0%} |")
    lines += ["", "| TP | load from a kvstore node | ms (pull + import) | failed | each rank moved |",
              "|---:|---:|---:|---:|---|"]
    for tp in degrees:
        st = results[tp]["store"]
        each = ", ".join(f"rank {r}: {b / 2**20:.1f} MiB ({st['rank_share'][r]:.0%})"
                         for r, b in st["bytes_by_rank"].items())
        lines.append(f"| {tp} | {st['blocks']} blocks, {st['whole_bytes'] / 2**20:.1f} MiB | {st['load_ms']:.1f} | "
                     f"{st['failures']} | {each} |")
    return "\n".join(lines)


def write_json(args: argparse.Namespace, results: dict) -> None:
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"tp-{time.strftime('%Y%m%d-%H%M%S')}.json"
    settings = {k: v for k, v in vars(args).items() if k != "func"}
    doc = {"bench": "tp", "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
           "torch": torch.__version__, "settings": settings, "results": results}
    path.write_text(json.dumps(doc, indent=2, default=str))
    print(f"wrote {path}", file=sys.stderr)
