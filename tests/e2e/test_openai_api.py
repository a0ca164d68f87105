"""The OpenAI-compatible HTTP API of a real disaggregated ``tandem up``, through the official ``openai`` client
(pinned in the test extra) and, where the client hides the wire (disconnects, keep-alives), raw sockets.

The referee for content is the gateway's own gRPC API: greedy text over HTTP equals greedy text over
``Generate`` for the same request. API keys (401, 429 with Retry-After) are tested on the keys cluster of
``test_auth.py``."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import openai
import pytest
from uv import find_uv_bin

from common.paths import tandem_home
from protos import gateway_pb2 as gpb
from tandem.launcher import Cluster
from tests.e2e.pipeline import (
    chat_request,
    gateway_stats,
    generate,
    start_cluster,
    wait_clean,
    wait_until,
    worker_stats,
)

PROMPT = "The three most important things to know about the history of Rome are"
QUESTION = "What is the capital of France?"
KEEPALIVE_S = 1.0
MAX_BODY = 2**20
LONG_PROMPT = list(range(1000, 6000))  # 5,000 tokens: a prefill of seconds on one core


@pytest.fixture(scope="module")
def cluster(default_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = start_cluster(default_model, tmp_path_factory.mktemp("openai"), gateway_args=[
        "--http-keepalive-s", str(KEEPALIVE_S), "--max-request-bytes", str(MAX_BODY)])
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.http_url, api_key="unused", max_retries=0, timeout=120)


def grpc_text(cluster: Cluster, request: gpb.GenerateRequest) -> str:
    reply = generate(cluster.gateway.address, request)
    assert reply.code.name == "OK", reply.details
    return reply.text


# -- content -------------------------------------------------------------------------------------------


def test_models_lists_the_served_model(client, cluster):
    (model,) = client.models.list().data
    assert model.id == "SmolLM2-135M-Instruct" and model.owned_by == "tandem"


def test_greedy_completion_equals_the_grpc_api_streamed_or_not(client, cluster):
    expected = grpc_text(cluster, gpb.GenerateRequest(prompt=PROMPT, add_special_tokens=True, sampling={
        "max_tokens": 24, "temperature": 0}))
    whole = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=24, temperature=0)
    assert whole.choices[0].text == expected
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 24 and whole.usage.prompt_tokens > 0
    assert whole.id.startswith("cmpl-") and whole.system_fingerprint.startswith("fp_")
    chunks = list(client.completions.create(prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
                                            model="SmolLM2-135M-Instruct"))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert all(c.usage is None for c in chunks)  # no usage unless asked for
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    extension = chunks[-1].choices[0].model_extra["tandem"]
    assert extension["timings_ms"]["ttft"] > 0 and extension["prefill_worker"] and extension["decode_worker"]


def test_greedy_chat_equals_the_grpc_api_streamed_or_not(client, cluster):
    expected = grpc_text(cluster, chat_request(QUESTION, 20))
    messages = [{"role": "user", "content": QUESTION}]
    whole = client.chat.completions.create(model="", messages=messages, max_completion_tokens=20, temperature=0)
    assert whole.choices[0].message.content == expected and whole.choices[0].message.role == "assistant"
    assert "Paris" in expected
    chunks = list(client.chat.completions.create(model="", messages=messages, max_tokens=20, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_token_id_prompts_and_echo(client, cluster):
    ids = [504, 3575, 282, 4649, 314]  # "The capital of France is"
    expected = grpc_text(cluster, gpb.GenerateRequest(token_ids={"ids": ids}, sampling={"max_tokens": 6,
                                                                                         "temperature": 0}))
    res = client.completions.create(model="", prompt=ids, max_tokens=6, temperature=0, echo=True)
    assert res.choices[0].text == "The capital of France is" + expected
    batch = client.completions.create(model="", prompt=[ids, ids[:3]], max_tokens=3, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1] and expected.startswith(batch.choices[0].text)
    assert batch.usage.prompt_tokens == 8 and batch.usage.completion_tokens == 6
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="", prompt=[ids, "Hello"], max_tokens=3)
    assert info.value.body["param"] == "prompt"


def test_n_choices_share_the_prompt_and_differ_by_seed(client, cluster):
    prompt = "Write a word: " * 20  # a few full blocks: the second choice finds them cached
    res = client.completions.create(model="", prompt=prompt, n=2, max_tokens=12, temperature=1.0, seed=7)
    assert sorted(c.index for c in res.choices) == [0, 1]
    full_blocks = res.usage.prompt_tokens // 16 * 16
    assert res.choices[1].model_extra["tandem"]["cached_tokens"] >= full_blocks - 16  # it followed the first
    assert res.usage.completion_tokens == 24
    assert res.choices[0].text != res.choices[1].text  # seeds 7 and 8
    again = client.completions.create(model="", prompt=prompt, n=2, max_tokens=12, temperature=1.0, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in res.choices]
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    chunks = list(client.chat.completions.create(model="", messages=[{"role": "user", "content": QUESTION}], n=2,
                                                 max_tokens=8, temperature=0, stream=True))
    texts = {0: "", 1: ""}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts[0] == texts[1] != ""  # greedy: both choices the same answer


def test_logprobs_in_the_completions_and_chat_shapes(client):
    res = client.completions.create(model="", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    lp = res.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == res.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0 and 3 <= len(top) <= 4 and top[token] == value
        assert value == max(top.values())  # greedy: the chosen token is the most likely
    chat = client.chat.completions.create(model="", messages=[{"role": "user", "content": QUESTION}],
                                          max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob == entry.logprob
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token


def test_stop_strings_end_the_choice_with_their_reason(client):
    res = client.completions.create(model="", prompt="Count: 1, 2, 3,", max_tokens=30, temperature=0, stop=[" 6"])
    choice = res.choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == " 6"
    assert choice.text.endswith("5,") and " 6" not in choice.text


def test_usage_chunks_only_when_asked(client):
    messages = [{"role": "user", "content": QUESTION}]
    chunks = list(client.chat.completions.create(model="", messages=messages, max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 6 and last.usage.total_tokens > 6
    assert all(c.usage is None for c in body)
    continuous = list(client.completions.create(
        model="", prompt=PROMPT, max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert [c.usage.completion_tokens for c in continuous] == [1, 2, 3, 4, 4]
    assert continuous[-1].choices == []


# -- errors --------------------------------------------------------------------------------------------


def test_bad_parameters_are_400_with_the_grpc_message(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="", prompt=PROMPT, temperature=-1)
    assert info.value.status_code == 400 and "temperature" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="", prompt=PROMPT, max_tokens=20_000)
    assert "max_tokens" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="", messages=[{"role": "user", "content": QUESTION}],
                                       extra_body={"top_k": "many"})
    assert info.value.body["param"] == "top_k"
    with pytest.raises(openai.BadRequestError):  # stream=true: refused before the headers, with its own status
        client.completions.create(model="", prompt=list(range(9000)), max_tokens=4, stream=True)


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-5", prompt=PROMPT, max_tokens=2)
    assert info.value.code == "model_not_found"


def test_a_body_past_the_limit_is_413(client):
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model="", prompt="x" * (MAX_BODY + 10), max_tokens=2)
    assert info.value.status_code == 413


def test_unknown_fields_are_ignored(client):
    res = client.completions.create(model="", prompt=PROMPT, max_tokens=2, temperature=0,
                                    extra_body={"no_such_field": 1, "guided_whatever": {}})
    assert res.usage.completion_tokens == 2


# -- the connection --------------------------------------------------------------------------------------


def post(cluster: Cluster, path: str, body: dict) -> socket.socket:
    """A raw HTTP/1.1 POST; the caller reads (or closes) the socket."""
    url = urlsplit(cluster.http_url)
    data = json.dumps(body).encode()
    sock = socket.create_connection((url.hostname, url.port), timeout=60)
    sock.sendall(f"POST {url.path}{path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def busy(cluster: Cluster) -> bool:
    return any(worker_stats(w.address).num_requests for w in cluster.prefill + cluster.decode)


def test_a_long_prefill_streams_keepalives_before_the_first_token(cluster):
    sock = post(cluster, "/completions", {"prompt": LONG_PROMPT, "max_tokens": 2, "stream": True})
    with sock:
        received = b""
        while b"data: [DONE]" not in received:
            chunk = sock.recv(65536)
            assert chunk, received
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head
    assert body.index(b": keep-alive") < body.index(b"data: {")
    assert wait_clean(cluster) == []


@pytest.mark.parametrize("stream", [True, False])
def test_closing_the_connection_before_the_first_token_cancels_everywhere(cluster, stream):
    before = gateway_stats(cluster.gateway.address).finished_by_code["CANCELLED"]
    sock = post(cluster, "/completions", {"prompt": LONG_PROMPT, "max_tokens": 50, "stream": stream})
    assert wait_until(lambda: busy(cluster), 30)
    sock.close()  # no byte of the answer has come: the prefill is still running
    assert wait_clean(cluster) == []
    assert gateway_stats(cluster.gateway.address).finished_by_code["CANCELLED"] == before + 1


def test_closing_the_connection_mid_stream_cancels_everywhere(cluster):
    before = gateway_stats(cluster.gateway.address).finished_by_code["CANCELLED"]
    sock = post(cluster, "/chat/completions", {"messages": [{"role": "user", "content": QUESTION}],
                                               "max_tokens": 2000, "ignore_eos": True, "stream": True})
    received = b""
    while received.count(b"data: {") < 5:
        received += sock.recv(65536)
    assert busy(cluster)
    sock.close()
    assert wait_clean(cluster) == []
    assert gateway_stats(cluster.gateway.address).finished_by_code["CANCELLED"] == before + 1


def root(cluster: Cluster) -> str:
    return cluster.http_url.removesuffix("/v1")


def test_metrics_and_health_on_the_http_port(client, cluster):
    metrics = httpx.get(f"{root(cluster)}/metrics").text
    assert 'tandem_http_requests_total{route="/v1/completions",status="200"}' in metrics
    assert "tandem_time_to_first_token_seconds" in metrics  # the gateway's own: HTTP requests are counted there
    assert httpx.get(f"{root(cluster)}/health").json() == {"status": "ok"}


# -- a third-party load tool ------------------------------------------------------------------------------

AIPERF = "aiperf==0.13.0"  # NVIDIA's (Dynamo's) load generator; its own venv: it pins pandas, transformers, ...


@pytest.fixture(scope="module")
def aiperf() -> Path:
    """AIPerf in a venv of its own under $TANDEM_HOME/tools, built once per machine by uv (4 s; pip spent 90 s of
    CPU on the same packages)."""
    venv = tandem_home() / "tools" / AIPERF.replace("==", "-")
    exe = venv / "bin" / "aiperf"
    if not exe.exists():
        shutil.rmtree(venv, ignore_errors=True)
        uv = find_uv_bin()
        subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(venv)], check=True, timeout=120)
        subprocess.run([uv, "pip", "install", "-q", "--python", str(venv / "bin" / "python"), AIPERF], check=True,
                       timeout=900)
    return exe


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_aiperf_runs_against_the_http_front_without_errors(cluster, aiperf, default_model, tmp_path, endpoint):
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}  # with
    # either set, it takes a local tokenizer folder for a hub repo id and fails
    scratch = tempfile.mkdtemp(prefix="aiperf-", dir="/tmp")  # its IPC socket paths must fit in 107 bytes
    env.update(HF_DATASETS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", TMPDIR=scratch)
    out = tmp_path / "report"
    cmd = [str(aiperf), "profile", "--model", "SmolLM2-135M-Instruct", "--tokenizer", str(default_model),
           "--url", root(cluster), "--endpoint-type", endpoint, "--streaming", "--concurrency", "2",
           "--request-count", "6", "--synthetic-input-tokens-mean", "32", "--synthetic-input-tokens-stddev", "0",
           "--output-tokens-mean", "8", "--output-tokens-stddev", "0", "--random-seed", "0",
           "--extra-inputs", '{"ignore_eos": true}',  # exactly 8 tokens each, whatever the sampler draws
           "--use-server-token-count", "--output-artifact-dir", str(out), "--export-level", "summary",
           "--ui", "none", "--no-server-metrics", "--no-gpu-telemetry"]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "profile_export_aiperf.json").read_text())
    assert report["request_count"]["avg"] == 6 and report["is_complete"] and not report["was_cancelled"]
    assert (report.get("error_request_count") or {}).get("avg", 0) == 0, report["error_summary"]
    assert report["error_summary"] == []
    assert report["output_sequence_length"]["avg"] == 8  # counted by tandem's usage, as asked


def test_no_decode_worker_is_503(client, cluster):
    """Last: it stops the cluster's decode worker."""
    cluster.decode[0].stop()
    deadline = time.monotonic() + 30
    while True:
        try:
            client.completions.create(model="", prompt=PROMPT, max_tokens=2)
        except openai.APIStatusError as exc:
            if exc.status_code == 503:
                break
        assert time.monotonic() < deadline, "still served 30 s after the decode worker stopped"
        time.sleep(0.2)
    assert httpx.get(f"{root(cluster)}/health").status_code == 503
