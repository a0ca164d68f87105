"""Scheduling scenarios of ``tandem bench offline``: prefix-cache TTFT, chunked-prefill ITL, scheduler overhead.

Each scenario compares two settings of the same engine in one run and reports
the ratio; none is a pass/fail test. Times are wall-clock on this machine.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable

from engine import Engine, EngineConfig, SamplingParams


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab - 100) for _ in range(n)]


def _ttft(engine: Engine, prompt: list[int]) -> float:
    t = time.perf_counter()
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - t


def prefix_cache_ttft(make: Callable[..., Engine], vocab: int, seed: int, trials: int = 3) -> dict:
    """TTFT of a 1,024-token prompt whose first 960 tokens are cached, against the same prompt cold."""
    rng = random.Random(seed)
    prompt = _tokens(rng, 1024, vocab)
    engine = make()
    _ttft(engine, _tokens(rng, 64, vocab))  # warm-up
    cold, warm, computed = [], [], []
    for _ in range(trials):
        engine.reset_prefix_cache()
        cold.append(_ttft(engine, prompt))
        engine.reset_prefix_cache()
        _ttft(engine, prompt[:960] + _tokens(rng, 1, vocab))  # caches the 60 full blocks of the prefix
        before = engine.stats.prompt_tokens_computed
        warm.append(_ttft(engine, prompt))
        computed.append(engine.stats.prompt_tokens_computed - before)
    cold_ms, warm_ms = statistics.median(cold) * 1e3, statistics.median(warm) * 1e3
    return {
        "prompt_tokens": 1024,
        "cached_tokens": 960,
        "cached_prompt_tokens_computed": computed[-1],
        "cold_ttft_ms": cold_ms,
        "cached_ttft_ms": warm_ms,
        "cached_over_cold": warm_ms / cold_ms,
        "target_cached_over_cold": 0.25,
    }


def _itl_run(engine: Engine, vocab: int, seed: int, decode_tokens: int) -> dict:
    """16 decodes running, then 4 prompts of 1,024 tokens arrive; ITLs of the 16 until each made
    ``decode_tokens`` more tokens."""
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=decode_tokens + 8, temperature=0, ignore_eos=True)
    decodes = [engine.add_request(_tokens(rng, 64, vocab), params) for _ in range(16)]
    last: dict[str, float] = {}
    while len(last) < 16:  # every decode has its first token: they are all running
        for out in engine.step():
            last[out.request_id] = time.perf_counter()
    arrival = time.perf_counter()
    longs = {engine.add_request(_tokens(rng, 1024, vocab), SamplingParams(max_tokens=4, temperature=0,
                                                                        ignore_eos=True)): None for _ in range(4)}
    gaps: list[float] = []
    counts = dict.fromkeys(decodes, 0)
    while engine.has_unfinished():
        for out in engine.step():
            now = time.perf_counter()
            rid = out.request_id
            if rid in longs and longs[rid] is None:
                longs[rid] = now - arrival
            if rid in counts and counts[rid] < decode_tokens:
                gaps.append(now - last[rid])
                last[rid] = now
                counts[rid] += 1
    gaps.sort()
    return {
        "itl_p50_ms": gaps[len(gaps) // 2] * 1e3,
        "itl_p99_ms": gaps[min(len(gaps) - 1, int(len(gaps) * 0.99))] * 1e3,
        "itl_max_ms": gaps[-1] * 1e3,
        "long_prompt_ttft_mean_ms": statistics.mean(longs.values()) * 1e3,
        "itl_samples": len(gaps),
    }


def chunked_prefill_itl(
    make: Callable[..., Engine], vocab: int, seed: int, chunk_budget: int, decode_tokens: int = 48
) -> dict:
    """Inter-token latency p99 of 16 running decodes while 4 long prompts arrive: chunked against unchunked."""
    chunked = _itl_run(make(max_num_batched_tokens=chunk_budget, max_model_len=2048), vocab, seed, decode_tokens)
    whole = _itl_run(
        make(enable_chunked_prefill=False, max_num_batched_tokens=2048, max_model_len=2048), vocab, seed, decode_tokens
    )
    return {
        "chunk_budget_tokens": chunk_budget,
        "chunked": chunked,
        "unchunked": whole,
        "p99_unchunked_over_chunked": whole["itl_p99_ms"] / chunked["itl_p99_ms"],
        "target_ratio": 2.0,
    }


def scheduler_overhead(make: Callable[..., Engine], vocab: int, seed: int, steps: int = 48) -> dict:
    """The engine's own time per step (scheduler, block manager, prefix-cache bookkeeping, outputs),
    the model call and sampling excluded, with 256 requests decoding."""
    rng = random.Random(seed)
    engine = make(max_num_seqs=256, max_num_batched_tokens=4096)
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    for _ in range(256):
        engine.add_request(_tokens(rng, 16, vocab), params)
    while engine.scheduler.waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()
    samples = []
    for _ in range(steps):
        assert len(engine.scheduler.running) == 256
        engine.step()
        samples.append(engine.stats.last_step_overhead_s)
    while engine.has_unfinished():
        engine.step()
    samples.sort()
    return {
        "running_requests": 256,
        "steps": steps,
        "overhead_mean_ms": statistics.mean(samples) * 1e3,
        "overhead_p50_ms": samples[len(samples) // 2] * 1e3,
        "overhead_max_ms": samples[-1] * 1e3,
        "target_ms": 1.0,
    }


SCENARIOS = ("prefix-cache", "chunked-prefill", "scheduler")


def run_scenarios(args: argparse.Namespace, base: EngineConfig, names: list[str]) -> dict:
    """Run the named scenarios on engines like ``base`` (float32), each built fresh."""
    from dataclasses import asdict

    settings = {k: v for k, v in asdict(base).items() if k != "model_config"}
    settings["dtype"] = "float32"

    def make(**overrides) -> Engine:
        return Engine(EngineConfig(**{**settings, **overrides}))

    vocab = base.model_config.vocab_size
    results = {}
    for name in names:
        t = time.perf_counter()
        if name == "prefix-cache":
            results[name] = prefix_cache_ttft(make, vocab, args.seed)
        elif name == "chunked-prefill":
            results[name] = chunked_prefill_itl(make, vocab, args.seed, args.chunk_budget)
        elif name == "scheduler":
            results[name] = scheduler_overhead(make, vocab, args.seed)
        print(f"  {name}: {results[name]} ({time.perf_counter() - t:.0f}s)", file=sys.stderr)
    return results


def format_scenarios(results: dict) -> str:
    lines = []
    if "prefix-cache" in results:
        r = results["prefix-cache"]
        lines += [
            "| prefix cache (1,024-token prompt, 960 cached) | cold TTFT ms | cached TTFT ms | cached/cold | target |",
            "|---|---|---|---|---|",
            f"| float32 | {r['cold_ttft_ms']:.1f} | {r['cached_ttft_ms']:.1f} | "
            f"{r['cached_over_cold'] * 100:.1f}% | <= 25% |",
            "",
        ]
    if "chunked-prefill" in results:
        r = results["chunked-prefill"]
        c, u = r["chunked"], r["unchunked"]
        lines += [
            "| chunked prefill (16 decodes, 4 x 1,024-token arrivals) | ITL p50 ms | ITL p99 ms | ITL max ms | "
            "long-prompt TTFT ms |",
            "|---|---|---|---|---|",
            f"| chunked (budget {r['chunk_budget_tokens']}) | {c['itl_p50_ms']:.1f} | {c['itl_p99_ms']:.1f} | "
            f"{c['itl_max_ms']:.1f} | {c['long_prompt_ttft_mean_ms']:.0f} |",
            f"| unchunked | {u['itl_p50_ms']:.1f} | {u['itl_p99_ms']:.1f} | {u['itl_max_ms']:.1f} | "
            f"{u['long_prompt_ttft_mean_ms']:.0f} |",
            f"p99 unchunked / chunked: {r['p99_unchunked_over_chunked']:.2f}x (target >= 2x)",
            "",
        ]
    if "scheduler" in results:
        r = results["scheduler"]
        lines += [
            "| scheduler overhead, 256 running | mean ms/step | p50 | max | target |",
            "|---|---|---|---|---|",
            f"| float32 | {r['overhead_mean_ms']:.3f} | {r['overhead_p50_ms']:.3f} | {r['overhead_max_ms']:.3f} "
            "| <= 1 ms |",
        ]
    return "\n".join(lines)
