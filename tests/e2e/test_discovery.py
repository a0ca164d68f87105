"""A gateway process given ``--decode-workers dns:///localhost:PORT``: the system's resolver (getaddrinfo) finds
the real worker process of a ``tandem up`` aggregated cluster, the gateway serves through it, and its Stats and
the bench's StatsPoller see the worker by its resolved address. (tests/e2e/test_worker_discovery.py changes the
DNS answer under a running gateway.)
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tandem.bench.timeline import StatsPoller
from tandem.launcher import ServiceSpec
from tests.e2e.pipeline import chat_request, gateway_stats, generate, start_cluster, wait_until


@pytest.fixture(scope="module")
def cluster(default_model, tmp_path_factory):
    c = start_cluster(default_model, tmp_path_factory.mktemp("discovery-logs"), mode="aggregated")
    yield c
    c.stop()


async def poller_workers(gateway: str) -> list[str]:
    poller = StatsPoller(lambda: 0, gateway)
    try:
        return await poller.discover()
    finally:
        await poller.close()


def test_a_dns_entry_resolves_through_getaddrinfo_and_serves(cluster):
    [worker] = cluster.decode
    port = worker.address.rsplit(":", 1)[1]
    argv = list(cluster.gateway.spec.argv)
    argv[argv.index("--port") + 1] = "0"
    argv[argv.index("--decode-workers") + 1] = f"dns:///localhost:{port}"
    [gateway] = cluster.launch([ServiceSpec("gateway-dns", "gateway", argv)])
    try:
        def serving() -> bool:
            return any(w.address == worker.address and w.healthy for w in gateway_stats(gateway.address).workers)

        assert wait_until(serving, 30), gateway_stats(gateway.address)
        addresses = {w.address for w in gateway_stats(gateway.address).workers}
        assert addresses <= {f"127.0.0.1:{port}", f"[::1]:{port}"}, "what localhost resolves to, IPv6 bracketed"
        reply = generate(gateway.address, chat_request("What is the capital of France?", 8))
        assert reply.code == grpc.StatusCode.OK, reply.details
        assert reply.tokens and reply.last.decode_worker == worker.address
        assert f"aggregated {worker.address}" in asyncio.run(poller_workers(gateway.address))
    finally:
        gateway.stop()
