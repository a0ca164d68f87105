"""What ``bench serve`` and ``bench compare`` print and write: the per-run report in the layout
of ``vllm bench serve`` (so numbers can be read side by side), and one markdown row per run."""

from __future__ import annotations

import math

METRIC_TITLES = (("ttft_ms", "TTFT", "Time to First Token"), ("tpot_ms", "TPOT", "Time per Output Token (excl. 1st)"),
                 ("itl_ms", "ITL", "Inter-token Latency"), ("e2el_ms", "E2EL", "End-to-end Latency"))
# The columns of a sweep's table: header, how to read it from a run's metrics.
COLUMNS = (
    ("req/s", lambda m: m["request_throughput"], "{:.2f}"),
    ("out tok/s", lambda m: m["output_throughput"], "{:.1f}"),
    ("TTFT p50 ms", lambda m: m["ttft_ms"]["median"], "{:.0f}"),
    ("TTFT p99 ms", lambda m: m["ttft_ms"]["p99"], "{:.0f}"),
    ("TPOT p50 ms", lambda m: m["tpot_ms"]["median"], "{:.1f}"),
    ("ITL p50 ms", lambda m: m["itl_ms"]["median"], "{:.1f}"),
    ("ITL p99 ms", lambda m: m["itl_ms"]["p99"], "{:.1f}"),
    ("E2E p50 ms", lambda m: m["e2el_ms"]["median"], "{:.0f}"),
    ("goodput req/s", lambda m: m["goodput"], "{:.2f}"),
    ("cache hit", lambda m: m["prefix_cache_hit_rate"], "{:.0%}"),
    ("failed", lambda m: m["failed"], "{}"),
)


def format_rate(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _fmt(fmt: str, value: object) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt.format(value)


def format_report(metrics: dict, title: str) -> str:
    """The long report of one run."""
    w = 50
    lines = [f"{' ' + title + ' ':=^{w}}"]

    def row(name: str, value: object, fmt: str = "{:.2f}") -> None:
        lines.append(f"{name:<40}{_fmt(fmt, value):>10}")

    row("Successful requests:", metrics["completed"], "{}")
    row("Failed requests:", metrics["failed"], "{}")
    row("Benchmark duration (s):", metrics["duration_s"])
    row("Total input tokens:", metrics["total_input_tokens"], "{}")
    row("Total generated tokens:", metrics["total_output_tokens"], "{}")
    row("Request throughput (req/s):", metrics["request_throughput"])
    if metrics["goodput"] is not None:
        row("Goodput (req/s):", metrics["goodput"])
        lines.append("  SLO: " + ", ".join(f"{k} <= {v:g} ms" for k, v in metrics["slo_ms"].items()))
    row("Output token throughput (tok/s):", metrics["output_throughput"])
    row("Total token throughput (tok/s):", metrics["total_token_throughput"])
    row("Prefix cache hit rate:", metrics["prefix_cache_hit_rate"], "{:.1%}")
    if metrics["short_outputs"]:
        row("Requests short of their output length:", metrics["short_outputs"], "{}")
    for key, short, long in METRIC_TITLES:
        lines.append(f"{long:-^{w}}")
        s = metrics[key]
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p90", "P90"), ("p99", "P99")):
            row(f"{label} {short} (ms):", s[stat])
    for error, count in metrics["errors"].items():
        lines.append(f"error: {error} x {count}")
    lines.append("=" * w)
    return "\n".join(lines)


def markdown_table(rows: list[tuple[dict[str, str], dict]]) -> str:
    """One row per run: ``(leading columns, metrics)``; the leading columns are the same for every row."""
    if not rows:
        return ""
    lead = list(rows[0][0])
    header = lead + [c[0] for c in COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for cells, m in rows:
        values = [cells[k] for k in lead] + [_fmt(fmt, get(m)) for _, get, fmt in COLUMNS]
        lines.append("| " + " | ".join(values) + " |")
    return "\n".join(lines)
