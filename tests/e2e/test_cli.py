"""The main job as a user runs it: a real `tandem` process on the default model."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

TANDEM = [sys.executable, "-m", "tandem.cli"]
ROOT = Path(__file__).resolve().parents[2]


def run(*args: str, timeout: int = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*TANDEM, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, **(env or {})})


def test_generate_local_streams_the_answer(default_model):
    proc = run("generate", "--local", "What is the capital of France?", "--max-tokens", "32",
               "--model", str(default_model))
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "finish=" in proc.stderr


def test_generate_local_follows_a_structured_output_flag(default_model, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]}}, "required": ["city"], '
                      '"additionalProperties": false}')
    proc = run("generate", "--local", "Which city is the capital of France?", "--json-schema", str(schema),
               "--temperature", "1", "--seed", "3", "--model", str(default_model))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() in ('{"city":"Paris"}', '{"city":"Lyon"}') and "finish=stop" in proc.stderr
    proc = run("generate", "--local", "hi", "--regex", "a(", "--model", str(default_model))
    assert proc.returncode == 2 and "regex does not compile" in proc.stderr and "unclosed group" in proc.stderr


def test_generate_without_a_gateway_says_what_to_do():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = run("generate", "hello", "--gateway", f"127.0.0.1:{port}", "--timeout", "10")
    assert proc.returncode == 1 and "UNAVAILABLE" in proc.stderr and "tandem up" in proc.stderr


def test_up_generate_is_the_main_job(default_model, tmp_path):
    """`make run`: the whole pipeline as processes, one streamed answer, then nothing left running;
    its trace is in the span file `tandem trace` reads."""
    spans = tmp_path / "spans.jsonl"
    proc = run("up", "--generate", "What is the capital of France?", "--max-tokens", "32", "--model",
               str(default_model), "--num-threads", "1", "--kv-cache-gb", "0.25", "--log-dir", str(tmp_path),
               env={"TANDEM_TRACE_FILE": str(spans)})
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout and "ttft" in proc.stderr
    pids = [int(line.split()[2]) for line in proc.stderr.splitlines() + proc.stdout.splitlines()
            if line.split()[:1] and line.split()[0] in ("kvstore", "tokenizer", "prefill-0", "decode-0", "gateway")
            and len(line.split()) >= 4 and line.split()[2].isdigit()]
    assert len(pids) == 5
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        raise AssertionError(f"process {pid} outlived `tandem up`")
    waterfall = run("trace", "--last", "1", env={"TANDEM_TRACE_FILE": str(spans)})
    assert waterfall.returncode == 0, waterfall.stderr
    for name in ("gateway.generate", "tokenizer.tokenize", "prefill.compute", "kv.pull", "decode.stream", "TTFT"):
        assert name in waterfall.stdout


def test_bad_sampling_flag_is_a_clear_error(default_model):
    proc = run("generate", "--local", "hi", "--top-p", "0", "--model", str(default_model))
    assert proc.returncode == 2 and "top_p must be in (0, 1]" in proc.stderr


def test_fetch_model_is_idempotent(default_model):
    proc = run("fetch-model", timeout=60)  # already converted: returns at once
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()) == default_model
