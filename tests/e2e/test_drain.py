"""Graceful shutdown with streams in flight: SIGTERM to the gateway stops admitting (readiness
first) and lets running streams finish; SIGTERM to a decode worker hands its streams back, and
the gateway moves them to the other worker. No stream is cut."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine import Engine, SamplingParams
from protos import common_pb2 as cpb
from tests.e2e.pipeline import Reply, call, chat_request, start_cluster, token_request, worker_stats
from tokenizer_svc.tokenizer import TextTokenizer

MAX_TOKENS = 40


@pytest.fixture(scope="module")
def cluster(default_model, tmp_path_factory):
    c = start_cluster(default_model, tmp_path_factory.mktemp("drain-logs"), mode="aggregated", num_decode=2)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def work(default_model):
    tok = TextTokenizer(default_model)
    prompts = [tok.encode_chat([{"role": "user", "content": f"Say something about the color number {i}."}])
               for i in range(4)]
    engine = Engine.from_model(str(default_model), kv_cache_gb=0.1)
    return prompts, engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))


def sampling() -> cpb.SamplingParams:
    return cpb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


async def streams_started(address: str, prompts: list[list[int]]) -> tuple[list[Reply], list[asyncio.Task]]:
    replies = [Reply() for _ in prompts]

    async def one(i: int) -> Reply:
        r = await call(address, token_request(prompts[i], MAX_TOKENS, sampling=sampling()), timeout=120,
                       on_message=lambda m, _: replies[i].messages.append(m) and False)
        return r

    tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
    while not all(len(r.messages) >= 2 for r in replies):
        assert not any(t.done() for t in tasks), [t.result().details for t in tasks if t.done()]
        await asyncio.sleep(0.05)
    return replies, tasks


def test_sigterm_to_a_decode_worker_hands_its_streams_to_the_other(cluster, work):
    prompts, expected = work

    async def run():
        _, tasks = await streams_started(cluster.gateway.address, prompts)
        victim = max(cluster.decode, key=lambda w: worker_stats(w.address).num_requests)
        victim.kill(signal.SIGTERM)
        return victim, await asyncio.gather(*tasks)

    victim, results = asyncio.run(run())
    assert [r.code for r in results] == [grpc.StatusCode.OK] * len(prompts), [r.details for r in results]
    assert [r.tokens for r in results] == expected
    assert victim.wait(20) and victim.returncode == 0, "the worker exits cleanly once its streams are handed back"
    cluster.restart(victim)


def test_sigterm_to_the_gateway_finishes_the_streams_in_flight_and_refuses_new_ones(cluster, work):
    prompts, expected = work
    gateway = cluster.gateway

    async def run():
        _, tasks = await streams_started(gateway.address, prompts)
        gateway.kill(signal.SIGTERM)
        await asyncio.sleep(0.3)
        with grpc.insecure_channel(gateway.address) as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        late = await call(gateway.address, chat_request("hi", 4), timeout=10)
        return status, late, await asyncio.gather(*tasks)

    status, late, results = asyncio.run(run())
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING, "readiness goes false first"
    assert late.code == grpc.StatusCode.UNAVAILABLE and "shutting down" in late.details
    assert [r.code for r in results] == [grpc.StatusCode.OK] * len(prompts), [r.details for r in results]
    assert [r.tokens for r in results] == expected
    start = time.monotonic()
    assert gateway.wait(30) and gateway.returncode == 0
    assert time.monotonic() - start < 30
