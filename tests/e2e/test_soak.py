"""A bounded soak: `tandem up` (Redis index, 2 prefill, 2 decode) under steady load while a decode
worker, a prefill worker and the kvstore node are killed and restarted and Redis is paused.

Every request must either complete with the exact text the in-process engine gives (greedy, and
seeded sampling) or fail with a clear status; afterwards no service holds blocks, leases, streams
or partial blocks, and no process has grown past its memory bound. ``TANDEM_SOAK_SECONDS`` sets
how long the load runs (default 120 s: each of the four faults at least twice).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import pytest

from engine import Engine, SamplingParams
from protos import common_pb2 as cpb
from tandem.launcher import Cluster, ClusterConfig
from tandem.redis_server import RedisServer
from tests.e2e.pipeline import WORKER_ARGS, call, token_request, wait_clean
from tokenizer_svc.tokenizer import TextTokenizer

SOAK_SECONDS = float(os.environ.get("TANDEM_SOAK_SECONDS", "120"))
CLIENTS = 4
MAX_TOKENS = 20
# What a request may end with besides OK while faults are injected: clear statuses, never a wrong answer.
CLEAR = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}
RSS_BOUND_MB = {"gateway": 150, "tokenizer": 100, "kvstore": 150, "prefill": 400, "decode": 400}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Load:
    """Clients in a thread of their own (the main thread injects faults), each sending one request
    after another from a pool whose answers are known."""

    def __init__(self, address: str, pool: list[tuple[list[int], SamplingParams, list[int]]]) -> None:
        self.address = address
        self.pool = pool
        self.outcomes: Counter[str] = Counter()
        self.wrong: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="soak-load")

    async def _run(self) -> None:
        await asyncio.gather(*(self._client(i) for i in range(CLIENTS)))

    async def _client(self, i: int) -> None:
        for n in itertools.count(i):
            if self.stop.is_set():
                return
            prompt, params, want = self.pool[n % len(self.pool)]
            sampling = cpb.SamplingParams(max_tokens=params.max_tokens, temperature=params.temperature,
                                          top_p=params.top_p, ignore_eos=True)
            if params.seed is not None:
                sampling.seed = params.seed
            reply = await call(self.address, token_request(prompt, MAX_TOKENS, sampling=sampling), timeout=60)
            self.outcomes[reply.code.name] += 1
            if reply.code == grpc.StatusCode.OK and reply.tokens != want:
                self.wrong.append(f"pool[{n % len(self.pool)}]: {reply.tokens} != {want}")
            elif reply.code not in CLEAR | {grpc.StatusCode.OK}:
                self.wrong.append(f"{reply.code.name}: {reply.details}")
            elif reply.code != grpc.StatusCode.OK:
                await asyncio.sleep(0.2)  # a client backs off a little after a failure


@pytest.fixture(scope="module")
def redis():
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def pool(default_model):
    tok = TextTokenizer(default_model)
    prompts = [tok.encode_chat([{"role": "user", "content": f"Describe city number {i} in a few words."}])
               for i in range(6)]
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True) if i % 2 == 0 else
              SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, top_p=0.9, seed=i, ignore_eos=True)
              for i in range(6)]
    engine = Engine.from_model(str(default_model), kv_cache_gb=0.1)
    return list(zip(prompts, params, engine.generate(prompts, params), strict=True))


def test_soak_under_faults(default_model, redis, pool, tmp_path):
    config = ClusterConfig(num_prefill=2, num_decode=2, gateway_port=0, redis_url=redis.url, kv_capacity_gb=0.25,
                           engine_args=["--model", str(default_model), *WORKER_ARGS], log_dir=tmp_path,
                           startup_timeout=240)
    with Cluster(config) as cluster:
        cluster.wait_healthy(60)
        load = Load(cluster.gateway.address, pool)
        load.thread.start()
        time.sleep(8)  # warm: the first requests of each worker are slow
        baseline = {svc.name: rss_mb(svc.pid) for svc in cluster.services}
        faults = inject_faults(cluster, redis, SOAK_SECONDS)
        load.stop.set()
        load.thread.join(120)
        after = {svc.name: rss_mb(svc.pid) for svc in cluster.services}
        print(f"\nsoak {SOAK_SECONDS:.0f} s: requests sent {sum(load.outcomes.values())}, completed "
              f"{load.outcomes['OK']}, failed {dict((k, v) for k, v in load.outcomes.items() if k != 'OK')}; "
              f"faults injected {dict(faults)}")
        assert not load.thread.is_alive()
        assert load.wrong == [], load.wrong[:5]
        assert load.outcomes["OK"] >= sum(load.outcomes.values()) // 2, load.outcomes
        assert wait_clean(cluster, timeout=60) == []
        for svc in cluster.services:  # a restarted process is measured from its restart, not its birth
            if svc.name in baseline:
                grew = after[svc.name] - baseline[svc.name]
                assert grew < RSS_BOUND_MB[svc.kind], f"{svc.name} grew by {grew:.0f} MB"


def inject_faults(cluster: Cluster, redis: RedisServer, seconds: float) -> Counter[str]:
    """One fault every few seconds, in turn, until ``seconds`` have passed; each is undone before the next."""
    faults: Counter[str] = Counter()
    kinds = itertools.cycle(["decode", "prefill", "redis", "kvstore"])
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        kind = next(kinds)
        if kind == "redis":
            redis.pause()
            time.sleep(3)
            redis.resume()
        else:
            victim = {"decode": cluster.decode, "prefill": cluster.prefill, "kvstore": [cluster.kvstore]}[kind][0]
            victim.kill(signal.SIGKILL)
            time.sleep(1)
            cluster.restart(victim)
        faults[kind] += 1
        time.sleep(min(8.0, max(0.0, end - time.monotonic())))
    return faults
