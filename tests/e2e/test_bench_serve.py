"""``tandem bench serve`` against a real ``tandem up`` cluster (pinned to cores as ``bench compare``
pins it): a few seconds of load, the report's figures, the workers' timeline, the result file and
the plots."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tandem.bench.compare import affinity_plan
from tandem.cli import main
from tandem.launcher import Cluster, ClusterConfig

WORKER_ARGS = ["--num-threads", "1", "--kv-cache-gb", "0.25"]


@pytest.fixture(scope="module")
def cluster(default_model: Path, tmp_path_factory: pytest.TempPathFactory):
    cpus = sorted(os.sched_getaffinity(0))
    config = ClusterConfig(gateway_port=0, engine_args=["--model", str(default_model), *WORKER_ARGS],
                           kv_capacity_gb=0.25, log_dir=tmp_path_factory.mktemp("logs"), startup_timeout=240,
                           cpu_affinity=affinity_plan("disaggregated", cpus))
    c = Cluster(config).start()
    try:
        c.wait_healthy(60)
        yield c
    finally:
        c.stop()


def bench(tmp_path: Path, gateway: str, *flags: str) -> dict:
    argv = ["bench", "serve", "--gateway", gateway, "--output-dir", str(tmp_path), "--num-warmups", "1",
            "--label", "e2e", *flags]
    assert main(argv) == 0
    (result,) = tmp_path.glob("serve-e2e-*.json")
    return json.loads(result.read_text())


def test_the_workers_run_on_their_own_cores(cluster):
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("one core: nothing to split")
    plan = affinity_plan("disaggregated", cpus)
    assert os.sched_getaffinity(cluster.prefill[0].pid) == set(plan["prefill"])
    assert os.sched_getaffinity(cluster.decode[0].pid) == set(plan["decode"])


def test_a_short_run_reports_latencies_throughput_goodput_and_a_timeline(cluster, tmp_path: Path):
    doc = bench(tmp_path, cluster.gateway.address, "--num-prompts", "10", "--input-len", "48", "--output-len", "8",
                "--request-rate", "4", "--slo", "ttft=60s,tpot=10s", "--stats-interval", "0.2")
    (run,) = doc["runs"]
    m = run["metrics"]
    assert (m["completed"], m["failed"], m["short_outputs"]) == (10, 0, 0)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (480, 80)
    assert m["good_requests"] == 10 and m["goodput"] == pytest.approx(m["request_throughput"])
    assert 0 < m["ttft_ms"]["median"] <= m["ttft_ms"]["p99"] <= m["e2el_ms"]["p99"]
    assert 0 < m["itl_ms"]["median"] and 0 < m["tpot_ms"]["mean"]
    assert m["output_throughput"] == pytest.approx(80 / m["duration_s"])
    requests = run["requests"]
    assert len(requests) == 10 and all(len(r["token_times"]) == 8 for r in requests)
    sends = sorted(r["send"] for r in requests)
    assert sends[-1] > 0.5  # spread out at 4 req/s, not sent at once
    workers = {name.split()[0] for s in run["timeline"] for name in s["workers"]}
    assert workers == {"prefill", "decode"}
    assert max(s["client_inflight"] for s in run["timeline"]) >= 1
    for kind in ("cdf", "throughput", "timeline"):
        assert next(tmp_path.glob(f"serve-e2e-*-{kind}.png")).stat().st_size > 0


def test_a_shared_prefix_workload_hits_the_prefix_cache(cluster, tmp_path: Path):
    doc = bench(tmp_path, cluster.gateway.address, "--dataset", "shared-prefix", "--num-prompts", "6",
                "--num-prefixes", "1", "--prefix-len", "64", "--question-len", "16", "--output-len", "4",
                "--max-concurrency", "1", "--request-rate", "inf", "--no-plots", "--no-progress")
    m = doc["runs"][0]["metrics"]
    assert m["completed"] == 6
    # The first request computes the 64-token system prompt; the other five find its 4 blocks cached.
    assert m["prefix_cache_hit_rate"] == pytest.approx(5 * 64 / (6 * 80))


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_bench_serve_speaks_openai_to_the_gateways_http_front(cluster, tmp_path: Path, path: str):
    argv = ["bench", "serve", "--backend", "openai", "--url", f"{cluster.http_url}/{path}", "--output-dir",
            str(tmp_path), "--num-warmups", "1", "--label", "e2e", "--num-prompts", "4", "--input-len", "32",
            "--output-len", "6", "--max-concurrency", "2", "--no-plots", "--no-progress"]
    assert main(argv) == 0
    (result,) = tmp_path.glob("serve-e2e-*.json")
    m = json.loads(result.read_text())["runs"][0]["metrics"]
    assert (m["completed"], m["failed"], m["total_output_tokens"]) == (4, 0, 24)
    assert m["total_input_tokens"] >= 4 * 32  # as the server counted them: the chat template adds its own
    assert 0 < m["ttft_ms"]["median"] and 0 < m["itl_ms"]["median"]
