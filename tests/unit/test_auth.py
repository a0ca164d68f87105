"""API keys at the gateway: the keys file, authentication, per-key rate limits and streams, reloads, tenant
cache salts, `tandem keys add`, and a real in-process gateway (in front of a real aggregated worker) answering
UNAUTHENTICATED / RESOURCE_EXHAUSTED without ever showing the key, and keeping tenants' prefix caches apart."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.auth import AuthError, KeyRing, KeysFileError, add_key, hash_key, parse_keys, presented_key
from gateway.server import add_args, check_args
from protos import common_pb2 as cpb
from protos import gateway_pb2 as gpb
from protos import gateway_pb2_grpc as gpb_grpc
from protos import worker_pb2 as wpb
from protos import worker_pb2_grpc as wpb_grpc
from tests.unit.inprocess import Stack

ROOT = Path(__file__).resolve().parents[2]
KEY_A, KEY_B, KEY_C = "tdm_alpha-secret-0123456789", "tdm_beta-secret-0123456789", "tdm_gamma-secret-0123456789"


def entry(name: str, key: str, **extra) -> dict:
    return {"name": name, "sha256": hash_key(key), **extra}


def write(path: Path, *entries: dict) -> Path:
    path.write_text(yaml.safe_dump({"keys": list(entries)}))
    return path


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def bearer(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


# ---- the keys file ----------------------------------------------------------------------------------------------


def test_yaml_and_json_files_load(tmp_path):
    write(tmp_path / "keys.yaml", entry("a", KEY_A, requests_per_minute=60, max_concurrent_streams=2))
    (tmp_path / "keys.json").write_text(json.dumps([entry("b", KEY_B, share_cache=True)]))
    [a] = KeyRing.load(tmp_path / "keys.yaml").keys
    [b] = KeyRing.load(tmp_path / "keys.json").keys
    assert (a.name, a.requests_per_minute, a.max_concurrent_streams, a.share_cache) == ("a", 60, 2, False)
    assert (b.name, b.share_cache) == ("b", True)


@pytest.mark.parametrize(("doc", "match"), [
    ({"keys": [{"name": "a"}]}, r"keys\[0\] \(a\): sha256 must be"),
    ({"keys": [{"name": "a b", "sha256": "0" * 64}]}, "name must be"),
    ({"keys": [{"name": "a", "sha256": "0" * 64, "rpm": 3}]}, "unknown fields"),
    ({"keys": [{"name": "a", "sha256": "0" * 64, "requests_per_minute": 0}]}, "requests_per_minute"),
    ({"keys": [{"name": "a", "sha256": "0" * 64, "max_concurrent_streams": 1.5}]}, "max_concurrent_streams"),
    ({"keys": [{"name": "a", "sha256": "0" * 64, "cache_salt": "x\x00"}]}, "cache_salt"),
    ({"keys": [{"name": "a", "sha256": "0" * 64, "cache_salt": "x", "share_cache": True}]}, "not both"),
    ({"keys": [{"name": "a", "sha256": "0" * 64}, {"name": "a", "sha256": "1" * 64}]}, "used twice"),
    ({"keys": [{"name": "a", "sha256": "0" * 64}, {"name": "b", "sha256": "0" * 64}]}, "same key hash"),
    ({"keys": "a"}, "expected a list"),
])
def test_bad_entries_are_refused_with_where(doc, match):
    with pytest.raises(KeysFileError, match=match):
        parse_keys(doc)


def test_unreadable_or_invalid_file_stops_the_gateway_at_start(tmp_path):
    with pytest.raises(KeysFileError, match="cannot read"):
        KeyRing.load(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("keys: [\n")
    with pytest.raises(KeysFileError, match="not valid YAML"):
        KeyRing.load(tmp_path / "bad.yaml")
    parser = argparse.ArgumentParser()
    add_args(parser)
    args = parser.parse_args(["--tokenizer", "x:1", "--decode-workers", "x:2", "--mode", "aggregated",
                              "--api-keys-file", str(tmp_path / "bad.yaml")])
    with pytest.raises(SystemExit, match="not valid YAML"):
        check_args(args)


# ---- authentication ---------------------------------------------------------------------------------------------


def test_metadata_forms():
    assert presented_key(bearer(KEY_A)) == KEY_A
    assert presented_key([("authorization", f"bearer   {KEY_A} ")]) == KEY_A
    assert presented_key([("x-api-key", KEY_B)]) == KEY_B
    assert presented_key([("authorization", f"Basic {KEY_A}")]) is None
    assert presented_key([("authorization", "Bearer ")]) is None
    assert presented_key([("x-api-key-bin", b"\x00")]) is None
    assert presented_key(None) is None


def test_authenticate_finds_the_key_and_never_echoes_it(tmp_path):
    ring = KeyRing.load(write(tmp_path / "k.yaml", entry("a", KEY_A), entry("b", KEY_B)))
    assert ring.authenticate(bearer(KEY_B)).name == "b"
    assert ring.authenticate([("x-api-key", KEY_A)]).name == "a"
    for metadata, match in ((bearer(KEY_C), "not valid"), ([], "needs an API key"), (bearer(KEY_A + "x"), "not valid")):
        with pytest.raises(AuthError, match=match) as err:
            ring.authenticate(metadata)
        assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert "secret" not in err.value.message


def test_rate_limit_is_a_token_bucket(tmp_path):
    clock = Clock()
    ring = KeyRing.load(write(tmp_path / "k.yaml", entry("a", KEY_A, requests_per_minute=2), entry("b", KEY_B)),
                        clock=clock)
    a = ring.authenticate(bearer(KEY_A))
    ring.admit(a).release()
    ring.admit(a).release()
    with pytest.raises(AuthError, match=r"'a' is over its rate limit of 2 requests per minute; retry in 30.0 s") as e:
        ring.admit(a)
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    for _ in range(50):  # other keys are not limited by it
        ring.admit(ring.authenticate(bearer(KEY_B))).release()
    clock.now += 30  # one token back
    ring.admit(a).release()
    with pytest.raises(AuthError, match="rate limit"):
        ring.admit(a)


def test_concurrent_streams_limit(tmp_path):
    ring = KeyRing.load(write(tmp_path / "k.yaml", entry("a", KEY_A, max_concurrent_streams=2)))
    a = ring.authenticate(bearer(KEY_A))
    first, second = ring.admit(a), ring.admit(a)
    with pytest.raises(AuthError, match="'a' has 2 streams open, its limit of concurrent streams is 2") as e:
        ring.admit(a)
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    first.release()
    first.release()  # idempotent
    third = ring.admit(a)
    second.release()
    third.release()
    assert ring.usage["a"].streams == 0


def test_the_file_is_read_again_when_it_changes(tmp_path, caplog):
    clock = Clock()
    path = write(tmp_path / "k.yaml", entry("a", KEY_A))
    ring = KeyRing.load(path, reload_interval_s=1.0, clock=clock)
    write(path, entry("a", KEY_A), entry("b", KEY_B, max_concurrent_streams=1))
    os.utime(path, ns=(1, 1))  # a new mtime even within the filesystem's timestamp granularity
    with pytest.raises(AuthError):  # not yet: at most once a second
        ring.authenticate(bearer(KEY_B))
    clock.now += 1.5
    assert ring.authenticate(bearer(KEY_B)).max_concurrent_streams == 1
    # A broken update keeps the keys loaded before (and says so once, without the file's content).
    path.write_text("keys: [ {name: a, sha256: nothex} ]")
    clock.now += 1.5
    with caplog.at_level(logging.ERROR, "tandem.gateway.auth"):
        assert ring.authenticate(bearer(KEY_B)).name == "b"
    assert "cannot be used" in caplog.text and "keeping the 2 keys" in caplog.text
    # A key removed from the file stops working.
    write(path, entry("b", KEY_B))
    clock.now += 1.5
    with pytest.raises(AuthError):
        ring.authenticate(bearer(KEY_A))


def test_a_kubernetes_secret_update_swaps_a_symlink(tmp_path):
    """Secret volumes hold keys.yaml -> ..data/keys.yaml, ..data -> ..<timestamp>; an update swaps ..data."""
    clock = Clock()
    (tmp_path / "..v1").mkdir()
    write(tmp_path / "..v1" / "keys.yaml", entry("a", KEY_A))
    (tmp_path / "..data").symlink_to("..v1")
    (tmp_path / "keys.yaml").symlink_to("..data/keys.yaml")
    ring = KeyRing.load(tmp_path / "keys.yaml", clock=clock)
    (tmp_path / "..v2").mkdir()
    write(tmp_path / "..v2" / "keys.yaml", entry("b", KEY_B))
    (tmp_path / "..tmp").symlink_to("..v2")
    os.replace(tmp_path / "..tmp", tmp_path / "..data")
    clock.now += 2
    assert ring.authenticate(bearer(KEY_B)).name == "b"


def test_tenant_salts():
    a, shared, team = parse_keys([entry("a", KEY_A), entry("s", KEY_B, share_cache=True),
                                  entry("t", KEY_C, cache_salt="team")])
    assert a.salt("") != a.salt("x") != shared.salt("x")
    assert shared.salt("x") == "x" and shared.salt("") == ""
    assert a.salt("x") == a.salt("x") and "\x00" in a.salt("")  # no client salt can be a tenant's (validation)
    assert team.salt("x") != a.salt("x")
    b_named_team = parse_keys([entry("team", KEY_A)])[0]
    assert b_named_team.salt("x") == team.salt("x")  # a cache_salt names a namespace keys may share


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
