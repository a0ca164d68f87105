"""API keys through real processes: a `tandem up` cluster (aggregated: the cheapest) whose gateway has a keys
file. Unauthenticated calls get UNAUTHENTICATED, over-limit ones RESOURCE_EXHAUSTED, the keys appear in no log
and no span, tenants do not share prefix-cache blocks unless configured to, and a changed file applies live."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import yaml

from gateway.auth import hash_key
from protos import common_pb2 as cpb
from protos import gateway_pb2 as gpb
from protos import gateway_pb2_grpc as gpb_grpc
from tandem.launcher import Cluster, ClusterConfig
from tests.e2e.pipeline import WORKER_ARGS, Reply, chat_request, token_request

ROOT = Path(__file__).resolve().parents[2]
KEYS = {
    "alpha": "tdm_e2e-alpha-key-5b1f0c6a9d7e4c2b8f3a1d0e",
    "beta": "tdm_e2e-beta-key-8c2d1e0f7a6b5c4d3e2f1a0b",
    "limited": "tdm_e2e-limited-key-1a2b3c4d5e6f7a8b9c0d",
    "one-stream": "tdm_e2e-one-stream-key-0f9e8d7c6b5a4f3e2d1c",
    "shared-1": "tdm_e2e-shared-one-key-2e4f6a8c0b1d3f5a7c9e",
    "shared-2": "tdm_e2e-shared-two-key-3f5a7c9e1b2d4f6a8c0e",
    "http-limited": "tdm_e2e-http-limited-key-6d4b2f0e8c6a4e2c0a8e",
}
EXTRA = {"limited": {"requests_per_minute": 3}, "one-stream": {"max_concurrent_streams": 1},
         "http-limited": {"requests_per_minute": 1},
         "shared-1": {"share_cache": True}, "shared-2": {"share_cache": True}}
LATE_KEY = "tdm_e2e-late-key-9d8c7b6a5f4e3d2c1b0a"
PROMPT = list(range(1000, 1064))  # four full blocks of 16 tokens


def write_keys(path: Path, keys: dict[str, str]) -> None:
    entries = [{"name": name, "sha256": hash_key(key), **EXTRA.get(name, {})} for name, key in keys.items()]
    path.write_text(yaml.safe_dump({"keys": entries}))


@pytest.fixture(scope="module")
def cluster(default_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, Path]]:
    tmp = tmp_path_factory.mktemp("auth")
    keys_file = tmp / "keys.yaml"
    write_keys(keys_file, KEYS)
    config = ClusterConfig(
        mode="aggregated", num_decode=1, gateway_port=0,
        engine_args=["--model", str(default_model), *WORKER_ARGS],
        extra_args={"gateway": ["--api-keys-file", str(keys_file)]},
        env={"TANDEM_TRACE_FILE": str(tmp / "traces.jsonl"), "OTEL_BSP_SCHEDULE_DELAY": "100"},
        log_dir=tmp / "logs", startup_timeout=240,
    )
    c = Cluster(config).start()
    c.wait_healthy(60)
    yield c, tmp
    c.stop()


def bearer(name_or_key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {KEYS.get(name_or_key, name_or_key)}")]


async def acall(address: str, request: gpb.GenerateRequest, metadata, timeout: float = 60.0) -> Reply:
    reply = Reply()
    async with grpc.aio.insecure_channel(address) as ch:
        try:
            async for msg in gpb_grpc.GatewayStub(ch).Generate(request, metadata=metadata, timeout=timeout):
                reply.messages.append(msg)
        except grpc.aio.AioRpcError as exc:
            reply.code, reply.details = exc.code(), exc.details()
    return reply


def call(address: str, request: gpb.GenerateRequest, metadata) -> Reply:
    return asyncio.run(acall(address, request, metadata))


def test_calls_without_a_valid_key_are_unauthenticated(cluster):
    c, _ = cluster
    for metadata in (None, bearer("tdm_not-a-key-4c3b2a1f0e9d8c7b"), [("authorization", "Basic alpha")]):
        reply = call(c.gateway.address, chat_request("Hi", 4), metadata)
        assert reply.code == grpc.StatusCode.UNAUTHENTICATED and not reply.messages, reply.details
    reply = call(c.gateway.address, chat_request("Say hello.", 8), bearer("alpha"))
    assert reply.code == grpc.StatusCode.OK and reply.text and reply.last.usage.completion_tokens > 0
    assert call(c.gateway.address, chat_request("Hi", 2), [("x-api-key", KEYS["beta"])]).code == grpc.StatusCode.OK


def test_rate_limit(cluster):
    c, _ = cluster
    replies = [call(c.gateway.address, token_request(PROMPT[:8], 1), bearer("limited")) for _ in range(4)]
    assert [r.code for r in replies[:3]] == [grpc.StatusCode.OK] * 3
    assert replies[3].code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "'limited' is over its rate limit of 3 requests per minute" in replies[3].details


def test_concurrent_streams_limit(cluster):
    c, _ = cluster
    long = token_request(PROMPT[:8], 0, sampling=cpb.SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))

    async def scenario() -> tuple[Reply, Reply]:
        async with grpc.aio.insecure_channel(c.gateway.address) as ch:
            first = gpb_grpc.GatewayStub(ch).Generate(long, metadata=bearer("one-stream"), timeout=60)
            assert (await first.read()).token_ids  # the stream is open
            second = await acall(c.gateway.address, token_request(PROMPT[:8], 1), bearer("one-stream"))
            other = await acall(c.gateway.address, token_request(PROMPT[:8], 1), bearer("beta"))
            first.cancel()
        return second, other

    second, other = asyncio.run(scenario())
    assert second.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "'one-stream' has 1 streams open, its limit of concurrent streams is 1" in second.details
    assert other.code == grpc.StatusCode.OK  # the limit is the key's, not the gateway's
    deadline = time.monotonic() + 15  # the cancelled stream's slot comes back
    while (r := call(c.gateway.address, token_request(PROMPT[:8], 1), bearer("one-stream"))).code != grpc.StatusCode.OK:
        assert time.monotonic() < deadline, r.details
        time.sleep(0.2)


def test_tenants_do_not_share_cached_blocks_unless_configured(cluster):
    c, _ = cluster

    def cached(name: str, salt: str = "same") -> int:
        reply = call(c.gateway.address, token_request(PROMPT, 1, cache_salt=salt), bearer(name))
        assert reply.code == grpc.StatusCode.OK, reply.details
        return reply.last.usage.cached_tokens

    assert cached("alpha") == 0
    assert cached("alpha") >= 48  # the same tenant hits its own blocks
    assert cached("beta") == 0  # the same prompt and client salt, another tenant: nothing shared
    assert cached("alpha", salt="other") == 0  # the client's salt still applies inside a tenant
    assert cached("shared-1") == 0
    assert cached("shared-2") >= 48  # share_cache keys share blocks under the same client salt


def test_keys_appear_in_no_log_and_no_span(cluster):
    c, tmp = cluster
    call(c.gateway.address, chat_request("Hi", 2), bearer("tdm_wrong-but-secret-7e6d5c4b3a29"))
    call(c.gateway.address, chat_request("Hi", 2), bearer("alpha"))
    time.sleep(1.0)  # spans are exported in batches
    logs = "".join(p.read_text(errors="replace") for p in (tmp / "logs").glob("*.log"))
    traces = (tmp / "traces.jsonl").read_text()
    for key in (*KEYS.values(), "wrong-but-secret"):
        assert key not in logs and key not in traces
    roots = [json.loads(line) for line in traces.splitlines()]
    roots = [r["attributes"] for r in roots if r["name"] == "gateway.generate"]
    assert any(a.get("tandem.api_key") == "alpha" and a.get("rpc.grpc.status_code") == "OK" for a in roots)
    # The refused calls have their root spans too, without a key name.
    assert any("tandem.api_key" not in a and a.get("rpc.grpc.status_code") == "UNAUTHENTICATED" for a in roots)


def test_tandem_generate_sends_the_key(cluster):
    c, _ = cluster
    cmd = [sys.executable, "-m", "tandem.cli", "generate", "--gateway", c.gateway.address, "--max-tokens", "4", "Hi"]
    ok = subprocess.run([*cmd, "--api-key", KEYS["alpha"]], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    refused = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60,
                             env={k: v for k, v in os.environ.items() if k != "TANDEM_API_KEY"})
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr and "--api-key" in refused.stderr


def test_a_changed_keys_file_applies_without_a_restart(cluster):
    c, tmp = cluster
    assert call(c.gateway.address, token_request(PROMPT[:8], 1), bearer(LATE_KEY)).code == \
        grpc.StatusCode.UNAUTHENTICATED
    write_keys(tmp / "keys.yaml", {**KEYS, "late": LATE_KEY})
    deadline = time.monotonic() + 10
    while (r := call(c.gateway.address, token_request(PROMPT[:8], 1), bearer(LATE_KEY))).code != grpc.StatusCode.OK:
        assert r.code == grpc.StatusCode.UNAUTHENTICATED and time.monotonic() < deadline
        time.sleep(0.3)


def test_bench_serve_sends_the_key(cluster, tmp_path: Path):
    c, _ = cluster
    cmd = [sys.executable, "-m", "tandem.cli", "bench", "serve", "--gateway", c.gateway.address, "--num-prompts", "2",
           "--input-len", "16", "--output-len", "2", "--num-warmups", "0", "--no-plots", "--no-progress",
           "--output-dir", str(tmp_path), "--label", "auth"]
    env = {k: v for k, v in os.environ.items() if k != "TANDEM_API_KEY"}
    refused = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert refused.returncode != 0 and "UNAUTHENTICATED" in refused.stderr + refused.stdout
    ok = subprocess.run([*cmd, "--api-key", KEYS["beta"]], cwd=ROOT, capture_output=True, text=True, timeout=120,
                        env=env)
    assert ok.returncode == 0, ok.stderr
    (result,) = tmp_path.glob("serve-auth-*.json")
    (run,) = json.loads(result.read_text())["runs"]
    assert (run["metrics"]["completed"], run["metrics"]["failed"]) == (2, 0)


def test_the_http_api_takes_the_same_keys_401_and_429_with_retry_after(cluster):
    c, _ = cluster
    anonymous = httpx.post(f"{c.http_url}/completions", json={"prompt": PROMPT[:8], "max_tokens": 1})
    assert anonymous.status_code == 401 and anonymous.json()["error"]["type"] == "authentication_error"
    wrong = openai.OpenAI(base_url=c.http_url, api_key="tdm_not-a-key", max_retries=0)
    for attempt in (lambda: wrong.models.list(), lambda: wrong.completions.create(model="", prompt=PROMPT[:8])):
        with pytest.raises(openai.AuthenticationError) as info:
            attempt()
        assert info.value.status_code == 401 and "tdm_not-a-key" not in info.value.message
    limited = openai.OpenAI(base_url=c.http_url, api_key=KEYS["http-limited"], max_retries=0)
    assert limited.completions.create(model="", prompt=PROMPT[:8], max_tokens=1).usage.completion_tokens == 1
    for stream in (False, True):  # a stream is refused before its headers too, with the same status
        with pytest.raises(openai.RateLimitError) as info:
            limited.completions.create(model="", prompt=PROMPT[:8], max_tokens=1, stream=stream)
        assert info.value.status_code == 429 and "'http-limited' is over its rate limit" in info.value.message
        assert 1 <= int(info.value.response.headers["retry-after"]) <= 60
