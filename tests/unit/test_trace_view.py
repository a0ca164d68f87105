"""`tandem trace` on the JSONL file the services write: records round-trip, waterfalls render."""

from __future__ import annotations

import argparse
import io

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import set_span_in_context

from common.telemetry import JsonlSpanExporter
from tandem.trace_view import add_args, load_spans, requests, run, select

BREAKDOWN = {"ttft.tokenize_ms": 2.0, "ttft.route_ms": 1.0, "ttft.prefill_queue_ms": 0.5,
             "ttft.prefill_compute_ms": 40.0, "ttft.first_token_ms": 1.5}


def write_request(path, request_id: str, t0: int) -> None:
    """Spans as two services would write them: the gateway's root, a worker's children."""
    gateway = TracerProvider(resource=Resource.create({"service.name": "tandem-gateway"}))
    prefill = TracerProvider(resource=Resource.create({"service.name": "tandem-prefill"}))
    for p in (gateway, prefill):
        p.add_span_processor(SimpleSpanProcessor(JsonlSpanExporter(path)))
    root = gateway.get_tracer("t").start_span("gateway.generate", start_time=t0, attributes={
        "tandem.request_id": request_id, "ttft_ms": 45.0, **BREAKDOWN})
    ctx = set_span_in_context(root)
    for name, start, end in (("prefill.queue", 3, 3.5), ("prefill.compute", 3.5, 43.5)):
        s = prefill.get_tracer("t").start_span(name, context=ctx, start_time=t0 + int(start * 1e6))
        s.end(end_time=t0 + int(end * 1e6))
    root.end(end_time=t0 + int(90e6))


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_args(p)
    return p.parse_args(argv)


def test_records_round_trip_into_one_tree_per_request(tmp_path):
    path = tmp_path / "spans.jsonl"
    write_request(path, "first", 1_000_000_000)
    write_request(path, "second", 2_000_000_000)
    with path.open("a") as f:
        f.write('{"truncated": \n')  # a line cut short by a crash is skipped
    reqs = requests(load_spans([path]))
    assert [r.request_id for r in reqs] == ["first", "second"]
    assert [s.name for s in reqs[0].spans] == ["gateway.generate", "prefill.queue", "prefill.compute"]
    assert [reqs[0].depth(s) for s in reqs[0].spans] == [0, 1, 1]
    assert {s.service for s in reqs[0].spans} == {"tandem-gateway", "tandem-prefill"}
    assert reqs[0].spans[2].duration_ms == 40.0
    assert [r.request_id for r in select(reqs, None, 2)] == ["first", "second"]
    assert [r.request_id for r in select(reqs, None, None)] == ["second"]
    assert [r.request_id for r in select(reqs, "first", None)] == ["first"]


def test_the_waterfall_shows_every_span_and_the_breakdown(tmp_path):
    path = tmp_path / "spans.jsonl"
    write_request(path, "req-7", 5_000_000_000)
    out = io.StringIO()
    assert run(parse(["req-7", "--file", str(path), "--png", str(tmp_path / "w.png")]), out) == 0
    text = out.getvalue()
    assert "request req-7" in text and "prefill.compute" in text
    assert ("TTFT 45.0 ms = tokenize 2.0 + route 1.0 + prefill queue 0.5 + prefill compute 40.0 + "
            "first token 1.5") in text
    assert (tmp_path / "w.png").read_bytes()[:4] == b"\x89PNG"
    assert run(parse(["nobody", "--file", str(path)]), io.StringIO()) == 1
    assert run(parse(["--file", str(tmp_path / "missing.jsonl")]), io.StringIO()) == 1
