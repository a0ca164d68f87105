"""The local launcher with real processes: READY lines, KV block sizes, start, stop and failures."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from common.engine_args import engine_flags
from kvstore.server import DEFAULT_BLOCK_BYTES
from protos import common_pb2, gateway_pb2
from tandem.cli import build_parser
from tandem.client import StreamStats, build_request, format_summary
from tandem.launcher import (
    Cluster,
    ClusterConfig,
    LaunchError,
    ServiceSpec,
    kv_block_bytes,
    parse_ready_line,
    read_model_config,
)

ROOT = Path(__file__).resolve().parents[2]
# A stand-in service: announces itself, then idles (optionally deaf to SIGTERM).
SLEEPER = "import signal, time\n{setup}\nprint('SLEEPER READY grpc=127.0.0.1:1', flush=True)\ntime.sleep(60)"


def sleeper(name: str = "sleeper", setup: str = "") -> ServiceSpec:
    return ServiceSpec(name, "sleeper", ["-c", SLEEPER.format(setup=setup)])


def gone(pid: int, timeout: float = 5.0) -> bool:
    """True once ``pid`` no longer runs (absent, or a zombie waiting for init)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


@pytest.fixture
def cluster(tmp_path: Path):
    c = Cluster(ClusterConfig(log_dir=tmp_path, startup_timeout=30))
    yield c
    c.stop(timeout=1)


def test_ready_lines_are_parsed():
    assert parse_ready_line("KVSTORE READY grpc=127.0.0.1:5000 data=127.0.0.1:5001 node=h:5000 slots=12\n") == (
        "KVSTORE", {"grpc": "127.0.0.1:5000", "data": "127.0.0.1:5001", "node": "h:5000", "slots": "12"})
    assert parse_ready_line("GATEWAY READY grpc=[::1]:50051") == ("GATEWAY", {"grpc": "[::1]:50051"})
    assert parse_ready_line("TOKENIZER READY") == ("TOKENIZER", {})
    for line in ("2025-01-01 INFO gateway READY grpc=x", "loading model", "PREFILL READY grpc", "PREFILL READYgrpc=x"):
        assert parse_ready_line(line) is None


def test_block_bytes_follow_the_model_config_and_dtype(default_model: Path, tmp_path: Path):
    config = read_model_config(default_model)
    assert kv_block_bytes(config, "float32") == 30 * 2 * 16 * 3 * 64 * 4 == DEFAULT_BLOCK_BYTES
    assert kv_block_bytes(config, "bfloat16") == DEFAULT_BLOCK_BYTES // 2
    assert kv_block_bytes(config, "float32", block_size=32) == 2 * DEFAULT_BLOCK_BYTES
    bf16 = Cluster(ClusterConfig(engine_args=["--model", str(default_model), "--dtype", "bfloat16"], log_dir=tmp_path))
    assert bf16.block_bytes() == DEFAULT_BLOCK_BYTES // 2
    no_head_dim = {k: v for k, v in config.items() if k != "head_dim"}  # 576 hidden / 9 heads = 64
    assert kv_block_bytes(no_head_dim, "float32") == DEFAULT_BLOCK_BYTES
    with pytest.raises(ValueError, match="unknown dtype"):
        kv_block_bytes(config, "int4")


def test_workers_get_the_engine_flags_threads_and_store(default_model: Path, tmp_path: Path, monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    engine = ["--model", str(default_model), "--max-num-seqs", "4"]
    disagg = Cluster(ClusterConfig(num_prefill=1, num_decode=2, engine_args=engine, log_dir=tmp_path))
    specs = disagg.worker_specs("127.0.0.1:7000")
    assert [s.name for s in specs] == ["prefill-0", "decode-0", "decode-1"]
    for s in specs:
        assert s.argv[:2] == ["-m", f"{s.kind}_svc.server"]
        assert "--max-num-seqs" in s.argv and s.argv[s.argv.index("--kvstore") + 1] == "127.0.0.1:7000"
        assert s.argv[s.argv.index("--num-threads") + 1] == "2"  # 8 CPUs among 3 workers
    agg = Cluster(ClusterConfig(mode="aggregated", num_decode=1, engine_args=[*engine, "--num-threads", "3"],
                                log_dir=tmp_path))
    [decode] = agg.worker_specs(None)
    assert decode.name == "decode-0" and "--kvstore" not in decode.argv
    assert decode.argv.count("--num-threads") == 1 and "3" in decode.argv


def test_up_passes_only_the_engine_flags_the_user_set():
    args = build_parser().parse_args(["up", "--dtype", "bfloat16", "--no-enable-prefix-caching", "--max-num-seqs", "8"])
    flags = engine_flags(args)
    assert flags == ["--dtype", "bfloat16", "--max-num-seqs", "8", "--no-enable-prefix-caching"]
    assert engine_flags(build_parser().parse_args(["up"])) == []


def test_config_rejects_impossible_clusters():
    with pytest.raises(ValueError, match="mode"):
        ClusterConfig(mode="both")
    with pytest.raises(ValueError, match="prefill"):
        ClusterConfig(num_prefill=0)
    ClusterConfig(mode="aggregated", num_prefill=0)  # aggregated mode starts no prefill worker


def test_kvstore_starts_healthy_and_stops(default_model: Path, tmp_path: Path):
    c = Cluster(ClusterConfig(engine_args=["--model", str(default_model)], kv_capacity_gb=0.01, log_dir=tmp_path,
                              startup_timeout=60))
    try:
        [store] = c.launch([c.kvstore_spec()])
        assert c.kvstore is store and c.services == [store]
        assert store.ready_name == "KVSTORE" and store.address.startswith("127.0.0.1:")
        assert int(store.ready["slots"]) == int(0.01 * 2**30) // DEFAULT_BLOCK_BYTES
        c.wait_healthy(timeout=10)
        assert "KVSTORE READY" in (tmp_path / "kvstore.log").read_text()
    finally:
        c.stop()
    assert store.returncode == 0  # a graceful stop on SIGTERM
    assert gone(store.pid, timeout=0)


def test_a_child_that_dies_before_ready_fails_with_its_log_tail(cluster: Cluster):
    crash = ServiceSpec("prefill-0", "prefill",
                        ["-c", "import sys\nprint('loading weights')\nprint('boom: no such model', file=sys.stderr)\n"
                               "sys.exit(3)"])
    [first] = cluster.launch([sleeper("first")])
    with pytest.raises(LaunchError) as err:
        cluster.launch([sleeper("second"), crash])
    message = str(err.value)
    assert "prefill-0 exited with code 3 before it was ready" in message
    assert "loading weights" in message and "boom: no such model" in message
    assert "prefill-0.log" in message
    assert all(gone(svc.pid, timeout=0) for svc in cluster.services)  # everything started was stopped
    assert gone(first.pid, timeout=0)


def test_a_child_without_ready_line_times_out(cluster: Cluster):
    silent = ServiceSpec("tokenizer", "tokenizer", ["-c", "import time\nprint('still loading')\ntime.sleep(60)"])
    with pytest.raises(LaunchError, match=r"(?s)no READY line within 1 s.*still loading"):
        cluster.launch([silent], timeout=1)
    assert all(gone(svc.pid, timeout=0) for svc in cluster.services)


def test_stop_kills_a_child_that_ignores_sigterm(cluster: Cluster):
    [polite] = cluster.launch([sleeper("polite")])
    [deaf] = cluster.launch([sleeper("deaf", "signal.signal(signal.SIGTERM, signal.SIG_IGN)")])
    start = time.monotonic()
    cluster.stop(timeout=0.5)
    assert time.monotonic() - start < 5
    assert deaf.returncode == -signal.SIGKILL and polite.returncode == -signal.SIGTERM
    assert gone(deaf.pid, timeout=0) and gone(polite.pid, timeout=0)


@pytest.mark.parametrize("how", ["killed", "exits"])
def test_children_do_not_outlive_the_launcher(tmp_path: Path, how: str):
    script = textwrap.dedent(f"""
        import sys
        from tandem.launcher import Cluster, ClusterConfig, ServiceSpec
        c = Cluster(ClusterConfig(log_dir=sys.argv[1]))
        [s] = c.launch([ServiceSpec("sleeper", "sleeper", ["-c", {SLEEPER.format(setup="")!r}])])
        print(s.pid, flush=True)
        if {how == "killed"}:
            sys.stdin.read()
    """)
    launcher = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], cwd=ROOT, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
    child = int(launcher.stdout.readline())
    if how == "killed":
        launcher.kill()  # SIGKILL: no atexit, only PR_SET_PDEATHSIG can help
    launcher.wait(10)
    assert gone(child, timeout=5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_generate_without_a_gateway_is_a_clear_error():
    proc = subprocess.run([sys.executable, "-m", "tandem.cli", "generate", "hi", "--gateway",
                           f"127.0.0.1:{free_port()}", "--timeout", "10"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.startswith("tandem generate: UNAVAILABLE: "), proc.stderr
    assert "tandem up" in proc.stderr and proc.stdout == ""


def test_requests_carry_chat_or_raw_prompts_and_sampling():
    chat = build_request("hi", max_tokens=8, temperature=0.0, top_p=0.9, top_k=-1, seed=7, stop=["\n\n"])
    assert chat.WhichOneof("input") == "chat"
    assert [(m.role, m.content) for m in chat.chat.messages] == [("user", "hi")]
    assert chat.sampling.max_tokens == 8 and chat.sampling.HasField("temperature") and chat.sampling.seed == 7
    assert chat.sampling.top_k == -1 and list(chat.stop) == ["\n\n"]
    raw = build_request("Once upon", raw=True)
    assert raw.prompt == "Once upon" and not raw.sampling.HasField("seed")


def test_summary_reports_tokens_finish_and_ttft_breakdown():
    last = gateway_pb2.GenerateResponse(
        finish_reason=common_pb2.FINISH_REASON_LENGTH,
        usage=common_pb2.Usage(prompt_tokens=20, completion_tokens=11, cached_tokens=16),
        timings=common_pb2.Timings(ttft_ms=100, tokenize_ms=2, route_ms=1, prefill_compute_ms=80, kv_push_ms=5,
                                   first_token_ms=12, kv_pull_ms=3, e2e_ms=600),
    )
    line = format_summary(last, StreamStats(start=0.0))
    assert line.startswith("[11 tokens, finish=length, ttft 100 ms (tokenize 2, route 1, prefill 80, kv push 5, ")
    assert "kv pull 3 ms" in line and "20.0 tok/s decode" in line and "16 cached" in line
