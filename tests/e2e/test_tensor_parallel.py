"""Tensor parallelism with real rank processes: greedy output at TP=2 (a tiny random model with 4 KV
heads), TP=3 (the default model: 9 heads, 3 KV heads) and TP=4 (KV heads replicated) equals TP=1 token
for token; KV blocks exported at one degree import at another; prefill and decode at different degrees
equal the aggregated TP=1 output; a rank's death kills its worker cleanly and its streams migrate.
"""

from __future__ import annotations

import asyncio
import gc
import glob
import math
import os
import shutil
import signal
import time
from pathlib import Path

import grpc
import pytest
import torch

from engine import Engine, EngineConfig, RequestOptions, SamplingParams
from engine.errors import EngineDeadError
from engine.kv_blocks import wire_block_shape
from engine.kv_transfer import LocalKVTransfer
from kvstore.connector import KVStoreConnector
from protos import common_pb2 as cpb
from protos import worker_pb2 as wpb
from protos import worker_pb2_grpc as wpb_grpc
from tests.conftest import _save_tiny
from tests.e2e.pipeline import (
    Reply,
    call,
    gateway_stats,
    start_cluster,
    token_request,
    wait_clean,
    wait_until,
    worker_stats,
)
from tests.e2e.test_kvstore import StoreNode

MAX_TOKENS = 40
LONG = 300  # tokens of the streams a rank dies under: long enough to be cut mid-stream
PROMPTS = [list(range(1, 40)), [7, 99, 1000, 4, 21], [500 + i for i in range(70)], [3] * 17]


@pytest.fixture(scope="module")
def tiny4(default_model, tmp_path_factory) -> Path:
    """4 heads, 4 KV heads, SmolLM2's vocabulary and tokenizer (so the pipeline can serve it)."""
    path = _save_tiny(tmp_path_factory.mktemp("tiny4"), "llama", vocab_size=49152, num_key_value_heads=4)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (default_model / name).exists():
            shutil.copy(default_model / name, path / name)
    return path


def greedy(n: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def engine(model: Path, tp: int, connector=None, **kwargs) -> Engine:
    return Engine.from_model(str(model), connector, kv_cache_gb=0.05, num_threads=1, tensor_parallel_size=tp,
                             **kwargs)


def rank_processes() -> list[Path]:
    return [cmd for cmd in Path("/proc").glob("[0-9]*/cmdline") if b"engine.parallel.rank" in _read(cmd)]


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


@pytest.fixture(scope="module")
def tiny4_reference(tiny4) -> list[list[int]]:
    return engine(tiny4, 1).generate(PROMPTS, greedy())


def test_tp2_equals_tp1_and_its_blocks_read_at_either_degree(tiny4, tiny4_reference):
    e1 = engine(tiny4, 1, max_num_batched_tokens=32)
    e2 = engine(tiny4, 2, LocalKVTransfer(), max_num_batched_tokens=32)  # a connector: a shared staging pool
    try:
        assert e2.generate(PROMPTS, greedy()) == tiny4_reference  # chunked prefill mixed with decodes
        assert e1.generate(PROMPTS, greedy()) == tiny4_reference
        ids = list(range(4))
        whole = e1.runner.export_blocks(ids)
        # Each rank wrote its heads into place (equal up to the all-reduce's order of float sums).
        assert torch.allclose(e2.runner.export_blocks(ids), whole, rtol=1e-4, atol=1e-4)
        e2.runner.import_blocks([10, 11], whole[:2])  # each rank takes its half of every block
        assert torch.equal(e2.runner.export_blocks([10, 11]), whole[:2])
        # Through the staging pool, in place: ranks read and write their heads in the rows the connector
        # pulls into and pushes from.
        rows = e2.staging.take(2)
        assert e2.runner.export_blocks([10, 11], rows.tensor) is rows.tensor
        assert torch.equal(rows.tensor, whole[:2])
        rows.tensor.copy_(whole[2:4])
        e2.runner.import_blocks([12, 13], rows.tensor)
        assert torch.equal(e2.runner.export_blocks([12, 13]), whole[2:4])
        rows.release()
        assert e2.runner.in_place_transfers == 2
    finally:
        e2.close()
    assert wait_until(lambda: not rank_processes(), 10)
    assert not glob.glob("/dev/shm/tandem-tp-*"), "no shared buffer is left behind"


def test_tp3_on_the_default_model_equals_tp1(default_model, tok):
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in
               ("What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.")]
    params = SamplingParams(max_tokens=24, temperature=0)
    want = engine(default_model, 1).generate(prompts, params)
    e3 = engine(default_model, 3, max_num_batched_tokens=48)
    try:
        assert e3.generate(prompts, params) == want
        assert "Paris" in tok.decode(want[0])
    finally:
        e3.close()


def test_kv_heads_are_replicated_when_the_degree_exceeds_them(tiny_llama):
    """4 heads and 2 KV heads at TP=4: ranks 0-1 hold KV head 0, ranks 2-3 KV head 1."""
    prompts = PROMPTS[:2]
    want = engine(tiny_llama, 1).generate([[t % 256 for t in p] for p in prompts], greedy(16))
    e4 = engine(tiny_llama, 4)
    try:
        assert [r.shard.first_kv_head for r in [e4.runner]] == [0]
        assert e4.generate([[t % 256 for t in p] for p in prompts], greedy(16)) == want
        whole = e4.runner.export_blocks([0, 1])
        assert whole.shape[1] == 2 and torch.count_nonzero(whole[:, 1]) > 0, "the owner of KV head 1 wrote it"
    finally:
        e4.close()


def test_a_degree_that_does_not_divide_the_model_is_refused(default_model):
    with pytest.raises(ValueError, match="--tensor-parallel-size 2 does not divide the model's 9 attention heads"):
        engine(default_model, 2)


def test_a_dead_rank_kills_the_engine_and_leaves_nothing_behind(tiny4):
    e2 = engine(tiny4, 2)
    died: list[str] = []
    e2.on_dead(died.append)
    e2.add_request(PROMPTS[0], greedy())
    e2.step()
    e2.runner.procs[0].kill()
    with pytest.raises(EngineDeadError, match="rank 1 died"):
        for _ in range(50):
            e2.step()
    assert died and "rank 1 died" in died[0]
    with pytest.raises(EngineDeadError):
        e2.step()
    e2.close()
    assert wait_until(lambda: not rank_processes(), 10)


@pytest.mark.parametrize("shared_memory", ["1", "0"], ids=["mapped-pool", "ucx-transfers"])
def test_each_rank_pushes_and_pulls_its_own_heads_through_the_store(tiny4, tiny4_reference, monkeypatch,
                                                                    shared_memory):
    """A producer at TP=2 pushes every block as two halves, one per rank, over each rank's own endpoint; a
    consumer at TP=2 pulls them the same way (each rank copying its half out of the store's pool in place
    when the pool is mapped on this host, else over its endpoint), and one at TP=1 pulls whole blocks
    (checked against the whole checksum the store computed from the halves): both continue exactly as TP=1
    alone."""
    monkeypatch.setenv("TANDEM_KV_SHARED_MEMORY", shared_memory)
    mc = EngineConfig(str(tiny4)).model_config
    block_bytes = math.prod(wire_block_shape(mc, 16)) * 4
    store = StoreNode("--capacity-gb", repr(256 * block_bytes / 2**30), block_bytes=block_bytes)
    params = greedy()
    engines = []

    def handed(prompt: list[int], first: int) -> RequestOptions:  # what a decode worker gets from a handoff
        return RequestOptions(output_token_ids=[first], num_external_tokens=len(prompt))

    def make(tp: int, role: str) -> Engine:
        cfg = EngineConfig(str(tiny4), role=role, kv_cache_gb=0.05, num_threads=1, tensor_parallel_size=tp,
                           max_num_batched_tokens=32)
        engines.append(Engine(cfg, KVStoreConnector(store.grpc, cfg)))
        return engines[-1]

    def produce(tag: str) -> dict[str, int]:
        """The first tokens; the blocks pushed (a partial block is kept under its request until pulled once)."""
        firsts = {}
        for i, p in enumerate(PROMPTS):
            producer.add_request(p, params, request_id=f"{tag}{i}")
        while producer.has_unfinished():
            for out in producer.step():
                firsts[out.request_id] = out.new_token_ids[0]
        producer.connector.flush()
        return firsts

    try:
        producer = make(2, "producer")
        firsts = produce("a")
        saved = producer.stats.kv_blocks_saved * block_bytes
        assert producer.connector.ranks.bytes_by_rank == {0: {"read": 0, "write": saved // 2},
                                                         1: {"read": 0, "write": saved // 2}}
        for tp, tag in ((2, "a"), (1, "b")):
            if tag == "b":
                firsts = produce(tag)
            consumer = make(tp, "consumer")
            outs = {}
            for i, p in enumerate(PROMPTS):
                rid = f"{tag}{i}"
                outs[consumer.add_request(p, params, rid, handed(p, firsts[rid]))] = [firsts[rid]]
            while consumer.has_unfinished():
                if consumer.only_loading():
                    start = time.perf_counter()
                    gc.collect()  # a pull task only weakly held could be collected mid-pull (test_kvstore checks that)
                    # Then wait: collecting on every step held the GIL the connector's threads need (pulls of 5-9 s,
                    # past their leases on a slow host); they get two thirds of the time whatever a collection costs
                    # in this process.
                    time.sleep(max(0.01, 2 * (time.perf_counter() - start)))
                for out in consumer.step():
                    outs[out.request_id] += out.new_token_ids
            assert list(outs.values()) == tiny4_reference, f"consumer at TP={tp}"
            assert consumer.stats.kv_load_failures == 0 and consumer.stats.prompt_tokens_computed == 0
            loaded = consumer.stats.kv_blocks_loaded * block_bytes
            if tp == 2:
                ranks = consumer.connector.ranks
                assert ranks.bytes_by_rank == {0: {"read": loaded // 2, "write": 0},
                                               1: {"read": loaded // 2, "write": 0}}
                in_place = consumer.stats.kv_blocks_loaded if shared_memory == "1" else 0
                assert ranks.in_place_by_rank == {0: in_place, 1: in_place}
            else:
                assert consumer.connector.ranks is None
    finally:
        for e in engines:
            e.close()
            e.connector.close()
        store.kill()
    assert wait_until(lambda: not rank_processes(), 10)


# ---- the pipeline: prefill and decode at different degrees, and a rank dying under live streams


def request(prompt: list[int], n: int = MAX_TOKENS):
    return token_request(prompt, n, sampling=cpb.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))


async def serve_all(address: str, prompts: list[list[int]]) -> list[Reply]:
    return list(await asyncio.gather(*(call(address, request(p), timeout=240) for p in prompts)))


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2)])
def test_prefill_and_decode_at_different_degrees_equal_aggregated_tp1(tiny4, tiny4_reference, tmp_path,
                                                                      prefill_tp, decode_tp):
    tp = {"prefill": ["--tensor-parallel-size", str(prefill_tp)], "decode": ["--tensor-parallel-size", str(decode_tp)]}
    cluster = start_cluster(tiny4, tmp_path, worker_args=tp)
    try:
        replies = asyncio.run(serve_all(cluster.gateway.address, PROMPTS))
        assert [r.code for r in replies] == [grpc.StatusCode.OK] * len(PROMPTS), [r.details for r in replies]
        assert [r.tokens for r in replies] == tiny4_reference
        assert all(r.last.prefill_worker and r.last.decode_worker for r in replies)
        [decode] = cluster.decode
        stats = worker_stats(decode.address)  # the prompts' KV came through the store, none failed
        assert stats.kv_blocks_loaded > 0 and stats.kv_load_failures == 0
        again = asyncio.run(serve_all(cluster.gateway.address, PROMPTS))  # prefix caching at either degree
        assert [r.tokens for r in again] == tiny4_reference
        assert [r.last.usage.cached_tokens for r in again] == [len(p) // 16 * 16 for p in PROMPTS]
        assert wait_clean(cluster) == []
    finally:
        cluster.stop()


def test_a_rank_death_fails_its_worker_and_the_streams_migrate(tiny4, tmp_path):
    want = engine(tiny4, 1).generate(PROMPTS, greedy(LONG))
    cluster = start_cluster(tiny4, tmp_path, num_decode=2,
                            worker_args={"decode": ["--tensor-parallel-size", "2"], "prefill": []})
    try:
        migrations = gateway_stats(cluster.gateway.address).migrations

        async def run():
            tasks = await streams_under_way(cluster)
            victim = max(cluster.decode, key=lambda w: worker_stats(w.address).num_requests)
            rank1 = _rank_children(victim.pid)
            assert len(rank1) == 1, "a TP=2 worker runs one rank process beside itself"
            os.kill(rank1[0], signal.SIGKILL)
            return victim, await asyncio.gather(*tasks)

        victim, replies = asyncio.run(run())
        assert [r.code for r in replies] == [grpc.StatusCode.OK] * len(PROMPTS), [r.details for r in replies]
        assert [r.tokens for r in replies] == want, "no token lost, repeated or changed"
        assert victim.wait(30) and victim.returncode == 1, "the worker exits with an error, to be restarted"
        assert gateway_stats(cluster.gateway.address).migrations > migrations
        assert wait_until(lambda: not _rank_children(victim.pid), 10), "its surviving ranks are gone too"
        assert wait_clean(cluster) == []

        # A drain at TP=2 hands the streams to the other worker, as at TP=1.
        [victim] = cluster.restart(victim)
        assert wait_until(lambda: all(w.healthy for w in gateway_stats(cluster.gateway.address).workers), 30)
        handed_back, replies = asyncio.run(drain_under_streams(cluster))
        assert handed_back > 0
        assert [r.code for r in replies] == [grpc.StatusCode.OK] * len(PROMPTS), [r.details for r in replies]
        assert [r.tokens for r in replies] == want
        assert wait_clean(cluster) == []
    finally:
        cluster.stop()


async def streams_under_way(cluster) -> list[asyncio.Task]:
    """``LONG``-token streams of every prompt, once each has its first 3 tokens (none has ended)."""
    replies = [Reply() for _ in PROMPTS]

    async def one(i: int) -> Reply:
        r = await call(cluster.gateway.address, request(PROMPTS[i], LONG), timeout=240,
                       on_message=lambda m, _: replies[i].messages.append(m) and False)
        r.messages = replies[i].messages
        return r

    tasks = [asyncio.create_task(one(i)) for i in range(len(PROMPTS))]
    deadline = time.monotonic() + 120
    while not all(len(r.tokens) >= 3 for r in replies):
        assert time.monotonic() < deadline and not any(t.done() for t in tasks)
        await asyncio.sleep(0.05)
    return tasks


async def drain_under_streams(cluster) -> tuple[int, list[Reply]]:
    tasks = await streams_under_way(cluster)
    busiest = max(cluster.decode, key=lambda w: worker_stats(w.address).num_requests)
    async with grpc.aio.insecure_channel(busiest.address) as ch:
        drained = await wpb_grpc.WorkerStub(ch).Drain(wpb.DrainRequest(), timeout=30)
    return drained.handed_back, list(await asyncio.gather(*tasks))


def _rank_children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and b"engine.parallel.rank" in _read(stat.parent / "cmdline"):
            found.append(int(stat.parent.name))
    return found

