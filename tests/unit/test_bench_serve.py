"""``tandem bench serve``'s own arithmetic on recorded timelines (percentiles, TTFT / TPOT / ITL,
throughput, goodput, cache hit rate), its arrival process and workloads, the OpenAI backend
against a real (stdlib) SSE server, the plots, and the launcher's CPU pinning."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from tandem.bench import plots
from tandem.bench.backends import OpenAIBackend
from tandem.bench.compare import affinity_plan, parse_modes, write_outputs
from tandem.bench.datasets import BenchRequest, add_dataset_args, build_dataset, check_dataset_args
from tandem.bench.metrics import RequestRecord, compute_metrics, meets_slo, parse_slo, percentile
from tandem.bench.report import format_report, markdown_table
from tandem.bench.serve import Load, RunResult, add_args, arrival_offsets, parse_rates, run_load
from tandem.bench.timeline import TimelineSample
from tandem.cli import build_parser
from tandem.launcher import Cluster, ClusterConfig


def record(send: float, stamps: list[float], prompt: int = 100, cached: int = 0, error: str = "") -> RequestRecord:
    r = RequestRecord(send=send, prompt_len=prompt, expected_output=len(stamps), token_times=list(stamps),
                      prompt_tokens=prompt if not error else 0, cached_tokens=cached, error=error)
    r.end = stamps[-1] if stamps else send
    return r


# -- percentiles and one request's latencies ----------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1001])
def test_percentiles_match_numpy(n):
    values = [random.Random(n).expovariate(1.0) for _ in range(n)]
    for p in (0, 25, 50, 90, 99, 100):
        assert percentile(values, p) == pytest.approx(float(np.percentile(values, p)))
    assert math.isnan(percentile([], 50))


def test_ttft_tpot_itl_and_e2e_of_one_recorded_request():
    # Sent at 10.0; the first token at 10.2; two tokens in one message at 10.3; the last at 10.5.
    r = record(10.0, [10.2, 10.3, 10.3, 10.5])
    assert r.ttft == pytest.approx(0.2)
    assert r.e2e == pytest.approx(0.5)
    assert r.tpot == pytest.approx(0.1)  # (0.5 - 0.2) / (4 - 1)
    assert r.itls == pytest.approx([0.1, 0.0, 0.2])
    assert record(0.0, [0.3]).tpot is None  # one token: no decode to time
    assert not record(0.0, [], error="UNAVAILABLE").ok


# -- a whole run's figures -----------------------------------------------------------------------


def recorded_run() -> list[RequestRecord]:
    """Four requests over 4 s, 3 tokens each, one failed: TTFTs 0.1, 0.2, 0.3, 0.8 s."""
    return [
        record(0.0, [0.1, 0.2, 0.3], prompt=100, cached=0),      # tpot 100 ms, itl 100/100
        record(1.0, [1.2, 1.3, 1.4], prompt=100, cached=64),     # tpot 100 ms
        record(2.0, [2.3, 2.35, 2.4], prompt=100, cached=96),    # tpot 50 ms, itl 50/50
        record(3.0, [3.8, 3.9, 4.0], prompt=100, cached=0),      # ttft 800 ms
        record(3.5, [], error="RESOURCE_EXHAUSTED"),
    ]


def test_throughput_goodput_and_cache_hit_rate_of_a_recorded_run():
    m = compute_metrics(recorded_run(), duration=4.0, slo=parse_slo("ttft=250ms,tpot=100ms"))
    assert (m["completed"], m["failed"]) == (4, 1)
    assert m["errors"] == {"RESOURCE_EXHAUSTED": 1}
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["total_output_tokens"] == 12 and m["output_throughput"] == pytest.approx(3.0)
    assert m["total_token_throughput"] == pytest.approx((400 + 12) / 4)
    assert m["good_requests"] == 2 and m["goodput"] == pytest.approx(0.5)  # the first two only
    assert m["prefix_cache_hit_rate"] == pytest.approx(160 / 400)
    assert m["ttft_ms"]["mean"] == pytest.approx(350)
    assert m["ttft_ms"]["median"] == pytest.approx(250)
    assert m["ttft_ms"]["p90"] == pytest.approx(float(np.percentile([100, 200, 300, 800], 90)))
    assert m["tpot_ms"]["median"] == pytest.approx(100)
    assert m["itl_ms"]["p99"] == pytest.approx(100)
    assert m["itl_ms"]["median"] == pytest.approx(100)
    assert m["e2el_ms"]["median"] == pytest.approx(float(np.median([300, 400, 400, 1000])))
    assert m["short_outputs"] == 0
    assert compute_metrics(recorded_run(), 4.0)["goodput"] is None  # no SLO, no goodput


def test_slos_parse_units_and_judge_each_bound():
    assert parse_slo("ttft=500ms, tpot=0.1s,e2e=2") == {"ttft": 500.0, "tpot": 100.0, "e2el": 2.0}
    for bad in ("ttft", "speed=1ms", "ttft=fast", "ttft=-3ms"):
        with pytest.raises(ValueError):
            parse_slo(bad)
    r = record(0.0, [0.1, 0.2, 0.5])  # ttft 100, tpot 200, worst gap 300, e2e 500
    assert meets_slo(r, {"ttft": 100, "tpot": 200, "itl": 300, "e2el": 500})
    assert not meets_slo(r, {"itl": 299})
    assert not meets_slo(r, {"tpot": 199})
    assert not meets_slo(record(0.0, [], error="CANCELLED"), {})


def test_reports_show_the_figures():
    m = compute_metrics(recorded_run(), 4.0, parse_slo("ttft=250ms"))
    text = format_report(m, "rate 1")
    assert "Successful requests:" in text and "RESOURCE_EXHAUSTED x 1" in text and "P99 ITL (ms):" in text
    table = markdown_table([({"rate": "1"}, m)])
    header, rule, row = table.splitlines()
    assert header.startswith("| rate | req/s |") and row.startswith("| 1 | 1.00 | 3.0 | 250 |")
    assert "| 40% | 1 |" in row


# -- arrivals and workloads ----------------------------------------------------------------------


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_arrival_gaps_have_the_rate_and_the_burstiness_asked_for(burstiness):
    offsets = arrival_offsets(20000, 5.0, burstiness, random.Random(1))
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0
    assert gaps.mean() == pytest.approx(1 / 5.0, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.1)
    assert arrival_offsets(50, 5.0, burstiness, random.Random(7)) == arrival_offsets(50, 5.0, burstiness,
                                                                                     random.Random(7))
    assert arrival_offsets(3, math.inf, burstiness, random.Random(1)) == [0.0, 0.0, 0.0]


def test_rates_parse():
    assert parse_rates("1, 2.5,inf") == [1.0, 2.5, math.inf]
    for bad in ("0", "-1", ""):
        with pytest.raises(ValueError):
            parse_rates(bad)


def workload(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_dataset_args(p)
    args = p.parse_args(list(argv))
    check_dataset_args(args)
    return args


def test_random_workload_has_the_lengths_asked_for_and_is_seeded():
    exact = build_dataset(workload("--input-len", "50", "--output-len", "7"), 20, 1000, seed=3)
    assert {(r.prompt_len, r.output_len) for r in exact} == {(50, 7)}
    assert all(100 <= t < 900 for r in exact for t in r.prompt_ids)
    assert build_dataset(workload("--input-len", "50"), 20, 1000, seed=3)[0].prompt_ids == exact[0].prompt_ids
    ranged = build_dataset(workload("--input-len", "100", "--range-ratio", "0.5"), 400, 1000, seed=3)
    lengths = [r.prompt_len for r in ranged]
    assert min(lengths) >= 50 and max(lengths) <= 150 and max(lengths) - min(lengths) > 80
    with pytest.raises(ValueError, match="--range-ratio"):
        workload("--range-ratio", "1.5")


def test_shared_prefix_workload_shares_each_system_prompt_evenly():
    args = workload("--dataset", "shared-prefix", "--num-prefixes", "3", "--prefix-len", "32", "--question-len", "8",
                    "--output-len", "5")
    requests = build_dataset(args, 12, 1000, seed=0)
    prefixes = [tuple(r.prompt_ids[:32]) for r in requests]
    assert len(set(prefixes)) == 3 and all(prefixes.count(p) == 4 for p in set(prefixes))
    assert len({tuple(r.prompt_ids[32:]) for r in requests}) == 12  # every question its own
    assert {(r.prompt_len, r.output_len) for r in requests} == {(40, 5)}


def test_conversation_workload_has_a_long_clipped_tail():
    args = workload("--dataset", "conversation", "--input-len", "200", "--output-len", "100", "--sigma", "1.0",
                    "--max-input-len", "3000", "--max-output-len", "800")
    requests = build_dataset(args, 2000, 1000, seed=0)
    inputs = [r.prompt_len for r in requests]
    outputs = [r.output_len for r in requests]
    assert statistics.median(inputs) == pytest.approx(200, rel=0.1)
    assert statistics.median(outputs) == pytest.approx(100, rel=0.1)
    assert percentile(inputs, 99) > 5 * statistics.median(inputs)  # the long tail
    assert max(inputs) <= 3000 and max(outputs) == 800 and min(outputs) >= 1


# -- the OpenAI backend against a real HTTP server ----------------------------------------------


class FakeCompletions(BaseHTTPRequestHandler):
    """An OpenAI-style streaming completions server: one chunk per token, chunked transfer encoding,
    ``max_tokens`` tokens 20 ms apart, usage in a last chunk; counts the requests in flight."""

    protocol_version = "HTTP/1.1"
    lock = threading.Lock()
    inflight = 0
    peak = 0
    bodies: list[dict] = []

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeCompletions.bodies.append(body)
        if body.get("prompt") == "fail":
            self.send_response(400)
            payload = b'{"error": "bad prompt"}'
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        with self.lock:
            FakeCompletions.inflight += 1
            FakeCompletions.peak = max(FakeCompletions.peak, FakeCompletions.inflight)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        events = [{"choices": [{"text": f"t{i} "}]} for i in range(body["max_tokens"])]
        events += [{"choices": [{"text": "", "finish_reason": "length"}]},
                   {"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": body["max_tokens"]}}]
        for event in map(json.dumps, events):
            self.write_chunk(f"data: {event}\n\n".encode())
            threading.Event().wait(0.02)
        with self.lock:  # before [DONE]: the client may be gone right after it
            FakeCompletions.inflight -= 1
        self.write_chunk(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")

    def write_chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


@pytest.fixture
def completions_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeCompletions)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    FakeCompletions.peak, FakeCompletions.bodies = 0, []
    yield f"http://127.0.0.1:{server.server_address[1]}/v1/completions"
    server.shutdown()
    server.server_close()


def test_openai_backend_streams_tokens_usage_and_errors(completions_url):
    backend = OpenAIBackend(completions_url, model="m", extra_body={"repeat_penalty": 1.0})
    good, bad = BenchRequest([1] * 11, 5, "hello"), BenchRequest([1], 5, "fail")
    records = [RequestRecord(0.0, 11, 5), RequestRecord(0.0, 1, 5)]
    asyncio.run(backend.send(good, records[0]))
    asyncio.run(backend.send(bad, records[1]))
    r, failed = records
    assert r.ok and r.output_tokens == 5 and r.prompt_tokens == 11
    assert all(g > 0.01 for g in r.itls)  # stamped as each chunk arrived, not at the end
    body = FakeCompletions.bodies[0]
    assert (body["prompt"], body["max_tokens"], body["min_tokens"], body["ignore_eos"], body["stream"],
            body["repeat_penalty"], body["model"]) == ("hello", 5, 5, True, True, 1.0, "m")
    assert not failed.ok and failed.error.startswith("HTTP 400") and "bad prompt" in failed.error
    with pytest.raises(ValueError, match="--url"):
        OpenAIBackend("localhost:8000")
    with pytest.raises(ValueError, match="chat completions take text"):
        OpenAIBackend("http://h:1/v1/chat/completions", prompt_format="ids")
    assert "model" not in OpenAIBackend(completions_url).body(good)
    chat = OpenAIBackend("http://h:1/v1/chat/completions").body(good)
    assert chat["messages"] == [{"role": "user", "content": "hello"}] and "prompt" not in chat


def test_max_concurrency_caps_the_requests_in_flight(completions_url):
    requests = [BenchRequest([1] * 4, 3, f"p{i}") for i in range(8)]
    result = asyncio.run(run_load(OpenAIBackend(completions_url), requests, Load(math.inf, max_concurrency=2)))
    assert result.metrics["completed"] == 8 and FakeCompletions.peak == 2
    assert max(s.client_inflight for s in result.timeline) <= 2
    assert result.metrics["total_output_tokens"] == 24


# -- plots ---------------------------------------------------------------------------------------


def test_plots_are_written_from_recorded_runs(tmp_path: Path):
    timeline = [TimelineSample(t / 2, t % 3, {"prefill a:1": (1, t % 2), "decode b:2": (t, 0)}) for t in range(6)]
    results = [RunResult(Load(rate), recorded_run(), 0.0, 4.0, timeline,
                         compute_metrics(recorded_run(), 4.0, parse_slo("ttft=250ms"))) for rate in (1.0, math.inf)]
    paths = plots.plot_serve(results, tmp_path, "run")
    paths.append(plots.plot_compare({"aggregated": results, "disaggregated": results[:1]}, tmp_path / "cmp.png"))
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.dumps(results[1].to_json(), allow_nan=True)  # the result file's content serializes


def test_compare_writes_one_table_one_json_and_one_plot(tmp_path: Path):
    args = build_parser().parse_args(["bench", "compare", "--request-rate", "1,2", "--slo", "ttft=250ms",
                                      "--output-dir", str(tmp_path), "--label", "t"])
    results = [RunResult(Load(rate), recorded_run(), 0.0, 4.0, [], compute_metrics(recorded_run(), 4.0, args.slo))
               for rate in args.request_rate]
    table = markdown_table([({"topology": "aggregated", "rate": "1"}, results[0].metrics)])
    paths = write_outputs(args, {"aggregated": results, "disaggregated": results}, table)
    assert [p.suffix for p in paths] == [".md", ".json", ".png"]
    md = paths[0].read_text()
    assert md.startswith("random workload: 1024-token prompts, 128 tokens out; 100 requests per rate, Poisson")
    assert "ttft <= 250 ms" in md and table in md
    doc = json.loads(paths[1].read_text())
    assert doc["table"]["disaggregated"]["2"]["goodput"] == pytest.approx(0.5)
    assert len(doc["details"]["aggregated"]["runs"][0]["requests"]) == 5


def test_serve_flags_parse():
    p = argparse.ArgumentParser()
    add_args(p)
    args = p.parse_args(["--request-rate", "1,inf", "--slo", "ttft=1s", "--max-concurrency", "4"])
    assert args.request_rate == [1.0, math.inf] and args.slo == {"ttft": 1000.0} and args.max_concurrency == 4


# -- pinning the workers to cores (bench compare) ------------------------------------------------


def test_affinity_plans_split_the_cores_between_prefill_and_decode():
    assert affinity_plan("disaggregated", [0, 1]) == {"prefill": [0], "decode": [1]}
    assert affinity_plan("aggregated", [0, 1]) == {"decode": [0, 1]}
    assert affinity_plan("disaggregated", [0, 1, 2, 3]) == {"prefill": [0, 1], "decode": [2, 3]}
    assert affinity_plan("aggregated", [0]) == {}
    assert parse_modes("disaggregated, aggregated") == ["disaggregated", "aggregated"]
    with pytest.raises(ValueError):
        parse_modes("split")


def test_pinned_workers_get_one_thread_per_core(default_model: Path, tmp_path: Path):
    cpus = sorted(__import__("os").sched_getaffinity(0))
    pinned = Cluster(ClusterConfig(engine_args=["--model", str(default_model)], log_dir=tmp_path,
                                   cpu_affinity={"prefill": cpus[:1], "decode": cpus}))
    assert pinned.worker_engine_args("prefill")[-2:] == ["--num-threads", "1"]
    assert pinned.worker_engine_args("decode")[-2:] == ["--num-threads", str(len(cpus))]
    explicit = Cluster(ClusterConfig(engine_args=["--model", str(default_model), "--num-threads", "3"],
                                     log_dir=tmp_path, cpu_affinity={"decode": cpus[:1]}))
    assert "--num-threads" not in explicit.worker_engine_args("decode")[-2:]  # the user's flag stands
    for bad in ({"router": cpus}, {"decode": []}, {"decode": [max(cpus) + 1000]}):
        with pytest.raises(ValueError, match="cpu_affinity"):
            ClusterConfig(cpu_affinity=bad)
