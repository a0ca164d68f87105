"""``tandem bench serve``: load a running server the way users would, and report what they saw.

As ``vllm bench serve``: requests arrive at a given rate, their gaps drawn from a gamma
distribution (burstiness 1 is a Poisson process; below 1 the arrivals bunch up, above 1 they
even out) or all at once (``inf``), optionally capped at a number in flight. A sweep runs
several rates one after the other; each rate gets fresh prompts (seeded), so that the prefix
cache does not carry one rate's prompts into the next. A few warm-up requests come first.

Reported per rate: TTFT, TPOT, ITL and end-to-end latency (mean, median, p90, p99), request
and token throughput, goodput under ``--slo``, the prefix-cache hit rate; written to one JSON
file with every request's timeline and the workers' running / waiting counts, and plotted.
The figures are computed in ``tandem.bench.metrics``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import platform
import random
import sys
import time
from pathlib import Path

from common.settings import env_default
from tandem.bench.backends import Backend, GatewayBackend, OpenAIBackend
from tandem.bench.datasets import (
    BenchRequest,
    add_dataset_args,
    attach_text,
    build_dataset,
    check_dataset_args,
    word_ids,
)
from tandem.bench.metrics import RequestRecord, compute_metrics, parse_slo
from tandem.bench.progress import Progress
from tandem.bench.report import format_rate, format_report, markdown_table
from tandem.bench.results import Load, RunResult
from tandem.bench.timeline import StatsPoller
from tandem.client import DEFAULT_GATEWAY


def add_load_args(p: argparse.ArgumentParser) -> None:
    """How the load is offered and reported; shared by ``bench serve`` and ``bench compare``."""
    g = p.add_argument_group("load")
    g.add_argument("--request-rate", default="inf", type=parse_rates,
                   help="requests per second, or a comma-separated sweep such as 1,2,4,inf (inf: all at once)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 is Poisson, < 1 burstier, > 1 more even")
    g.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    g.add_argument("--num-warmups", type=int, default=2, help="requests sent (and not measured) before the first rate")
    g.add_argument("--seed", type=int, default=0, help="seeds the prompts and the arrival times")
    g.add_argument("--slo", type=parse_slo, default={}, metavar="KEY=DUR,...",
                   help="goodput bounds, e.g. ttft=500ms,tpot=100ms (keys ttft, tpot, itl, e2el)")
    g.add_argument("--timeout", type=float, default=600.0, help="each request's deadline in seconds")
    g.add_argument("--stats-interval", type=float, default=0.5, help="seconds between polls of the workers' Stats")
    g.add_argument("--output-dir", type=Path, default=Path("bench-results"))
    g.add_argument("--label", default="", help="a name for this run in file names and reports")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    g.add_argument("--no-plots", dest="plots", action="store_false", help="no PNG plots")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="tandem", choices=["tandem", "openai"],
                   help="tandem: a gateway over gRPC; openai: an OpenAI-compatible completions server over HTTP")
    p.add_argument("--gateway", default=env_default("--gateway", DEFAULT_GATEWAY),
                   help=f"tandem: the gateway's address (default {DEFAULT_GATEWAY}; env TANDEM_GATEWAY)")
    p.add_argument("--url", default="http://127.0.0.1:8000/v1/completions",
                   help="openai: the completions (or chat/completions) endpoint")
    p.add_argument("--served-model", default="", help="openai: the request's model field")
    p.add_argument("--tokenizer", default=None,
                   help="openai: tokenizer.json or a model folder, to turn random prompts into text "
                        "(default: the bundled SmolLM2)")
    p.add_argument("--prompt-format", default="text", choices=["text", "ids"],
                   help="openai: send the prompt as text, or as token ids (vLLM, llama.cpp's llama-server)")
    p.add_argument("--extra-body", type=json.loads, default={}, metavar="JSON",
                   help='openai: fields added to every request, e.g. \'{"repeat_penalty": 1.0}\'')
    p.add_argument("--api-key", default=env_default("--api-key", None, str),
                   help="an API key, for a gateway started with --api-keys-file (or an OpenAI server that asks "
                        "for one), sent as `authorization: Bearer`; env TANDEM_API_KEY")
    add_load_args(p)
    add_dataset_args(p)


def parse_rates(text: str) -> list[float]:
    """``"1,2.5,inf"`` -> ``[1.0, 2.5, inf]``; every rate must be > 0."""
    rates = [float(part) for part in text.split(",") if part.strip()]
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"request rates must be > 0 (or inf), not {text!r}")
    return rates


def arrival_offsets(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """When each of ``n`` requests goes out, in seconds after the start: gaps drawn from
    Gamma(shape=burstiness, scale=1 / (rate * burstiness)), whose mean is 1 / rate whatever the
    burstiness (and whose coefficient of variation is 1 / sqrt(burstiness)). The first goes at 0."""
    if burstiness <= 0:
        raise ValueError("--burstiness must be > 0")
    if math.isinf(rate):
        return [0.0] * n
    scale = 1.0 / (rate * burstiness)
    offsets, t = [], 0.0
    for _ in range(n):
        offsets.append(t)
        t += rng.gammavariate(burstiness, scale)
    return offsets


async def run_load(backend: Backend, requests: list[BenchRequest], load: Load, *, seed: str | int = 0,
                   gateway: str | None = None, slo: dict[str, float] | None = None, progress: Progress | None = None,
                   stats_interval: float = 0.5) -> RunResult:
    """Offer ``requests`` at ``load``, wait for all of them, and compute the figures."""
    offsets = arrival_offsets(len(requests), load.rate, load.burstiness, random.Random(seed))
    slots = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    records = [RequestRecord(send=0.0, prompt_len=r.prompt_len, expected_output=r.output_len) for r in requests]
    inflight = 0
    poller = StatsPoller(lambda: inflight, gateway, stats_interval, getattr(backend, "metadata", None))
    await poller.discover()

    async def one(i: int) -> None:
        nonlocal inflight
        await asyncio.sleep(max(0.0, t0 + offsets[i] - time.perf_counter()))
        async with slots or contextlib.nullcontext():
            inflight += 1
            records[i].send = time.perf_counter()
            try:
                await backend.send(requests[i], records[i])
            finally:
                inflight -= 1
        if progress is not None:
            progress.update(inflight, records[i].ok)

    stop = asyncio.Event()
    t0 = time.perf_counter()
    sampler = asyncio.create_task(poller.run(t0, stop))
    try:
        await asyncio.gather(*(one(i) for i in range(len(requests))))
    finally:
        stop.set()
        await sampler
        await poller.close()
    duration = max((r.end or t0 for r in records), default=t0) - t0
    return RunResult(load, records, t0, duration, poller.samples, compute_metrics(records, duration, slo))


async def warm_up(backend: Backend, requests: list[BenchRequest], max_concurrency: int | None) -> None:
    """Send the warm-up requests (all at once, within the concurrency cap) and wait for them:
    first calls pay for connections, lazy allocations and the like, which no rate should see."""
    if not requests:
        return
    result = await run_load(backend, requests, Load(math.inf, max_concurrency=max_concurrency))
    failed = result.metrics["failed"]
    print(f"  warm-up: {len(requests)} requests, {failed} failed" + (f" {result.metrics['errors']}" if failed else ""))


async def sweep(backend: Backend, args: argparse.Namespace, vocab: int, gateway: str | None = None,
                title: str = "") -> list[RunResult]:
    """Warm up, then run every rate of ``--request-rate`` with its own seeded prompts."""
    pool = word_ids(tokenizer_file(getattr(args, "tokenizer", None))) if args.prompt_tokens == "words" else vocab

    def dataset(n: int, tag: str) -> list[BenchRequest]:
        requests = build_dataset(args, n, pool, seed=f"{args.seed}-{tag}")
        if isinstance(backend, OpenAIBackend) and backend.prompt_format == "text":
            attach_text(requests, tokenizer_file(args.tokenizer))
        return requests

    await warm_up(backend, dataset(args.num_warmups, "warmup"), args.max_concurrency)
    results = []
    for i, rate in enumerate(args.request_rate):
        load = Load(rate, args.burstiness, args.max_concurrency)
        label = f"{title} rate {format_rate(rate)}".strip()
        bar = Progress(args.num_prompts, label, enabled=args.progress)
        result = await run_load(backend, dataset(args.num_prompts, f"rate{i}"), load, seed=f"{args.seed}-arrivals{i}",
                                gateway=gateway, slo=args.slo, progress=bar, stats_interval=args.stats_interval)
        bar.close()
        print(format_report(result.metrics, label))
        results.append(result)
    return results


def tokenizer_file(path: str | None) -> str:
    """tokenizer.json from a file or a model folder (default: the bundled model's)."""
    if path is None:
        from common.engine_args import resolve_model

        path = str(resolve_model(None))
    p = Path(path)
    return str(p / "tokenizer.json" if p.is_dir() else p)


def sweep_table(results: list[RunResult], lead: dict[str, str] | None = None) -> str:
    return markdown_table([({**(lead or {}), "rate": format_rate(r.load.rate)}, r.metrics) for r in results])


def result_doc(args: argparse.Namespace, results: list[RunResult], **extra: object) -> dict:
    """The JSON result file: the arguments, the machine, and each rate's figures and timelines."""
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"}
    settings["request_rate"] = [format_rate(r) for r in args.request_rate]
    return {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": platform.platform(), "args": settings, **extra,
            "runs": [r.to_json() for r in results]}


def output_stem(kind: str, label: str) -> str:
    """The result files' common name: ``<kind>-[<label>-]<date>-<time>``."""
    return f"{kind}-{label + '-' if label else ''}{time.strftime('%Y%m%d-%H%M%S')}"


def write_outputs(args: argparse.Namespace, results: list[RunResult], stem: str, **extra: object) -> list[Path]:
    """``<stem>.json`` and (unless ``--no-plots``) the three PNGs; the paths written."""
    args.output_dir.mkdir(parents=True, exist_ok=True)
    path = args.output_dir / f"{stem}.json"
    path.write_text(json.dumps(result_doc(args, results, **extra), indent=1, default=str, allow_nan=True))
    written = [path]
    if args.plots:
        from tandem.bench import plots

        written += plots.plot_serve(results, args.output_dir, stem)
    return written


def make_backend(args: argparse.Namespace) -> Backend:
    if args.backend == "openai":
        return OpenAIBackend(args.url, args.served_model, args.extra_body, args.timeout, args.prompt_format,
                             args.api_key)
    return GatewayBackend(args.gateway, args.timeout, args.api_key)


async def _serve(args: argparse.Namespace) -> list[RunResult]:
    backend = make_backend(args)
    try:
        if isinstance(backend, GatewayBackend):
            vocab = await backend.vocab_size()
            return await sweep(backend, args, vocab, gateway=args.gateway, title=args.label)
        from tokenizers import Tokenizer

        vocab = Tokenizer.from_file(tokenizer_file(args.tokenizer)).get_vocab_size()
        return await sweep(backend, args, vocab, title=args.label)
    finally:
        await backend.close()


def run(args: argparse.Namespace) -> int:
    check_dataset_args(args)
    target = args.url if args.backend == "openai" else args.gateway
    print(f"bench serve: {args.backend} at {target}; {args.dataset} workload, {args.num_prompts} requests per rate, "
          f"rates {', '.join(map(format_rate, args.request_rate))}"
          + (f", at most {args.max_concurrency} in flight" if args.max_concurrency else ""))
    try:
        results = asyncio.run(_serve(args))
    except ConnectionError as exc:
        print(f"tandem bench serve: {exc}", file=sys.stderr)
        return 1
    print(sweep_table(results))
    stem = output_stem("serve", args.label)
    for path in write_outputs(args, results, stem, backend=args.backend, target=target):
        print(f"wrote {path}")
    return 0 if all(r.metrics["completed"] for r in results) else 1
