"""Request migration with real processes: decode workers SIGKILLed or drained mid-stream, streams
that go on elsewhere token for token (greedy and seeded), the migration limit, and no leftovers.

One cluster (kvstore, tokenizer, 1 prefill, 3 decode, gateway) serves the module; workers that a
test kills are restarted on their addresses before the next one (``Cluster.restart``).
"""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine import Engine, SamplingParams
from protos import common_pb2 as cpb
from protos import worker_pb2 as wpb
from protos import worker_pb2_grpc as wpb_grpc
from tandem.launcher import ServiceSpec
from tests.e2e.pipeline import Reply, call, gateway_stats, start_cluster, token_request, wait_clean, worker_stats

# Long enough that streams are still running after a worker restart: the second-kill test restarts two
# workers while 8 streams decode on the first, and at 120 tokens they were ~100 tokens in when it went on.
MAX_TOKENS = 300


@pytest.fixture(scope="module")
def cluster(default_model, tmp_path_factory):
    c = start_cluster(default_model, tmp_path_factory.mktemp("migration-logs"), num_prefill=1, num_decode=3)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def workload(default_model, tok):
    """8 requests, half greedy and half seeded, and what the in-process engine makes of them."""
    prompts = [tok.encode_chat([{"role": "user", "content": f"Tell me a story about the number {i}."}])
               for i in range(8)]
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True) if i % 2 == 0 else
              SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, seed=100 + i, ignore_eos=True)
              for i in range(8)]
    engine = Engine.from_model(str(default_model), kv_cache_gb=0.25)
    return prompts, params, engine.generate(prompts, params)


def request_of(prompt: list[int], p: SamplingParams):
    sampling = cpb.SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p,
                                  ignore_eos=True)
    if p.seed is not None:
        sampling.seed = p.seed
    return token_request(prompt, p.max_tokens, sampling=sampling)


def healthy(cluster, address: str) -> bool:
    return any(w.address == address and w.healthy for w in gateway_stats(cluster.gateway.address).workers)


async def wait_for(predicate, timeout: float, tasks: list[asyncio.Task] = ()) -> None:
    """Until ``predicate()``; a stream that ended early fails the wait with its status."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        for t in tasks:
            if t.done():
                r = t.result()
                assert r.code == grpc.StatusCode.OK and len(r.tokens) == MAX_TOKENS, f"{r.code}: {r.details}"
        await asyncio.sleep(0.05)


def busy(workers) -> list:
    return [w for w in workers if w.alive and worker_stats(w.address).num_requests > 0]


def start_streams(cluster, workload) -> tuple[list[Reply], list[asyncio.Task]]:
    prompts, params, _ = workload
    replies = [Reply() for _ in prompts]

    async def one(i: int) -> Reply:
        r = await call(cluster.gateway.address, request_of(prompts[i], params[i]), timeout=300,
                       on_message=lambda m, _: replies[i].messages.append(m) and False)
        r.messages = replies[i].messages
        return r

    return replies, [asyncio.create_task(one(i)) for i in range(len(prompts))]


def check_complete(results: list[Reply], expected: list[list[int]]) -> None:
    assert [r.code for r in results] == [grpc.StatusCode.OK] * len(results), [r.details for r in results]
    for r, want in zip(results, expected, strict=True):
        assert r.tokens == want, "no token lost, repeated or changed"
        assert r.last.finish_reason == cpb.FINISH_REASON_LENGTH and r.last.usage.completion_tokens == MAX_TOKENS


def test_a_draining_decode_worker_hands_its_streams_to_the_others(cluster, workload):
    _, _, expected = workload
    migrations = gateway_stats(cluster.gateway.address).migrations

    async def run():
        replies, tasks = start_streams(cluster, workload)
        await wait_for(lambda: all(len(r.messages) >= 3 for r in replies), 120, tasks)
        victim = max(cluster.decode, key=lambda w: worker_stats(w.address).num_requests)
        with grpc.insecure_channel(victim.address) as ch:
            drained = wpb_grpc.WorkerStub(ch).Drain(wpb.DrainRequest(), timeout=30)
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        return victim, drained.handed_back, status, await asyncio.gather(*tasks)

    victim, handed_back, status, results = asyncio.run(run())
    assert handed_back > 0 and status == health_pb2.HealthCheckResponse.NOT_SERVING
    check_complete(results, expected)
    assert gateway_stats(cluster.gateway.address).migrations == migrations + handed_back
    assert all(r.last.decode_worker != victim.address for r in results)
    assert wait_clean(cluster) == []
    cluster.restart(victim)


def test_decode_workers_killed_mid_stream_twice_lose_no_token(cluster, workload):
    """8 streams on one worker; it is SIGKILLed, they move; one that took some is killed too."""
    _, _, expected = workload
    a, b, c = cluster.decode

    async def run():
        for w in (b, c):
            w.kill(signal.SIGKILL)
        await wait_for(lambda: [healthy(cluster, w.address) for w in (a, b, c)] == [True, False, False], 10)
        replies, tasks = start_streams(cluster, workload)
        await wait_for(lambda: all(len(r.messages) >= 3 for r in replies), 120, tasks)
        assert worker_stats(a.address).num_requests == 8, "all 8 run on the first worker"
        # Paused while b and c restart: on a fast CPU the 8 streams finished on `a` within the restart (300 tokens
        # in ~3 s on a Zen 5), leaving none to move. Should the gateway's keepalive find `a` dead first, the
        # streams move the same way, once b and c are up.
        a.kill(signal.SIGSTOP)
        cluster.restart(b, c)
        b2, c2 = cluster.decode[1], cluster.decode[2]
        await wait_for(lambda: healthy(cluster, b2.address) and healthy(cluster, c2.address), 10)
        a.kill(signal.SIGKILL)
        counts = [len(r.tokens) for r in replies]
        await wait_for(lambda: all(len(r.tokens) >= n + 4 or len(r.tokens) == MAX_TOKENS
                                   for r, n in zip(replies, counts, strict=True)), 120, tasks)
        second = busy([b2, c2])[0]
        second.kill(signal.SIGKILL)
        return await asyncio.gather(*tasks)

    migrations = gateway_stats(cluster.gateway.address).migrations
    try:
        results = asyncio.run(run())
        check_complete(results, expected)
        assert gateway_stats(cluster.gateway.address).migrations >= migrations + 9
        # A worker killed between Reserve and Commit (its pushes of generated blocks), or while it held a
        # lease, is noticed by no one: the store frees those at their TTLs (--reserve-ttl-s 10, --lease-ttl-s 30).
        assert wait_clean(cluster, timeout=45) == [], "the dead workers' blocks and leases are gone from the store"
    finally:  # the next tests want three live workers, whatever happened here
        for w in cluster.decode:
            w.kill(signal.SIGCONT)  # `a`, if a failure left it paused
        cluster.restart(*[w for w in cluster.decode if not w.alive])


def test_past_the_migration_limit_the_client_gets_unavailable(cluster, workload):
    prompts, params, _ = workload
    spec = cluster.gateway.spec
    argv = [*spec.argv, "--migration-limit", "0"]
    argv[argv.index("--port") + 1] = "0"
    [strict] = cluster.launch([ServiceSpec("gateway-limit0", "gateway-limit0", argv)])
    try:
        asyncio.run(wait_for(lambda: healthy(cluster, cluster.decode[0].address), 10))

        def kill_its_worker(msg, reply):
            if len(reply.messages) == 3:
                busy(cluster.decode)[0].kill(signal.SIGKILL)
            return False

        start = time.monotonic()
        reply = asyncio.run(call(strict.address, request_of(prompts[0], params[0]), timeout=60,
                                 on_message=kill_its_worker))
        assert reply.code == grpc.StatusCode.UNAVAILABLE and "the limit is 0" in reply.details, reply.details
        assert 3 <= len(reply.messages) < MAX_TOKENS and time.monotonic() - start < 60
    finally:
        strict.stop()
    cluster.restart(*[w for w in cluster.decode if not w.alive])


def test_with_every_decode_worker_dead_the_client_gets_unavailable_within_its_deadline(cluster, workload):
    prompts, params, _ = workload

    def kill_all(msg, reply):
        if len(reply.messages) == 3:
            for w in cluster.decode:
                w.kill(signal.SIGKILL)
        return False

    start = time.monotonic()
    reply = asyncio.run(call(cluster.gateway.address, request_of(prompts[1], params[1]), timeout=30,
                             on_message=kill_all))
    assert reply.code == grpc.StatusCode.UNAVAILABLE, reply.details
    assert "no decode worker is available" in reply.details and time.monotonic() - start < 30
