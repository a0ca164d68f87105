"""Worker discovery by DNS (``dns:///HOST:PORT`` entries of ``--decode-workers``), in process: the entries parse
as gRPC targets, the default resolver, the TLS name a worker found by DNS is checked against, and the flags. A
gateway in front of real workers whose DNS answer changes: tests/e2e/test_worker_discovery.py.
"""

from __future__ import annotations

import argparse
import asyncio

import pytest

from common.tls import ClientTLS, install, internal_client
from gateway.server import add_args, check_args
from gateway.workers import DnsTarget, WorkerClient, parse_dns, resolve_dns, tls_checking

# -- entries, the real resolver, TLS names, flags --------------------------------------------------------------


def test_dns_entries_parse_as_grpc_targets():
    assert parse_dns("10.0.0.1:50062") is None and parse_dns("worker-0:50062") is None
    assert parse_dns("dns:///tandem-decode.llm.svc.cluster.local:50062") == \
        DnsTarget("tandem-decode.llm.svc.cluster.local", 50062)
    assert parse_dns("dns:///[::1]:7000") == DnsTarget("::1", 7000)
    assert str(DnsTarget("::1", 7000)) == "dns:///[::1]:7000"
    for bad in ("dns://8.8.8.8/workers:50062", "dns:///workers", "dns:///workers:http", "dns:///:50062",
                "dns:///workers:0"):
        with pytest.raises(ValueError, match="dns:///HOST:PORT"):
            parse_dns(bad)


def test_the_default_resolver_is_getaddrinfo_with_ipv6_bracketed():
    found = asyncio.run(resolve_dns("localhost", 4321))
    assert "127.0.0.1:4321" in found or "[::1]:4321" in found
    assert all(a.startswith("[") == (a.count(":") > 1) for a in found), found


def test_a_worker_found_by_dns_is_checked_against_the_dns_name():
    previous = internal_client()
    install(None)
    assert tls_checking("tandem-decode.llm.svc.cluster.local") is None  # plaintext stays plaintext
    install(ClientTLS(ca=b"ca"))
    try:
        assert tls_checking("tandem-decode.llm.svc.cluster.local").server_name == \
            "tandem-decode.llm.svc.cluster.local"
        assert tls_checking(None).server_name is None  # a static address: its own host
        install(ClientTLS(ca=b"ca", server_name="tandem.internal"))
        assert tls_checking("tandem-decode.llm.svc.cluster.local").server_name == "tandem.internal"
    finally:
        install(previous)


def test_check_args_counts_dns_entries_and_refuses_malformed_ones():
    parser = argparse.ArgumentParser()
    add_args(parser)
    base = ["--tokenizer", "127.0.0.1:1", "--kvstore", "127.0.0.1:2"]
    check_args(parser.parse_args([*base, "--decode-workers", "dns:///decode:50062",
                                  "--prefill-workers", "10.0.0.1:50061,dns:///prefill:50061"]))
    with pytest.raises(SystemExit, match="dns:///HOST:PORT"):
        check_args(parser.parse_args([*base, "--decode-workers", "dns://decode:50062",
                                      "--prefill-workers", "dns:///prefill:50061"]))
    with pytest.raises(SystemExit, match="--decode-workers"):
        check_args(parser.parse_args([*base, "--prefill-workers", "dns:///prefill:50061"]))
    with pytest.raises(SystemExit, match="--discovery-interval-s"):
        check_args(parser.parse_args([*base, "--decode-workers", "dns:///decode:50062",
                                      "--prefill-workers", "dns:///prefill:50061", "--discovery-interval-s", "0"]))


def test_a_claim_counts_a_call_on_its_worker_until_the_call_ends():
    """Routing reads a worker's inflight calls and pending prompt tokens; a call changes them only through
    its claim, which gives them back however the call ends."""

    async def main() -> None:
        worker = WorkerClient("127.0.0.1:1", "decode")
        with worker.claim(40) as claim:
            assert (worker.inflight, worker.pending_prompt_tokens) == (1, 40)
            claim.computed()  # the first token: the prompt no longer loads the worker
            assert (worker.inflight, worker.pending_prompt_tokens) == (1, 0)
        with pytest.raises(RuntimeError), worker.claim(7):
            raise RuntimeError("the call failed")
        assert (worker.inflight, worker.pending_prompt_tokens) == (0, 0)
        await worker.channel.close()

    asyncio.run(main())
