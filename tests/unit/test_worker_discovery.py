"""Worker discovery by DNS (``dns:///HOST:PORT`` entries of ``--decode-workers``), in process: a gateway, the
real tokenizer service and three workers serving real gRPC on loopback. Only the system's resolver is swapped
(``Gateway(resolver=...)``) for an answer the tests change; everything after the lookup is the real path:
health checks, routing, streams, channels.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket

import grpc
import pytest
from prometheus_client import CollectorRegistry

from gateway.server import SERVICE_NAME, Gateway, add_args, add_gateway_servicer, check_args
from gateway.workers import DnsTarget, parse_dns, resolve_dns, tls_checking
from protos import common_pb2 as cpb
from protos import worker_pb2 as wpb
from protos import worker_pb2_grpc as wpb_grpc
from tandem.metrics import RequestMetrics
from tandem.service import Service, start_server
from tandem.tls import ClientTLS, install, internal_client
from tests.e2e.pipeline import call, generate, token_request, wait_until
from tests.unit.inprocess import FAKE_TOKEN, FakeWorker, LoopThread
from tokenizer_svc.server import build_service
from tokenizer_svc.tokenizer import TextTokenizer

HOST, PORT = "workers.tandem.test", 50062
INTERVAL_S = "0.1"  # probes and resolutions: the tests wait a few of them


class StreamingWorker(FakeWorker):
    """Streams ``max_tokens`` tokens; a stream of more than one waits after its first until ``release``."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__(vocab_size)
        self.release = asyncio.Event()
        self.running = 0

    async def Decode(self, request: wpb.DecodeRequest, context):
        n = request.sampling.max_tokens
        self.running += 1
        try:
            for i in range(n):
                if i == 1:
                    await self.release.wait()
                finish = cpb.FINISH_REASON_LENGTH if i == n - 1 else cpb.FINISH_REASON_UNSPECIFIED
                yield wpb.DecodeResponse(output=cpb.TokenOutput(token_ids=[FAKE_TOKEN]), finish_reason=finish)
        finally:
            self.running -= 1


class Answer:
    """The swapped resolver: the addresses it answers, or the error it raises; how often it was asked."""

    def __init__(self) -> None:
        self.addresses: list[str] = []
        self.error: OSError | None = None
        self.calls = 0

    async def __call__(self, host: str, port: int) -> list[str]:
        assert (host, port) == (HOST, PORT)
        self.calls += 1
        if self.error is not None:
            raise self.error
        return list(self.addresses)


class DnsStack:
    """tokenizer_svc + three streaming workers + a gateway whose decode workers are ``dns:///HOST:PORT``."""

    def __init__(self, model) -> None:
        self.loop = LoopThread()
        self.tokenizer = TextTokenizer(model)
        self.workers = [StreamingWorker(self.tokenizer.vocab_size) for _ in range(3)]
        self.answer = Answer()
        self.loop.run(self._start())

    async def _start(self) -> None:
        tok = await start_server([build_service(self.tokenizer)], "127.0.0.1", 0)
        workers = [await start_server([Service("tandem.v1.Worker", wpb_grpc.add_WorkerServicer_to_server, w)],
                                      "127.0.0.1", 0) for w in self.workers]
        self.addresses = [f"127.0.0.1:{s.port}" for s in workers]
        self.answer.addresses = self.addresses[:1]
        parser = argparse.ArgumentParser()
        add_args(parser)
        args = parser.parse_args(["--mode", "aggregated", "--tokenizer", f"127.0.0.1:{tok.port}", "--port", "0",
                                  "--decode-workers", f"dns:///{HOST}:{PORT}", "--probe-interval-s", INTERVAL_S,
                                  "--discovery-interval-s", INTERVAL_S])
        self.core = Gateway(args, RequestMetrics(CollectorRegistry()), resolver=self.answer)
        gw = await start_server([Service(SERVICE_NAME, add_gateway_servicer, self.core)], "127.0.0.1", 0)
        await self.core.pool.discover()  # as gateway.server.serve does
        await self.core.pool.probe_all()
        self.core.pool.start()
        self.servers = [gw, *workers, tok]
        self.gateway = f"127.0.0.1:{gw.port}"

    def routable(self) -> list[str]:
        """The decode workers the gateway routes to now: in its list, and ready."""
        async def read() -> list[str]:
            return [w.address for w in self.core.pool.decode if w.ready]

        return self.loop.run(read())

    def retired(self) -> list[str]:
        """Workers gone from DNS whose channels are still open (a call runs on them)."""
        async def read() -> list[str]:
            return [w.address for w in self.core.pool.retired]

        return self.loop.run(read())

    def answer_with(self, addresses: list[str]) -> None:
        """Answer ``addresses`` from now on, and wait until the gateway routes to exactly them."""
        self.answer.error, self.answer.addresses = None, addresses
        assert wait_until(lambda: sorted(self.routable()) == sorted(addresses), 5), self.routable()

    def release(self, address: str) -> None:
        worker = self.workers[self.addresses.index(address)]
        self.loop.loop.call_soon_threadsafe(worker.release.set)

    def close(self) -> None:
        async def stop() -> None:
            await self.core.close()
            for s in self.servers:
                await s.stop(0)

        self.loop.run(stop())
        self.loop.close()


@pytest.fixture(scope="module")
def stack(default_model):
    s = DnsStack(default_model)
    yield s
    s.close()


def served_by(stack: DnsStack, n: int) -> set[str]:
    """The decode workers that served ``n`` one-token requests (prompts under a block: no prefix affinity,
    so equal loads go round-robin)."""
    workers = set()
    for i in range(n):
        reply = generate(stack.gateway, token_request([10 + i, 11, 12], 1), timeout=10)
        assert reply.code == grpc.StatusCode.OK, reply.details
        workers.add(reply.last.decode_worker)
    return workers


def test_a_worker_added_to_the_answer_gets_requests_after_the_next_resolution(stack):
    a, b, _ = stack.addresses
    stack.answer_with([a])
    assert served_by(stack, 4) == {a}
    stack.answer_with([a, b])  # found, health-checked, then ready
    assert served_by(stack, 6) == {a, b}


def test_a_worker_removed_gets_no_new_requests_and_its_stream_finishes(stack):
    a, b, _ = stack.addresses
    stack.answer_with([a, b])

    async def scenario():
        started = asyncio.Event()
        held = asyncio.create_task(call(stack.gateway, token_request([5, 6, 7], 8), timeout=30,
                                        on_message=lambda msg, reply: started.set()))
        await asyncio.wait_for(started.wait(), 10)
        [victim] = [address for address, w in zip(stack.addresses, stack.workers, strict=True)
                    if w.running and address in (a, b)]
        stay = b if victim == a else a
        stack.answer_with([stay])
        new = {(await call(stack.gateway, token_request([20 + i, 11, 12], 1), timeout=10)).last.decode_worker
               for i in range(4)}
        still_open = stack.retired()
        stack.release(victim)
        return victim, stay, new, still_open, await held

    victim, stay, new, still_open, reply = asyncio.run(scenario())
    assert new == {stay}, "no new request goes to the worker gone from DNS"
    assert still_open == [victim], "its channel stays open while its stream runs"
    assert reply.code == grpc.StatusCode.OK, reply.details
    assert len(reply.tokens) == 8 and reply.last.decode_worker == victim, "the stream in flight was not cut"
    assert wait_until(lambda: stack.retired() == [], 5), "its channel is closed once nothing runs on it"


def test_a_failing_or_empty_answer_keeps_the_last_addresses(stack, caplog):
    _, b, c = stack.addresses
    stack.answer_with([b, c])
    caplog.set_level(logging.WARNING, logger="tandem.gateway.workers")
    nxdomain = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    for error, addresses in ((nxdomain, [b, c]), (None, [])):
        asked = stack.answer.calls
        stack.answer.error, stack.answer.addresses = error, addresses
        assert wait_until(lambda asked=asked: stack.answer.calls >= asked + 3, 5), "resolved again and again"
        assert sorted(stack.routable()) == sorted([b, c])
        assert served_by(stack, 4) == {b, c}
    warnings = [r.getMessage() for r in caplog.records if "do not resolve" in r.getMessage()]
    assert len(warnings) == 2, "one warning per change, not one per resolution"
    assert "Name or service not known" in warnings[0] and "no addresses" in warnings[1]
    assert all("keeping the 2 addresses known" in w for w in warnings)
    stack.answer_with([b, c])


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
