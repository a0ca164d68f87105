"""API keys at a real in-process gateway in front of a real aggregated worker (tests.e2e.inprocess): answering
UNAUTHENTICATED / RESOURCE_EXHAUSTED without ever showing the key, and keeping tenants' prefix caches apart; and
`tandem keys add` as a command. The keys file, authentication and limits in process: tests/unit/test_auth.py."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.auth import KeyRing, KeysFileError, add_key
from protos import common_pb2 as cpb
from protos import gateway_pb2 as gpb
from protos import gateway_pb2_grpc as gpb_grpc
from protos import worker_pb2 as wpb
from protos import worker_pb2_grpc as wpb_grpc
from tests.e2e.inprocess import Stack
from tests.unit.test_auth import KEY_A, KEY_B, KEY_C, bearer, entry, write

ROOT = Path(__file__).resolve().parents[2]


def test_tandem_keys_add_prints_the_key_once_and_stores_its_hash(tmp_path):
    path = tmp_path / "secrets" / "keys.yaml"
    cmd = [sys.executable, "-m", "tandem.cli", "keys", "add", "team-a", "--api-keys-file", str(path),
           "--requests-per-minute", "120", "--max-concurrent-streams", "4"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    key = proc.stdout.strip()
    assert key.startswith("tdm_") and len(key) > 40 and key not in proc.stderr
    assert key not in path.read_text() and oct(path.stat().st_mode & 0o777) == "0o600"
    [a] = KeyRing.load(path).keys
    assert (a.name, a.requests_per_minute, a.max_concurrent_streams) == ("team-a", 120, 4)
    assert KeyRing.load(path).authenticate(bearer(key)).name == "team-a"
    second = add_key(path, "team-b", share_cache=True)
    assert [k.name for k in KeyRing.load(path).keys] == ["team-a", "team-b"] and second != key
    with pytest.raises(KeysFileError, match="used twice"):
        add_key(path, "team-b")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "used twice" in proc.stderr


# ---- a real gateway over gRPC -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed(default_model, aggregated_worker, tmp_path_factory) -> Iterator[tuple[Stack, Path]]:
    path = write(tmp_path_factory.mktemp("keys") / "keys.yaml",
                 entry("a", KEY_A), entry("b", KEY_B), entry("limited", KEY_C, requests_per_minute=3),
                 entry("shared-1", "tdm_shared-one-0123456789", share_cache=True),
                 entry("shared-2", "tdm_shared-two-0123456789", share_cache=True))
    stack = Stack(default_model, aggregated_worker, ["--api-keys-file", str(path)])
    yield stack, path
    stack.close()


def generate(address: str, metadata, **fields) -> tuple[grpc.StatusCode, str]:
    req = gpb.GenerateRequest(prompt="Hello there", sampling=cpb.SamplingParams(max_tokens=2), **fields)
    with grpc.insecure_channel(address) as ch:
        try:
            list(gpb_grpc.GatewayStub(ch).Generate(req, metadata=metadata, timeout=10))
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


@pytest.fixture
def spans(monkeypatch):
    """The spans the gateway records, in memory."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from common import telemetry

    exporter, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(telemetry, "tracer", lambda: provider.get_tracer("test"))
    return exporter


def test_gateway_refuses_calls_without_a_valid_key(keyed, caplog, spans):
    stack, _ = keyed
    with caplog.at_level(logging.DEBUG):
        assert generate(stack.gateway, None)[0] == grpc.StatusCode.UNAUTHENTICATED
        code, details = generate(stack.gateway, bearer("tdm_wrong-key-0123456789"))
        assert code == grpc.StatusCode.UNAUTHENTICATED and "wrong-key" not in details
        assert generate(stack.gateway, bearer(KEY_A)) == (grpc.StatusCode.OK, "")
        assert generate(stack.gateway, [("x-api-key", KEY_B)]) == (grpc.StatusCode.OK, "")
    assert "wrong-key" not in caplog.text and KEY_A not in caplog.text
    roots = [sp for sp in spans.get_finished_spans() if sp.name == "gateway.generate"]
    assert [sp.attributes.get("rpc.grpc.status_code") for sp in roots] == ["UNAUTHENTICATED"] * 2 + ["OK"] * 2
    assert [sp.attributes.get("tandem.api_key") for sp in roots] == [None, None, "a", "b"]
    recorded = repr([(sp.attributes, sp.status.description, sp.events) for sp in roots])
    assert "wrong-key" not in recorded and KEY_A not in recorded and KEY_B not in recorded
    with grpc.insecure_channel(stack.gateway) as ch:
        stub = gpb_grpc.GatewayStub(ch)
        for rpc, req in ((stub.ListModels, gpb.ListModelsRequest()), (stub.Stats, gpb.GatewayStatsRequest())):
            with pytest.raises(grpc.RpcError) as err:
                rpc(req, timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            rpc(req, metadata=bearer(KEY_A), timeout=10)
        health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    metrics = stack.gateway_core.metrics.api_key_requests
    assert metrics.labels("a", "OK")._value.get() >= 1


def test_gateway_rate_limit_is_resource_exhausted(keyed):
    stack, _ = keyed
    codes = [generate(stack.gateway, bearer(KEY_C)) for _ in range(4)]
    assert [c for c, _ in codes[:3]] == [grpc.StatusCode.OK] * 3
    assert codes[3][0] == grpc.StatusCode.RESOURCE_EXHAUSTED and "rate limit of 3 requests per minute" in codes[3][1]
    assert generate(stack.gateway, bearer(KEY_A))[0] == grpc.StatusCode.OK  # another key is not limited


# Three full blocks and one token: a request that finds them in the worker's prefix cache computes one token.
SALTED_PROMPT = list(range(1000, 1049))


def cached_tokens(address: str, metadata, cache_salt: str, prompt: list[int]) -> int:
    """Prompt tokens the worker found in its prefix cache for one request through the gateway."""
    req = gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=prompt), cache_salt=cache_salt,
                              sampling=cpb.SamplingParams(max_tokens=1))
    with grpc.insecure_channel(address) as ch:
        return list(gpb_grpc.GatewayStub(ch).Generate(req, metadata=metadata, timeout=10))[-1].usage.cached_tokens


def cached_at_worker(worker: str, cache_salt: str, prompt: list[int]) -> int:
    """The same, calling the worker itself with exactly ``cache_salt``."""
    req = wpb.DecodeRequest(request_id=f"direct-{cache_salt or 'none'}-{prompt[0]}", prompt_token_ids=prompt,
                            cache_salt=cache_salt, sampling=cpb.SamplingParams(max_tokens=1))
    with grpc.insecure_channel(worker) as ch:
        return list(wpb_grpc.WorkerStub(ch).Decode(req, timeout=10))[0].num_cached_tokens


def test_tenants_never_share_cache_salts_unless_configured(keyed):
    """Read in the worker's prefix cache: a request finds the blocks of an earlier one only under the same salt."""
    stack, _ = keyed
    hits = [cached_tokens(stack.gateway, bearer(key), salt, SALTED_PROMPT) for key, salt in (
        (KEY_A, "same"),  # a's blocks, in a's namespace
        (KEY_B, "same"),  # the same client salt in b's namespace: not a's blocks
        (KEY_A, "same"),  # a's again
        (KEY_A, "other"),  # the client's salt still applies within a tenant
        ("tdm_shared-one-0123456789", "same"),  # shared keys: the client's salt alone, which is not a's
        ("tdm_shared-two-0123456789", "same"),  # the first shared key's blocks
    )]
    assert hits == [0, 0, 48, 0, 0, 48], hits
    assert cached_at_worker(stack.worker, "same", SALTED_PROMPT) == 48, "the shared keys' salt is the client's own"
    code, details = generate(stack.gateway, bearer(KEY_A), cache_salt="x\x00y")
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "cache_salt" in details


def test_no_keys_file_means_no_authentication(default_model, aggregated_worker):
    stack = Stack(default_model, aggregated_worker)
    try:
        assert generate(stack.gateway, None) == (grpc.StatusCode.OK, "")
        prompt = [p + 100 for p in SALTED_PROMPT]
        assert cached_tokens(stack.gateway, None, "", prompt) == 0
        assert cached_at_worker(stack.worker, "", prompt) == 48, "no salt reached the worker"
    finally:
        stack.close()
