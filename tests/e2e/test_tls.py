"""Transport security with real processes: the pipeline started the way `tandem up --tls` starts it (a
throwaway CA, a certificate per service), TLS on the gateway's public port, mutual TLS between the services,
and the plaintext health ports the launcher (and Kubernetes' probes) use."""

from __future__ import annotations

import asyncio
import ssl
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.service import channel
from common.tls import ClientTLS
from protos import kvstore_pb2 as kpb
from protos import kvstore_pb2_grpc as kpb_grpc
from protos import tokenizer_pb2 as tpb
from protos import tokenizer_pb2_grpc as tpb_grpc
from protos import worker_pb2 as wpb
from protos import worker_pb2_grpc as wpb_grpc
from tandem.client import build_request, stream_generate
from tandem.dev_certs import DevCA
from tandem.launcher import Cluster, ClusterConfig
from tests.e2e.pipeline import WORKER_ARGS

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster(default_model: Path, tmp_path_factory: pytest.TempPathFactory):
    config = ClusterConfig(gateway_port=0, engine_args=["--model", str(default_model), *WORKER_ARGS],
                           kv_capacity_gb=0.25, log_dir=tmp_path_factory.mktemp("tls-up"), startup_timeout=240,
                           tls=True)
    c = Cluster(config).start()
    try:
        c.wait_healthy(60)  # through each service's plaintext health port
        yield c
    finally:
        c.stop()


def identity(cluster: Cluster, name: str) -> ClientTLS:
    """A client with a certificate the cluster's CA signed (as another service would present)."""
    files = cluster.ca.issue(name)
    return ClientTLS(files.ca.read_bytes(), files.cert.read_bytes(), files.key.read_bytes())


async def first_answer(address: str, tls: ClientTLS | None) -> str:
    request = build_request("What is the capital of France?", max_tokens=8, temperature=0)
    return "".join([r.text async for r in stream_generate(address, request, timeout=120, tls=tls)])


async def internal_call(kind: str, address: str, tls: ClientTLS | None) -> grpc.StatusCode:
    """One cheap RPC of the service's own API; its status code."""
    ch = channel(address, tls) if tls else grpc.aio.insecure_channel(address)
    try:
        if kind == "tokenizer":
            await tpb_grpc.TokenizerStub(ch).Tokenize(tpb.TokenizeRequest(text="hello"), timeout=10)
        elif kind == "kvstore":
            await kpb_grpc.KVStoreStub(ch).Stats(kpb.StatsRequest(), timeout=10)
        else:
            await wpb_grpc.WorkerStub(ch).Info(wpb.WorkerInfoRequest(), timeout=10)
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    finally:
        await ch.close()


def test_tls_client_with_the_ca_streams_an_answer(cluster):
    """The answer went gateway -> tokenizer -> prefill -> kvstore -> decode, every hop over mutual TLS."""
    text = asyncio.run(first_answer(cluster.gateway.address, cluster.client_tls()))
    assert "Paris" in text
    # The CLI as a user runs it, with the CA `tandem up --tls` prints.
    proc = subprocess.run([sys.executable, "-m", "tandem.cli", "generate", "--gateway", cluster.gateway.address,
                           "--tls-ca", str(cluster.ca_path), "--max-tokens", "8", "What is the capital of France?"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0 and "Paris" in proc.stdout, proc.stderr


def test_plaintext_and_untrusting_clients_are_refused_by_the_gateway(cluster, tmp_path):
    address = cluster.gateway.address
    with pytest.raises(grpc.aio.AioRpcError) as plain:
        asyncio.run(first_answer(address, None))
    assert plain.value.code() == grpc.StatusCode.UNAVAILABLE
    stranger = DevCA(tmp_path / "stranger")  # a CA that did not sign the gateway's certificate
    with pytest.raises(grpc.aio.AioRpcError) as untrusted:
        asyncio.run(first_answer(address, ClientTLS(stranger.ca_path.read_bytes())))
    assert untrusted.value.code() == grpc.StatusCode.UNAVAILABLE
    # the CLI says what to do about it
    proc = subprocess.run([sys.executable, "-m", "tandem.cli", "generate", "--gateway", address, "--timeout", "10",
                           "hello"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 1 and "UNAVAILABLE" in proc.stderr and "--tls-ca" in proc.stderr


def test_internal_services_require_a_certificate_from_the_cluster_ca(cluster, tmp_path):
    ca_only = ClientTLS(cluster.ca_path.read_bytes())
    stranger = DevCA(tmp_path / "stranger").issue("intruder")
    foreign = ClientTLS(cluster.ca_path.read_bytes(), stranger.cert.read_bytes(), stranger.key.read_bytes())
    member = identity(cluster, "test-client")
    targets = [("tokenizer", cluster.tokenizer), ("kvstore", cluster.kvstore), ("decode", cluster.decode[0]),
               ("prefill", cluster.prefill[0])]

    async def probe() -> dict[str, dict[str, grpc.StatusCode]]:
        return {kind: {
            "plaintext": await internal_call(kind, svc.address, None),
            "no client certificate": await internal_call(kind, svc.address, ca_only),
            "another CA's certificate": await internal_call(kind, svc.address, foreign),
            "the cluster CA's certificate": await internal_call(kind, svc.address, member),
        } for kind, svc in targets}

    refused = grpc.StatusCode.UNAVAILABLE
    expected = {"plaintext": refused, "no client certificate": refused, "another CA's certificate": refused,
                "the cluster CA's certificate": grpc.StatusCode.OK}
    assert asyncio.run(probe()) == {kind: expected for kind, _ in targets}


def test_plaintext_health_ports_answer_serving(cluster):
    for svc in cluster.services:
        address = svc.ready["health"]
        assert address != svc.address
        with grpc.insecure_channel(address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, svc.name
            with pytest.raises(grpc.RpcError) as only_health:  # nothing but grpc.health.v1 there
                ch.unary_unary("/tandem.v1.Worker/Info")(b"", timeout=5)
            assert only_health.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_certificates_are_private_to_their_owner(cluster):
    tls_dir = cluster.ca_path.parent
    keys = sorted(tls_dir.glob("*-key.pem"))
    assert {k.name for k in keys} >= {f"{s.name}-key.pem" for s in cluster.services}
    assert all(k.stat().st_mode & 0o077 == 0 for k in keys)
    assert tls_dir.stat().st_mode & 0o077 == 0


def test_the_http_api_is_https_with_the_same_certificate(cluster):
    url = cluster.http_url
    assert url.startswith("https://")
    body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    trusting = ssl.create_default_context(cafile=str(cluster.ca_path))
    res = httpx.post(f"{url}/completions", json=body, verify=trusting, timeout=60)
    assert res.status_code == 200 and res.json()["usage"]["completion_tokens"] == 4
    with pytest.raises(httpx.ConnectError):  # a client that does not trust the cluster's CA
        httpx.post(f"{url}/completions", json=body, timeout=10)
    with pytest.raises(httpx.HTTPError):  # nor plaintext
        httpx.post(url.replace("https://", "http://") + "/completions", json=body, timeout=10)
