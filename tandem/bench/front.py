"""``tandem bench front``: the gateway's OpenAI-compatible HTTP front against its gRPC ``Generate``.

One ``tandem up`` cluster (pinned as ``bench compare`` pins it) serves both APIs from the same
gateway process; this client loads them in turn, in the same run, alternating round by round (gRPC then
HTTP, then HTTP then gRPC, ...), so that the machine's drift hits both alike. Both APIs get the same requests
(same seeds): random word-token prompts sent as token ids (``/v1/completions`` takes ids too, so no
tokenization differs), a fixed output length (``ignore_eos``), greedy. Each run has a cache salt of
its own, so that neither API reads the other's prompts from the prefix cache.

- Low load: one stream, ``--rounds`` rounds of ``--num-prompts`` requests per API. Reported: the
  median TTFT per API and the HTTP overhead (the difference of the medians, and the median of the
  differences of the requests paired by index), the median inter-token latency per API and their
  ratio.
- High load: ``--concurrency`` streams, ``--high-load-rounds`` rounds of ``--high-load-prompts``
  requests per API. Reported: the output throughput per API and their ratio.

The targets (HTTP against gRPC): TTFT overhead <= 5 ms median, ITL <= +5 %, throughput at 32 streams
>= 95 %. The HTTP client counts a streamed chunk's tokens from ``continuous_usage_stats`` (a chunk
may carry several tokens, as a gRPC message may), unless ``--http-tokens chunks``.
Written: a markdown table (``front-*.md``) and a JSON file with every round's figures and requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import random
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

from tandem.bench.backends import Backend, GatewayBackend, OpenAIBackend
from tandem.bench.compare import affinity_plan, usable_cpus
from tandem.bench.datasets import BenchRequest, random_dataset, word_ids
from tandem.bench.metrics import compute_metrics
from tandem.bench.progress import Progress
from tandem.bench.results import Load, RunResult
from tandem.bench.serve import output_stem, run_load, tokenizer_file, warm_up

APIS = ("grpc", "http")
NAMES = {"grpc": "gRPC", "http": "HTTP"}
TTFT_OVERHEAD_MS = 5.0  # HTTP median TTFT - gRPC median TTFT, at one stream
ITL_OVERHEAD = 0.05  # HTTP median ITL / gRPC median ITL - 1, at one stream
THROUGHPUT_RATIO = 0.95  # HTTP output throughput / gRPC's, at --concurrency streams


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", default="disaggregated", choices=["aggregated", "disaggregated"],
                   help="the cluster's topology")
    p.add_argument("--no-pin", dest="pin", action="store_false", help="let the workers run on any core")
    p.add_argument("--kv-capacity-gb", type=float, default=1.0, help="the kvstore's block pool (disaggregated)")
    p.add_argument("--log-dir", type=Path, default=None, help="where the cluster's logs go (default: $TANDEM_HOME)")
    p.add_argument("--startup-timeout", type=float, default=240.0, help="seconds each start stage may take")
    low = p.add_argument_group("low load (one stream)")
    low.add_argument("--rounds", type=int, default=5, help="rounds per API, alternating")
    low.add_argument("--num-prompts", type=int, default=8, help="requests per round")
    low.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    low.add_argument("--output-len", type=int, default=32, help="output tokens")
    high = p.add_argument_group("high load")
    high.add_argument("--concurrency", type=int, default=32, help="streams in flight")
    high.add_argument("--high-load-rounds", type=int, default=2, help="rounds per API, alternating (0: none)")
    high.add_argument("--high-load-prompts", type=int, default=64, help="requests per round")
    high.add_argument("--high-load-input-len", type=int, default=128, help="prompt tokens")
    high.add_argument("--high-load-output-len", type=int, default=64, help="output tokens")
    g = p.add_argument_group("run")
    g.add_argument("--num-warmups", type=int, default=8,
                   help="requests per API before the first round (at --concurrency streams)")
    g.add_argument("--prompt-tokens", default="words", choices=["words", "any"],
                   help="words: prompts of random lowercase word tokens (default); any: any token id")
    g.add_argument("--http-tokens", default="usage", choices=["usage", "chunks"],
                   help="how the HTTP client counts a chunk's tokens: from continuous_usage_stats, or one per chunk")
    g.add_argument("--seed", type=int, default=0, help="seeds the prompts (the same for both APIs)")
    g.add_argument("--timeout", type=float, default=600.0, help="each request's deadline in seconds")
    g.add_argument("--output-dir", type=Path, default=Path("bench-results"))
    g.add_argument("--label", default="", help="a name for this run in file names")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def check_args(args: argparse.Namespace) -> None:
    for name in ("rounds", "num_prompts", "input_len", "output_len", "concurrency", "high_load_prompts",
                 "high_load_input_len", "high_load_output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.high_load_rounds < 0 or args.num_warmups < 0:
        raise ValueError("--high-load-rounds and --num-warmups must be >= 0")
    if args.output_len < 2:
        raise ValueError("--output-len must be >= 2: one token has no inter-token latency")


def dataset(n: int, input_len: int, output_len: int, pool: int | list[int], seed: str) -> list[BenchRequest]:
    shape = SimpleNamespace(input_len=input_len, output_len=output_len, range_ratio=0.0)
    return random_dataset(shape, n, pool, random.Random(seed))


async def measure(grpc_address: str, http_url: str, args: argparse.Namespace) -> dict[str, list[dict]]:
    """Warm both APIs up, then the low-load and high-load rounds, alternating (and which goes first, round by
    round); phase -> the runs in order."""
    usage = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    backends: dict[str, Backend] = {
        "grpc": GatewayBackend(grpc_address, args.timeout),
        "http": OpenAIBackend(f"{http_url}/completions", "", usage if args.http_tokens == "usage" else {},
                              args.timeout, prompt_format="ids")}
    try:
        vocab = await backends["grpc"].vocab_size()
        pool = word_ids(tokenizer_file(args.model)) if args.prompt_tokens == "words" else vocab
        for api, backend in backends.items():
            print(f"  {NAMES[api]}:", end="")
            backend.cache_salt = f"bench-front-{api}-warmup"
            await warm_up(backend, dataset(args.num_warmups, args.high_load_input_len, args.high_load_output_len,
                                           pool, f"{args.seed}-warmup"), args.concurrency)
        phases = {"low": (args.rounds, args.num_prompts, args.input_len, args.output_len, 1),
                  "high": (args.high_load_rounds, args.high_load_prompts, args.high_load_input_len,
                           args.high_load_output_len, args.concurrency)}
        runs: dict[str, list[dict]] = {}
        for phase, (rounds, n, input_len, output_len, streams) in phases.items():
            runs[phase] = []
            for r in range(rounds):
                requests = dataset(n, input_len, output_len, pool, f"{args.seed}-{phase}{r}")
                order = list(backends.items())
                for api, backend in order[::-1] if r % 2 else order:  # G H, H G, ...: drift hits both alike
                    backend.cache_salt = f"bench-front-{api}-{phase}{r}"
                    label = f"{phase} load round {r + 1}/{rounds} {NAMES[api]} ({streams} stream{'s' * (streams > 1)})"
                    bar = Progress(n, label, enabled=args.progress)
                    result = await run_load(backend, requests, Load(math.inf, max_concurrency=streams), progress=bar)
                    bar.close()
                    m = result.metrics
                    print(f"  {label}: TTFT p50 {m['ttft_ms']['median']:.1f} ms, "
                          f"ITL p50 {m['itl_ms']['median']:.2f} ms, {m['output_throughput']:.1f} tok/s, "
                          f"{m['failed']} failed", flush=True)
                    runs[phase].append({"round": r, "api": api, "streams": streams, "result": result})
        return runs
    finally:
        for backend in backends.values():
            await backend.close()


def pooled(runs: list[dict], api: str) -> dict:
    """One API's figures over all its rounds: latencies over every request, throughput as all the tokens
    over all the rounds' time."""
    results: list[RunResult] = [run["result"] for run in runs if run["api"] == api]
    return compute_metrics([rec for res in results for rec in res.records], sum(res.duration for res in results))


def paired_ttft_ms(runs: list[dict]) -> list[float]:
    """HTTP TTFT - gRPC TTFT of the same request (same round, same index), in ms, where both completed."""
    by_round: dict[int, dict[str, RunResult]] = {}
    for run in runs:
        by_round.setdefault(run["round"], {})[run["api"]] = run["result"]
    diffs = []
    for pair in by_round.values():
        if len(pair) == 2:
            for g, h in zip(pair["grpc"].records, pair["http"].records, strict=True):
                if g.ok and h.ok:
                    diffs.append((h.ttft - g.ttft) * 1000)
    return diffs


def outside_ttft_ms(runs: list[dict], api: str) -> list[float]:
    """Client TTFT minus the TTFT the gateway's ``Generate`` reports for the same request, in ms: what the
    API's own path costs (client, connection, HTTP or gRPC stack, serialization) outside the orchestration
    the two APIs share. Far less noisy than TTFT itself, whose prefill varies by tens of milliseconds."""
    return [rec.ttft * 1000 - rec.server_ttft_ms for run in runs if run["api"] == api
            for rec in run["result"].records if rec.ok and rec.server_ttft_ms is not None]


def round_ratios(runs: list[dict]) -> list[float]:
    """HTTP output throughput / gRPC's, round by round."""
    by_round: dict[int, dict[str, float]] = {}
    for run in runs:
        by_round.setdefault(run["round"], {})[run["api"]] = run["result"].metrics["output_throughput"]
    return [p["http"] / p["grpc"] for p in by_round.values() if len(p) == 2 and p["grpc"]]


def summarize(runs: dict[str, list[dict]], concurrency: int) -> dict:
    low = {api: pooled(runs["low"], api) for api in APIS}
    high = {api: pooled(runs["high"], api) for api in APIS} if runs["high"] else None
    diffs = paired_ttft_ms(runs["low"])
    ttft = {api: low[api]["ttft_ms"]["median"] for api in APIS}
    itl = {api: low[api]["itl_ms"]["median"] for api in APIS}
    outside = {api: outside_ttft_ms(runs["low"], api) for api in APIS}
    outside_median = {api: statistics.median(v) if v else math.nan for api, v in outside.items()}
    out = {
        "low": {"pooled": low, "ttft_median_ms": ttft, "ttft_overhead_ms": ttft["http"] - ttft["grpc"],
                "ttft_paired_diffs_ms": diffs,
                "ttft_paired_diff_median_ms": statistics.median(diffs) if diffs else math.nan,
                "ttft_outside_generate_ms": outside_median,
                "ttft_front_overhead_ms": outside_median["http"] - outside_median["grpc"],
                "itl_median_ms": itl, "itl_ratio": itl["http"] / itl["grpc"] if itl["grpc"] else math.nan},
        "high": None,
        "targets": {"ttft_overhead_ms": TTFT_OVERHEAD_MS, "itl_ratio": 1 + ITL_OVERHEAD,
                    "throughput_ratio": THROUGHPUT_RATIO, "concurrency": concurrency},
    }
    if high is not None:
        tput = {api: high[api]["output_throughput"] for api in APIS}
        out["high"] = {"pooled": high, "output_throughput": tput,
                       "throughput_ratio": tput["http"] / tput["grpc"] if tput["grpc"] else math.nan,
                       "round_ratios": round_ratios(runs["high"])}
    out["met"] = {"ttft_overhead": out["low"]["ttft_overhead_ms"] <= TTFT_OVERHEAD_MS,
                  "ttft_paired": out["low"]["ttft_paired_diff_median_ms"] <= TTFT_OVERHEAD_MS,
                  "ttft_front": out["low"]["ttft_front_overhead_ms"] <= TTFT_OVERHEAD_MS,
                  "itl": out["low"]["itl_ratio"] <= 1 + ITL_OVERHEAD,
                  "throughput": None if high is None else out["high"]["throughput_ratio"] >= THROUGHPUT_RATIO}
    return out


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else fmt.format(value)


def _met(flag: bool | None) -> str:
    return "-" if flag is None else ("yes" if flag else "**no**")


def table(summary: dict, args: argparse.Namespace) -> str:
    low, high, met = summary["low"], summary["high"], summary["met"]
    lp = low["pooled"]

    def pct(h: float, g: float) -> str:
        return _num((h / g - 1) * 100 if g else math.nan, "{:+.1f}%")

    rows = [
        ("TTFT median, 1 stream (ms)", _num(lp["grpc"]["ttft_ms"]["median"], "{:.1f}"),
         _num(lp["http"]["ttft_ms"]["median"], "{:.1f}"), _num(low["ttft_overhead_ms"], "{:+.2f} ms"),
         f"<= +{TTFT_OVERHEAD_MS:g} ms", _met(met["ttft_overhead"])),
        ("TTFT paired difference, median, 1 stream", "-", "-", _num(low["ttft_paired_diff_median_ms"], "{:+.2f} ms"),
         f"<= +{TTFT_OVERHEAD_MS:g} ms", _met(met["ttft_paired"])),
        ("TTFT outside Generate (client minus gateway), median, 1 stream (ms)",
         _num(low["ttft_outside_generate_ms"]["grpc"], "{:.2f}"),
         _num(low["ttft_outside_generate_ms"]["http"], "{:.2f}"),
         _num(low["ttft_front_overhead_ms"], "{:+.2f} ms"), f"<= +{TTFT_OVERHEAD_MS:g} ms", _met(met["ttft_front"])),
        ("ITL median, 1 stream (ms)", _num(lp["grpc"]["itl_ms"]["median"], "{:.2f}"),
         _num(lp["http"]["itl_ms"]["median"], "{:.2f}"), _num((low["itl_ratio"] - 1) * 100, "{:+.1f}%"),
         f"<= +{ITL_OVERHEAD:.0%}", _met(met["itl"])),
        ("TPOT median, 1 stream (ms)", _num(lp["grpc"]["tpot_ms"]["median"], "{:.2f}"),
         _num(lp["http"]["tpot_ms"]["median"], "{:.2f}"),
         pct(lp["http"]["tpot_ms"]["median"], lp["grpc"]["tpot_ms"]["median"]), "", ""),
    ]
    if high is not None:
        hp, n = high["pooled"], args.concurrency
        ratios = high["round_ratios"]
        spread = f" (rounds {min(ratios):.1%}-{max(ratios):.1%})" if len(ratios) > 1 else ""
        rows += [
            (f"output throughput, {n} streams (tok/s)", _num(hp["grpc"]["output_throughput"], "{:.1f}"),
             _num(hp["http"]["output_throughput"], "{:.1f}"), _num(high["throughput_ratio"], "{:.1%}") + spread,
             f">= {THROUGHPUT_RATIO:.0%}", _met(met["throughput"])),
            (f"TTFT median, {n} streams (ms)", _num(hp["grpc"]["ttft_ms"]["median"], "{:.1f}"),
             _num(hp["http"]["ttft_ms"]["median"], "{:.1f}"),
             _num(hp["http"]["ttft_ms"]["median"] - hp["grpc"]["ttft_ms"]["median"], "{:+.1f} ms"), "", ""),
            (f"ITL median, {n} streams (ms)", _num(hp["grpc"]["itl_ms"]["median"], "{:.2f}"),
             _num(hp["http"]["itl_ms"]["median"], "{:.2f}"),
             pct(hp["http"]["itl_ms"]["median"], hp["grpc"]["itl_ms"]["median"]), "", ""),
        ]
    failed = {api: lp[api]["failed"] + (high["pooled"][api]["failed"] if high else 0) for api in APIS}
    rows.append(("failed requests", str(failed["grpc"]), str(failed["http"]), "", "0", _met(not any(failed.values()))))
    header = ("metric", "gRPC", "HTTP", "HTTP vs gRPC", "target", "met?")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def describe(args: argparse.Namespace, plan: dict[str, list[int]]) -> str:
    pins = ", ".join(f"{kind} on cores {','.join(map(str, cpus))}" for kind, cpus in plan.items()) or "not pinned"
    return (f"{args.mode} cluster ({pins}); HTTP /v1/completions with token-id prompts against gRPC Generate, "
            f"alternating. Low load: 1 stream, {args.rounds} rounds x {args.num_prompts} requests per API, "
            f"{args.input_len} tokens in, {args.output_len} out. High load: {args.concurrency} streams, "
            f"{args.high_load_rounds} rounds x {args.high_load_prompts} requests per API, "
            f"{args.high_load_input_len} in, {args.high_load_output_len} out. {args.prompt_tokens} prompts, "
            f"seed {args.seed}, greedy, ignore_eos, a cache salt per run.")


def result_doc(args: argparse.Namespace, plan: dict[str, list[int]], targets: dict[str, str],
               runs: dict[str, list[dict]], summary: dict, md: str) -> dict:
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"}
    return {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": platform.platform(), "args": settings,
            "topology": args.mode, "cpu_affinity": plan, **targets, "summary": summary, "table": md,
            "rounds": {phase: [{"round": run["round"], "api": run["api"], "streams": run["streams"],
                                **run["result"].to_json()} for run in phase_runs]
                       for phase, phase_runs in runs.items()}}


def run(args: argparse.Namespace) -> int:
    from common.engine_args import engine_flags
    from tandem.launcher import Cluster, ClusterConfig

    check_args(args)
    plan = affinity_plan(args.mode, usable_cpus()) if args.pin else {}
    print(f"bench front: {describe(args, plan)}", flush=True)
    cluster = Cluster(ClusterConfig(mode=args.mode, gateway_port=0, http_port=0, engine_args=engine_flags(args),
                                    log_dir=args.log_dir, kv_capacity_gb=args.kv_capacity_gb,
                                    startup_timeout=args.startup_timeout, cpu_affinity=plan))
    print(f"bench front: starting {args.mode}, logs in {cluster.log_dir}", flush=True)
    start = time.perf_counter()
    with cluster:  # started here, stopped on the way out
        cluster.wait_healthy(60)
        targets = {"grpc": cluster.gateway.address, "http": cluster.http_url}
        print(f"bench front: gRPC at {targets['grpc']}, HTTP at {targets['http']}", flush=True)
        runs = asyncio.run(measure(targets["grpc"], targets["http"], args))
    summary = summarize(runs, args.concurrency)
    md = table(summary, args)
    print(md)
    print(f"bench front: {time.perf_counter() - start:.0f} s from the cluster's start")
    args.output_dir.mkdir(parents=True, exist_ok=True)
    stem = output_stem("front", args.label)
    md_path, json_path = args.output_dir / f"{stem}.md", args.output_dir / f"{stem}.json"
    md_path.write_text(f"{describe(args, plan)}\n\n{md}\n")
    json_path.write_text(json.dumps(result_doc(args, plan, targets, runs, summary, md), indent=1, default=str))
    for path in (md_path, json_path):
        print(f"wrote {path}")
    results = [run["result"] for phase_runs in runs.values() for run in phase_runs]
    return 0 if all(res.metrics["failed"] == 0 for res in results) else 1
