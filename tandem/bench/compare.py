"""``tandem bench compare``: aggregated against disaggregated serving, same workload, same machine.

Each topology is started as a ``tandem up`` cluster, warmed up, swept over the request rates
of ``bench serve`` (same seeds, so both see the same prompts at the same times), and stopped
before the next starts, so the two never share the machine. The workers are pinned to cores:
the prefill worker to one half, the decode worker to the other, the aggregated worker to all of
them, with one engine thread per core, so that disaggregation is judged on how it splits the
work, not on one side getting more cores. The other services (gateway, tokenizer, kvstore) and
this client float. Written: one markdown table, one JSON file (with every run's details) and
one PNG (ITL p99, TTFT p99, goodput and throughput against the rate).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path

from tandem.bench.backends import GatewayBackend
from tandem.bench.datasets import add_dataset_args, check_dataset_args
from tandem.bench.report import format_rate, markdown_table
from tandem.bench.serve import RunResult, add_load_args, output_stem, result_doc, sweep

MODES = ("aggregated", "disaggregated")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated topologies to run, in this order")
    p.add_argument("--no-pin", dest="pin", action="store_false", help="let the workers run on any core")
    p.add_argument("--kv-capacity-gb", type=float, default=1.0, help="the kvstore's block pool (disaggregated)")
    p.add_argument("--log-dir", type=Path, default=None, help="where the clusters' logs go (default: $TANDEM_HOME)")
    p.add_argument("--startup-timeout", type=float, default=240.0, help="seconds each start stage may take")
    p.add_argument("--serve-plots", action="store_true",
                   help="also each topology's latency CDFs, throughput and running / waiting timeline")
    add_load_args(p)
    add_dataset_args(p)


def usable_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def affinity_plan(mode: str, cpus: list[int]) -> dict[str, list[int]]:
    """Cores per worker kind: prefill and decode on disjoint halves, the aggregated worker on all
    (nothing pinned with fewer than two cores, where there is nothing to split)."""
    if len(cpus) < 2:
        return {}
    if mode == "aggregated":
        return {"decode": list(cpus)}
    half = len(cpus) // 2
    return {"prefill": cpus[:half], "decode": cpus[half:]}


def parse_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = set(modes) - set(MODES)
    if not modes or unknown:
        raise ValueError(f"--modes takes {' and/or '.join(MODES)}, not {text!r}")
    return modes


def run_topology(mode: str, args: argparse.Namespace) -> list[RunResult]:
    """Start the ``mode`` cluster, sweep the rates against its gateway, stop it."""
    from common.engine_args import engine_flags
    from tandem.launcher import Cluster, ClusterConfig

    plan = affinity_plan(mode, usable_cpus()) if args.pin else {}
    log_dir = args.log_dir / mode if args.log_dir else None
    cluster = Cluster(ClusterConfig(mode=mode, gateway_port=0, engine_args=engine_flags(args), log_dir=log_dir,
                                    kv_capacity_gb=args.kv_capacity_gb, startup_timeout=args.startup_timeout,
                                    cpu_affinity=plan))
    pins = ", ".join(f"{kind} on cores {','.join(map(str, cpus))}" for kind, cpus in plan.items()) or "not pinned"
    print(f"bench compare: starting {mode} ({pins}), logs in {cluster.log_dir}", flush=True)
    with cluster:  # started here, stopped on the way out
        cluster.wait_healthy(60)
        return asyncio.run(_sweep(cluster.gateway.address, args, mode))


async def _sweep(address: str, args: argparse.Namespace, mode: str) -> list[RunResult]:
    backend = GatewayBackend(address, args.timeout)
    try:
        return await sweep(backend, args, await backend.vocab_size(), gateway=address, title=mode)
    finally:
        await backend.close()


def compare_doc(series: dict[str, list[RunResult]]) -> dict:
    """The table's figures: topology -> rate -> metrics."""
    return {mode: {format_rate(r.load.rate): r.metrics for r in results} for mode, results in series.items()}


def describe(args: argparse.Namespace) -> str:
    """One line that says what was compared, for the top of the table."""
    shape = {"random": f"{args.input_len}-token prompts, {args.output_len} tokens out",
             "shared-prefix": f"{args.num_prefixes} system prompts of {args.prefix_len} tokens x "
                              f"{args.question_len}-token questions, {args.output_len} tokens out",
             "conversation": f"log-normal lengths (median {args.input_len} in, {args.output_len} out, "
                             f"sigma {args.sigma})"}[args.dataset]
    arrivals = "Poisson" if args.burstiness == 1 else f"gamma (burstiness {args.burstiness:g})"
    slo = ", ".join(f"{k} <= {v:g} ms" for k, v in args.slo.items()) or "none"
    pins = f"pinned to cores {usable_cpus()}" if args.pin else "not pinned"
    return (f"{args.dataset} workload: {shape}; {args.num_prompts} requests per rate, {arrivals} arrivals, "
            f"seed {args.seed}; SLO {slo}; workers {pins}")


def write_outputs(args: argparse.Namespace, series: dict[str, list[RunResult]], table: str) -> list[Path]:
    """``compare-*.md`` (the table), ``.json`` (its figures and every run's details), ``.png``."""
    args.output_dir.mkdir(parents=True, exist_ok=True)
    stem = output_stem("compare", args.label)
    md, doc = args.output_dir / f"{stem}.md", args.output_dir / f"{stem}.json"
    md.write_text(f"{describe(args)}\n\n{table}\n")
    details = {mode: result_doc(args, results, topology=mode,
                                cpu_affinity=affinity_plan(mode, usable_cpus()) if args.pin else {})
               for mode, results in series.items()}
    doc.write_text(json.dumps({"table": compare_doc(series), "details": details}, indent=1, default=str))
    written = [md, doc]
    if args.plots:
        from tandem.bench.plots import plot_compare, plot_serve

        written.append(plot_compare(series, args.output_dir / f"{stem}.png"))
        for mode, results in series.items() if args.serve_plots else ():
            written += plot_serve(results, args.output_dir, f"{stem}-{mode}")
    return written


def run(args: argparse.Namespace) -> int:
    check_dataset_args(args)
    modes = parse_modes(args.modes)
    print(f"bench compare: {', '.join(modes)}; {describe(args)}")
    series = {mode: run_topology(mode, args) for mode in modes}
    table = markdown_table([({"topology": mode, "rate": format_rate(r.load.rate)}, r.metrics)
                            for mode, results in series.items() for r in results])
    print(table)
    for path in write_outputs(args, series, table):
        print(f"wrote {path}")
    return 0 if all(r.metrics["completed"] for results in series.values() for r in results) else 1
