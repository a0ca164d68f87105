"""``tandem bench pipeline``: what the gRPC pipeline costs over the engine in-process, at low load.

One request at a time (no queueing), the same engine settings on both sides, the
same kind of prompts (random token ids, fresh ones per request so no cache helps):
the in-process ``AsyncEngine`` and a ``tandem up`` cluster (disaggregated, and
aggregated with ``--modes``) are measured alternately, request by request, in one
run. TTFT is measured from the client's send to the first token it receives; the
inter-token latency is the gap between consecutive tokens. Reported: medians and
p90s, the TTFT overhead in milliseconds and the median ITL overhead in percent.

``--tracing`` measures what tracing costs instead: two clusters, one exporting every
span over OTLP/gRPC to a receiver in this process, one with ``OTEL_SDK_DISABLED``,
measured alternately in the same way (target: median ITL overhead <= 3%).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from common.service import channel
from protos import common_pb2 as cpb
from protos import gateway_pb2 as gpb
from tandem import otlp_receiver
from tandem.bench.metrics import percentile
from tandem.client import stream_generate

TARGET_TTFT_OVERHEAD_MS = 25.0
TARGET_ITL_OVERHEAD = 0.10
TARGET_TRACING_ITL_OVERHEAD = 0.03


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-requests", type=int, default=20, help="measured requests per system")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--modes", default="disaggregated", help="comma-separated: disaggregated, aggregated")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tracing", action="store_true",
                   help="compare a cluster with tracing on (OTLP to a local receiver) against one with it off")
    p.add_argument("--output-dir", default="bench-results")


@dataclass(slots=True)
class Sample:
    ttft_ms: float
    itl_ms: list[float]


@dataclass
class Series:
    name: str
    samples: list[Sample] = field(default_factory=list)

    def ttfts(self) -> list[float]:
        return [s.ttft_ms for s in self.samples]

    def itls(self) -> list[float]:
        return [g for s in self.samples for g in s.itl_ms]

    def summary(self) -> dict[str, float]:
        return {
            "ttft_ms_median": statistics.median(self.ttfts()),
            "ttft_ms_p90": percentile(self.ttfts(), 90),
            "itl_ms_median": statistics.median(self.itls()),
            "itl_ms_p90": percentile(self.itls(), 90),
            "requests": len(self.samples),
        }


def gaps_ms(stamps: list[float]) -> list[float]:
    return [(b - a) * 1000 for a, b in zip(stamps, stamps[1:], strict=False)]


class InProcess:
    """The engine in this process, behind the same async front the workers use."""

    def __init__(self, args: argparse.Namespace) -> None:
        from common.engine_args import engine_config
        from engine.async_engine import AsyncEngine
        from engine.engine import Engine

        self.engine = AsyncEngine(Engine(engine_config(args)))
        self._ids = 0

    async def run(self, prompt: list[int], max_tokens: int) -> Sample:
        from engine.sampling_params import SamplingParams

        self._ids += 1
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        start, stamps = time.perf_counter(), []
        async for out in self.engine.generate(prompt, params, f"bench-{self._ids}"):
            stamps += [time.perf_counter()] * len(out.new_token_ids)
        return Sample((stamps[0] - start) * 1000, gaps_ms(stamps))

    def close(self) -> None:
        self.engine.shutdown()


class ThroughGateway:
    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = None

    async def run(self, prompt: list[int], max_tokens: int) -> Sample:
        if self.channel is None:
            self.channel = channel(self.address)
        req = gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=prompt), sampling=cpb.SamplingParams(
            max_tokens=max_tokens, temperature=0, ignore_eos=True))
        start, stamps = time.perf_counter(), []
        async for msg in stream_generate(self.channel, req, timeout=300):
            stamps += [time.perf_counter()] * len(msg.token_ids)
        assert len(stamps) == max_tokens, f"{len(stamps)} tokens of {max_tokens}"
        return Sample((stamps[0] - start) * 1000, gaps_ms(stamps))


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


async def measure(systems: dict[str, object], args: argparse.Namespace, vocab: int) -> dict[str, Series]:
    """Requests alternate between the systems, so that drift in the machine's speed hits all alike."""
    series = {name: Series(name) for name in systems}
    total = args.warmup + args.num_requests
    work = prompts(total * len(systems), args.prompt_len, vocab, args.seed)
    for i in range(total):
        for j, (name, system) in enumerate(systems.items()):
            sample = await system.run(work[i * len(systems) + j], args.max_tokens)
            if i >= args.warmup:
                series[name].samples.append(sample)
        print(f"\r  request {i + 1}/{total}", end="", flush=True)
    print()
    return series


def report(series: dict[str, Series], ttft_target: float | None, itl_target: float) -> tuple[str, dict]:
    """A table against the first system; the targets mark the others' overheads."""
    base_name = next(iter(series))
    base = series[base_name].summary()
    lines = ["| system | TTFT median ms | TTFT p90 | ITL median ms | ITL p90 | TTFT overhead ms | ITL overhead |",
             "|---|---|---|---|---|---|---|"]
    figures = {}
    for name, s in series.items():
        m = s.summary()
        ttft_over = m["ttft_ms_median"] - base["ttft_ms_median"]
        itl_over = m["itl_ms_median"] / base["itl_ms_median"] - 1
        m.update(ttft_overhead_ms=ttft_over, itl_overhead=itl_over)
        figures[name] = m
        ttft_mark = "" if ttft_target is None else (" ok" if ttft_over <= ttft_target else " MISSED")
        over = "" if name == base_name else (
            f"{ttft_over:+.1f}{ttft_mark} | {itl_over:+.1%} {'ok' if itl_over <= itl_target else 'MISSED'}")
        lines.append(f"| {name} | {m['ttft_ms_median']:.1f} | {m['ttft_ms_p90']:.1f} | {m['itl_ms_median']:.2f} | "
                     f"{m['itl_ms_p90']:.2f} | {over or '- | -'} |")
    return "\n".join(lines), figures


def run(args: argparse.Namespace) -> int:
    from common.engine_args import engine_flags, resolve_model
    from tandem.launcher import Cluster, ClusterConfig, read_model_config

    if args.num_threads is None:
        args.num_threads = 2
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    vocab = read_model_config(resolve_model(args.model))["vocab_size"]
    local = None if args.tracing else InProcess(args)
    clusters, receiver = [], None
    try:
        systems: dict[str, object] = {} if local is None else {"in-process": local}
        if args.tracing:
            receiver, port, _ = otlp_receiver.start()
            variants = {"tracing off": {"OTEL_SDK_DISABLED": "true"},
                        "tracing on": {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
                                       "OTEL_EXPORTER_OTLP_INSECURE": "true"}}
            runs = [(name, modes[0], env) for name, env in variants.items()]
        else:
            runs = [(f"pipeline ({mode})", mode, {}) for mode in modes]
        for name, mode, env in runs:
            cluster = Cluster(ClusterConfig(mode=mode, gateway_port=0, engine_args=engine_flags(args), env=env))
            clusters.append(cluster.start())
            cluster.wait_healthy(60)
            systems[name] = ThroughGateway(cluster.gateway.address)
        print(f"{args.num_requests} requests each (+{args.warmup} warm-up), one at a time, alternating; "
              f"{args.prompt_len}-token prompts, {args.max_tokens} tokens out, {args.num_threads} threads per engine")
        series = asyncio.run(measure(systems, args, vocab))
    finally:
        for cluster in clusters:
            cluster.stop()
        if local is not None:
            local.close()
        if receiver is not None:
            receiver.stop(0)
    if args.tracing:
        table, figures = report(series, None, TARGET_TRACING_ITL_OVERHEAD)
        targets = f"target: median ITL overhead of tracing <= {TARGET_TRACING_ITL_OVERHEAD:.0%}"
    else:
        table, figures = report(series, TARGET_TTFT_OVERHEAD_MS, TARGET_ITL_OVERHEAD)
        targets = (f"targets: TTFT overhead <= {TARGET_TTFT_OVERHEAD_MS:.0f} ms, median ITL overhead <= "
                   f"{TARGET_ITL_OVERHEAD:.0%}")
    print(table)
    print(targets)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    kind = "tracing" if args.tracing else "pipeline"
    path = out / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    doc = {"args": {k: v for k, v in vars(args).items() if k != "func"}, "machine": platform.platform(),
           "figures": figures, "raw": {n: [asdict(x) for x in s.samples] for n, s in series.items()}}
    path.write_text(json.dumps(doc, indent=1, default=str))
    print(f"wrote {path}")
    return 0
