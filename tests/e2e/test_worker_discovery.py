"""Worker discovery by DNS (``dns:///HOST:PORT`` entries of ``--decode-workers``): a gateway and the real
tokenizer service in process, in front of two real aggregated workers (worker processes running the engine on
the default model, tests.e2e.inprocess.RealWorkers). Only the system's resolver is swapped
(``Gateway(resolver=...)``) for an answer the tests change; everything after the lookup is the real path:
health checks, routing, streams, channels. Parsing the entries, the real resolver, TLS names and the flags:
tests/unit/test_worker_discovery.py.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket

import grpc
import pytest
from prometheus_client import CollectorRegistry

from common.metrics import RequestMetrics
from common.service import Service, start_server
from gateway.server import SERVICE_NAME, Gateway, add_args, add_gateway_servicer
from protos import common_pb2 as cpb
from tests.e2e.pipeline import call, generate, token_request, wait_until, worker_stats
from tests.loop_thread import LoopThread
from tokenizer_svc.server import build_service
from tokenizer_svc.tokenizer import TextTokenizer

HOST, PORT = "workers.tandem.test", 50062
INTERVAL_S = "0.1"  # probes and resolutions: the tests wait a few of them
LONG_STREAM = 64  # tokens: a stream that runs on while a test removes its worker and sends others


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
    """tokenizer_svc + a gateway whose decode workers are ``dns:///HOST:PORT``, answered with real workers."""

    def __init__(self, model, workers: list[str]) -> None:
        self.loop = LoopThread()
        self.tokenizer = TextTokenizer(model)
        self.addresses = workers
        self.answer = Answer()
        self.answer.addresses = self.addresses[:1]
        self.loop.run(self._start())

    async def _start(self) -> None:
        tok = await start_server([build_service(self.tokenizer)], "127.0.0.1", 0)
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
        self.servers = [gw, tok]
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

    def close(self) -> None:
        async def stop() -> None:
            await self.core.close()
            for s in self.servers:
                await s.stop(0)

        self.loop.run(stop())
        self.loop.close()


@pytest.fixture(scope="module")
def stack(default_model, real_workers):
    s = DnsStack(default_model, real_workers.addresses(2))
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
    a, b = stack.addresses
    stack.answer_with([a])
    assert served_by(stack, 4) == {a}
    stack.answer_with([a, b])  # found, health-checked, then ready
    assert served_by(stack, 6) == {a, b}


def busy(addresses: list[str]) -> list[str]:
    """The workers with a call in progress, by their own Stats."""
    return [address for address in addresses if worker_stats(address).active_rpcs]


def test_a_worker_removed_gets_no_new_requests_and_its_stream_finishes(stack):
    a, b = stack.addresses
    stack.answer_with([a, b])
    assert wait_until(lambda: busy([a, b]) == [], 5)
    long = token_request([5, 6, 7], LONG_STREAM, sampling=cpb.SamplingParams(
        max_tokens=LONG_STREAM, temperature=0, ignore_eos=True))

    async def scenario():
        started = asyncio.Event()
        held = asyncio.create_task(call(stack.gateway, long, timeout=60,
                                        on_message=lambda msg, reply: started.set()))
        await asyncio.wait_for(started.wait(), 20)
        [victim] = busy([a, b])
        stay = b if victim == a else a
        served_before = worker_stats(victim).requests_total
        stack.answer_with([stay])
        new = {(await call(stack.gateway, token_request([20 + i, 11, 12], 1), timeout=10)).last.decode_worker
               for i in range(4)}
        still_open = stack.retired()
        running = worker_stats(victim).active_rpcs
        served_after = worker_stats(victim).requests_total
        return victim, stay, new, still_open, running, served_after - served_before, await held

    victim, stay, new, still_open, running, served, reply = asyncio.run(scenario())
    assert reply.code == grpc.StatusCode.OK, f"the stream in flight was cut: {reply.code.name}: {reply.details}"
    assert len(reply.tokens) == LONG_STREAM and reply.last.decode_worker == victim, "the stream was cut"
    assert reply.last.finish_reason == cpb.FINISH_REASON_LENGTH
    assert running == 1, f"the stream of {LONG_STREAM} tokens ended before the checks: make it longer"
    assert new == {stay} and served == 0, "no new request goes to the worker gone from DNS"
    assert still_open == [victim], "its channel stays open while its stream runs"
    assert wait_until(lambda: stack.retired() == [], 5), "its channel is closed once nothing runs on it"


def test_a_failing_or_empty_answer_keeps_the_last_addresses(stack, caplog):
    a, b = stack.addresses
    stack.answer_with([a, b])
    caplog.set_level(logging.WARNING, logger="tandem.gateway.workers")
    nxdomain = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    for error, addresses in ((nxdomain, [a, b]), (None, [])):
        asked = stack.answer.calls
        stack.answer.error, stack.answer.addresses = error, addresses
        assert wait_until(lambda asked=asked: stack.answer.calls >= asked + 3, 5), "resolved again and again"
        assert sorted(stack.routable()) == sorted([a, b])
        assert served_by(stack, 4) == {a, b}
    warnings = [r.getMessage() for r in caplog.records if "do not resolve" in r.getMessage()]
    assert len(warnings) == 2, "one warning per change, not one per resolution"
    assert "Name or service not known" in warnings[0] and "no addresses" in warnings[1]
    assert all("keeping the 2 addresses known" in w for w in warnings)
    stack.answer_with([a, b])
