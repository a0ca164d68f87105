"""PNG plots of the serving benchmarks (matplotlib, without a display).

- latency CDFs: TTFT, TPOT, ITL, E2E, one line per request rate: the whole distribution,
  where percentiles show only points of it;
- throughput against the offered rate: where the system stops keeping up (achieved < offered);
- a timeline per rate of the client's requests in flight and each worker's running and
  waiting requests: where the queues grew;
- ``bench compare``: each topology's ITL p99, TTFT p99, goodput and throughput against the rate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.bench.metrics import latencies
from tandem.bench.report import format_rate

if TYPE_CHECKING:
    from tandem.bench.results import RunResult

CDF_PANELS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency"))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def rate_axis(rates: Sequence[float]) -> tuple[list[float], list[str] | None]:
    """x positions for request rates: the rates themselves, or evenly spaced slots with labels when
    one is ``inf`` (which has no place on a numeric axis)."""
    if all(math.isfinite(r) for r in rates):
        return list(rates), None
    return list(range(len(rates))), [format_rate(r) for r in rates]


def _latencies(result: RunResult, key: str) -> list[float]:
    return sorted(v * 1000 for v in latencies([r for r in result.records if r.ok], key))


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_latency_cdfs(results: Sequence[RunResult], path: Path) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for ax, (key, title) in zip(axes.flat, CDF_PANELS, strict=True):
        plotted = False
        for result in results:
            values = _latencies(result, key)
            if values:
                ys = [(i + 1) / len(values) for i in range(len(values))]
                ax.step(values, ys, where="post", label=f"{format_rate(result.load.rate)} req/s")
                plotted = True
        ax.set(title=title, xlabel="ms", ylabel="fraction of " + ("gaps" if key == "itl" else "requests"), ylim=(0, 1))
        if plotted:
            ax.set_xscale("log")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle("latency CDFs")
    return _save(plt, fig, path)


def plot_throughput(results: Sequence[RunResult], path: Path) -> Path:
    plt = _pyplot()
    rates = [r.load.rate for r in results]
    xs, labels = rate_axis(rates)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(xs, [r.metrics["request_throughput"] for r in results], "o-", label="achieved")
    if labels is None:
        left.plot(xs, xs, ":", color="gray", label="offered")
    if any(r.metrics["goodput"] is not None for r in results):
        left.plot(xs, [r.metrics["goodput"] or 0.0 for r in results], "s--", label="goodput")
    left.set(title="requests", xlabel="offered request rate (req/s)", ylabel="req/s")
    right.plot(xs, [r.metrics["output_throughput"] for r in results], "o-", label="output")
    right.plot(xs, [r.metrics["total_token_throughput"] for r in results], "s--", label="input + output")
    right.set(title="tokens", xlabel="offered request rate (req/s)", ylabel="tokens/s")
    for ax in (left, right):
        if labels is not None:
            ax.set_xticks(xs, labels)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(plt, fig, path)


def plot_timeline(results: Sequence[RunResult], path: Path) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(len(results), 1, figsize=(11, 2.8 * len(results)), squeeze=False)
    for ax, result in zip(axes[:, 0], results, strict=True):
        samples = result.timeline
        ts = [s.t for s in samples]
        ax.plot(ts, [s.client_inflight for s in samples], color="black", label="client: in flight")
        workers = sorted({name for s in samples for name in s.workers})
        for i, name in enumerate(workers):
            color = f"C{i}"
            points = [(s.t, *s.workers[name]) for s in samples if name in s.workers]
            ax.plot([p[0] for p in points], [p[1] for p in points], color=color, label=f"{name}: running")
            ax.plot([p[0] for p in points], [p[2] for p in points], "--", color=color, label=f"{name}: waiting")
        ax.set(title=f"{format_rate(result.load.rate)} req/s", xlabel="s", ylabel="requests")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    return _save(plt, fig, path)


def plot_serve(results: Sequence[RunResult], out_dir: Path, stem: str) -> list[Path]:
    """The three plots of one ``bench serve`` sweep, as ``<stem>-{cdf,throughput,timeline}.png``."""
    return [plot_latency_cdfs(results, out_dir / f"{stem}-cdf.png"),
            plot_throughput(results, out_dir / f"{stem}-throughput.png"),
            plot_timeline(results, out_dir / f"{stem}-timeline.png")]


COMPARE_PANELS = (
    ("ITL p99 (ms)", lambda m: m["itl_ms"]["p99"]),
    ("TTFT p99 (ms)", lambda m: m["ttft_ms"]["p99"]),
    ("goodput (req/s)", lambda m: m["goodput"]),
    ("output throughput (tok/s)", lambda m: m["output_throughput"]),
)


def plot_compare(series: dict[str, Sequence[RunResult]], path: Path) -> Path:
    """One line per topology in each panel; goodput is left empty when no SLO was given."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for ax, (title, get) in zip(axes.flat, COMPARE_PANELS, strict=True):
        for name, results in series.items():
            xs, labels = rate_axis([r.load.rate for r in results])
            ys = [get(r.metrics) for r in results]
            if any(y is not None for y in ys):
                ax.plot(xs, [math.nan if y is None else y for y in ys], "o-", label=name)
            if labels is not None:
                ax.set_xticks(xs, labels)
        ax.set(title=title, xlabel="offered request rate (req/s)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle("aggregated against disaggregated")
    return _save(plt, fig, path)
