"""``tandem trace``: a request's time to first token, hop by hop, from the spans of its trace.

Reads the JSONL span file the services write under ``tandem up`` (or any file of
records in the same shape), groups spans by trace, and prints one waterfall per
request: every span as a bar on the request's timeline, then the TTFT breakdown
the gateway put on the root span. ``--png`` draws the same waterfall.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, TextIO

from common.telemetry import TRACE_FILE_ENV, default_trace_file

ROOT_SPAN = "gateway.generate"
SERVICE_COLORS = {"gateway": "tab:green", "tokenizer": "tab:pink", "prefill": "tab:orange", "kvstore": "tab:olive",
                  "decode": "tab:blue"}
BREAKDOWN = (("tokenize", "ttft.tokenize_ms"), ("route", "ttft.route_ms"),
             ("prefill queue", "ttft.prefill_queue_ms"), ("prefill compute", "ttft.prefill_compute_ms"),
             ("first token", "ttft.first_token_ms"))


@dataclass
class SpanRecord:
    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    service: str
    start_ns: int
    end_ns: int
    status: str = "UNSET"
    status_message: str = ""
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


@dataclass
class RequestTrace:
    root: SpanRecord
    spans: list[SpanRecord]  # depth-first, children in start order

    @property
    def request_id(self) -> str:
        return str(self.root.attributes.get("tandem.request_id", ""))

    @cached_property
    def _by_id(self) -> dict[str, SpanRecord]:
        return {s.span_id: s for s in self.spans}

    def depth(self, span: SpanRecord) -> int:
        d, s = 0, span
        while s.parent_span_id in self._by_id:
            d, s = d + 1, self._by_id[s.parent_span_id]
        return d


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("request_id", nargs="?", help="the request to show (default: the latest)")
    p.add_argument("--last", type=int, default=None, metavar="N", help="show the last N requests")
    p.add_argument("--file", type=Path, action="append", default=None,
                   help=f"span file(s) to read (default: {default_trace_file()}, env {TRACE_FILE_ENV})")
    p.add_argument("--png", type=Path, default=None, help="also draw the waterfall(s) into this PNG file")


def load_spans(paths: list[Path]) -> list[SpanRecord]:
    spans = []
    for path in paths:
        for line in path.read_text().splitlines():
            line = line.strip()
            if not line:
                continue
            try:
                spans.append(SpanRecord(**json.loads(line)))
            except (json.JSONDecodeError, TypeError):
                continue  # a line cut short by a crash: skip it
    return spans


def requests(spans: list[SpanRecord]) -> list[RequestTrace]:
    """One entry per root span, oldest first; a trace's other spans in tree order."""
    by_trace: dict[str, list[SpanRecord]] = defaultdict(list)
    for s in spans:
        by_trace[s.trace_id].append(s)
    out = []
    for members in by_trace.values():
        for root in (s for s in members if s.name == ROOT_SPAN):
            out.append(RequestTrace(root, _tree(root, members)))
    return sorted(out, key=lambda r: r.root.start_ns)


def _tree(root: SpanRecord, members: list[SpanRecord]) -> list[SpanRecord]:
    children: dict[str, list[SpanRecord]] = defaultdict(list)
    for s in members:
        children[s.parent_span_id].append(s)
    ordered, stack = [], [root]
    while stack:
        s = stack.pop()
        ordered.append(s)
        stack.extend(sorted(children.get(s.span_id, []), key=lambda c: c.start_ns, reverse=True))
    return ordered


def render(req: RequestTrace, width: int) -> str:
    """The waterfall of one request as text."""
    t0, total = req.root.start_ns, max(req.root.duration_ms, 1e-3)
    name_w = max(len("  " * req.depth(s) + s.name) for s in req.spans) + 2
    bar_w = max(20, width - name_w - 42)
    a = req.root.attributes
    lines = [f"request {req.request_id or req.root.trace_id}  trace {req.root.trace_id}  "
             f"status {req.root.status}{(': ' + req.root.status_message) if req.root.status_message else ''}"]
    for s in req.spans:
        start = (s.start_ns - t0) / 1e6
        lines.append(f"{('  ' * req.depth(s) + s.name):<{name_w}}{s.service:<18}{start:>9.1f} {s.duration_ms:>9.1f} ms "
                     f"{_bar(start, s.duration_ms, total, bar_w)}")
    if "ttft_ms" in a:
        parts = " + ".join(f"{label} {a.get(key, 0.0):.1f}" for label, key in BREAKDOWN)
        lines.append(f"TTFT {a['ttft_ms']:.1f} ms = {parts}")
        lines.append(f"     {_stacked([a.get(k, 0.0) for _, k in BREAKDOWN], bar_w)}")
        lines.append(f"KV push {a.get('kv_push_ms', 0.0):.1f} ms (after the first token), pull "
                     f"{a.get('kv_pull_ms', 0.0):.1f} ms; e2e {a.get('e2e_ms', req.root.duration_ms):.1f} ms")
    return "\n".join(lines)


def _bar(start: float, length: float, total: float, width: int) -> str:
    lo = int(start / total * width)
    n = max(1, round(length / total * width))
    return "|" + " " * min(lo, width - 1) + "█" * min(n, width - min(lo, width - 1)) + "|"


def _stacked(parts: list[float], width: int) -> str:
    """The breakdown as one bar, a letter per part (t r q c f)."""
    total = sum(parts) or 1.0
    return "".join(ch * max(0, round(p / total * width)) for ch, p in zip("trqcf", parts, strict=True)) + \
        "   (t tokenize, r route, q prefill queue, c prefill compute, f first token)"


def draw_png(reqs: list[RequestTrace], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sum(len(r.spans) for r in reqs)
    fig, axes = plt.subplots(len(reqs), 1, figsize=(11, 1.2 + 0.32 * rows), squeeze=False)
    for ax, req in zip(axes[:, 0], reqs, strict=True):
        t0 = req.root.start_ns
        labels = []
        for i, s in enumerate(req.spans):
            color = SERVICE_COLORS.get(s.service.removeprefix("tandem-"), "tab:gray")
            ax.barh(i, s.duration_ms, left=(s.start_ns - t0) / 1e6, color=color, height=0.6,
                    edgecolor="red" if s.status == "ERROR" else color, hatch="//" if s.status == "ERROR" else None)
            labels.append(f"{'  ' * req.depth(s)}{s.name} ({s.service.removeprefix('tandem-')})")
        ttft = req.root.attributes.get("ttft_ms")
        if ttft:
            ax.axvline(ttft, color="black", linestyle="--", linewidth=1)
            ax.text(ttft, -0.8, f" TTFT {ttft:.0f} ms", fontsize=8)
        ax.set_yticks(range(len(labels)), labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("ms since the gateway received the request")
        ax.set_title(f"request {req.request_id or req.root.trace_id}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def select(reqs: list[RequestTrace], request_id: str | None, last: int | None) -> list[RequestTrace]:
    if request_id:
        return [r for r in reqs if request_id in (r.request_id, r.root.trace_id)]
    return reqs[-(last or 1):]


def run(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    paths = args.file or [Path(os.environ.get(TRACE_FILE_ENV) or default_trace_file())]
    missing = [p for p in paths if not p.is_file()]
    if missing:
        print(f"tandem trace: no span file at {missing[0]} (run `tandem up`, or set OTEL_* to export elsewhere)",
              file=sys.stderr)
        return 1
    chosen = select(requests(load_spans(paths)), args.request_id, args.last)
    if not chosen:
        what = f"request {args.request_id!r}" if args.request_id else "any request"
        print(f"tandem trace: no trace of {what} in {', '.join(map(str, paths))}", file=sys.stderr)
        return 1
    width = shutil.get_terminal_size((120, 20)).columns
    print("\n\n".join(render(r, width) for r in chosen), file=out)
    if args.png:
        draw_png(chosen, args.png)
        print(f"wrote {args.png}", file=out)
    return 0
