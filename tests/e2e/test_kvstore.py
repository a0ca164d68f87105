"""The kvstore as real processes: gRPC control plane, UCX transfers on loopback, Redis index."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine import Engine, EngineConfig, RequestOptions, SamplingParams
from kvstore.client import KVStoreClient, checksum
from kvstore.connector import KVStoreConnector
from kvstore.data_plane import TransferRefusedError
from protos import kvstore_pb2 as pb
from tandem.redis_server import RedisServer
from tests.unit.test_engine_correctness import mixed_prompts, run_engine

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 8192  # one block of the tiny test Llama: 2 layers x K,V x 16 tokens x 2 heads x 16 dims x 4 bytes


class StoreNode:
    """``python -m kvstore.server`` in its own process; its ports come from the READY line."""

    def __init__(self, *args: str, block_bytes: int = BLOCK) -> None:
        cmd = [sys.executable, "-m", "kvstore.server", "--block-bytes", str(block_bytes), *args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        deadline = time.monotonic() + 30
        for line in self.proc.stdout:
            if line.startswith("KVSTORE READY"):
                fields = dict(f.split("=", 1) for f in line.split()[2:])
                self.grpc, self.data, self.node_id = fields["grpc"], fields["data"], fields["node"]
                return
            if time.monotonic() > deadline:
                break
        self.kill()
        raise RuntimeError("the kvstore process did not start")

    def kill(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(10)


def capacity(blocks: int) -> str:
    return repr(blocks * BLOCK / 2**30)


@pytest.fixture
def node():
    n = StoreNode("--capacity-gb", capacity(64))
    yield n
    n.kill()


def run(coro):
    return asyncio.run(coro)


def random_blocks(n: int, seed: int) -> list[tuple[bytes, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(rng.bytes(32), rng.integers(0, 256, BLOCK, dtype=np.uint8)) for _ in range(n)]


async def _with_client(address: str, fn, shared_memory: bool | None = None):
    client = KVStoreClient(address, shared_memory=shared_memory)
    try:
        return await fn(client)
    finally:
        await client.close()


@pytest.mark.parametrize("shared_memory", [True, False], ids=["mapped-pool", "ucx-transfers"])
def test_push_pull_round_trip_is_byte_identical(node, shared_memory):
    blocks = random_blocks(40, seed=1)

    async def go(c: KVStoreClient):
        assert await c.push(blocks) == 40
        assert await c.push(blocks[:5]) == 0  # stored already: the first copy stays
        got = await c.pull([k for k, _ in blocks])
        assert got.misses == 0 and all(np.array_equal(a, b) for a, (_, b) in zip(got.blocks, blocks, strict=True))
        assert got.in_place == (40 if shared_memory else 0)
        partial = await c.pull([blocks[0][0], os.urandom(32), blocks[1][0]])
        assert len(partial.blocks) == 1 and partial.misses == 2  # the longest prefix only
        stats = await c.stats()
        assert stats.stored_blocks == 40 and stats.active_leases == 0 and stats.reserved_blocks == 0
        # Same host: the pool was mapped and read in place, nothing went over the data plane; or the reverse.
        assert (c.mappings.mapped(node.grpc) is not None) is shared_memory
        assert stats.bytes_out == (0 if shared_memory else 41 * BLOCK)

    run(_with_client(node.grpc, go, shared_memory))


def test_blocks_travel_in_runs_of_consecutive_slots_byte_identical(node):
    """One data-plane message per run of consecutive slots: gaps in the slots (freed by a push of keys
    already stored), reads in any order, rows of one buffer or separate arrays: the bytes arrive intact."""
    rng = np.random.default_rng(7)
    rows = rng.integers(0, 256, (12, BLOCK), dtype=np.uint8)
    keys = [rng.bytes(32) for _ in range(12)]

    async def go(c: KVStoreClient):
        await c.push([(keys[i], rows[i]) for i in (0, 2, 4)])
        assert await c.push([(keys[i], rows[i]) for i in range(6)]) == 3  # the stored ones' slots go back
        assert await c.push([(keys[i], rows[i].copy()) for i in range(6, 12)]) == 6  # into the gaps
        order = [11, 3, 4, 5, 0, 7, 8, 1, 2, 6, 9, 10]
        staging = np.zeros((12, BLOCK), dtype=np.uint8)
        got = await c.pull([keys[i] for i in order], out=list(staging))
        assert got.misses == 0 and np.array_equal(staging, rows[order])
        fresh = await c.pull([keys[i] for i in order])  # separate arrays: received through one buffer per run
        assert all(np.array_equal(b, rows[i]) for b, i in zip(fresh.blocks, order, strict=True))

    run(_with_client(node.grpc, go, shared_memory=False))


def test_a_pull_fills_the_callers_buffers(node):
    blocks = random_blocks(6, seed=2)
    staging = np.zeros((8, BLOCK), dtype=np.uint8)

    async def go(c: KVStoreClient):
        await c.push(blocks)
        got = await c.pull([k for k, _ in blocks], out=list(staging))
        assert got.misses == 0 and all(np.shares_memory(b, row) for b, row in zip(got.blocks, staging, strict=False))
        assert np.array_equal(staging[:6], np.stack([b for _, b in blocks])) and not staging[6:].any()
        with pytest.raises(ValueError, match="destination"):
            await c.pull([k for k, _ in blocks], out=list(staging[:2]))
        with pytest.raises(ValueError, match="destination"):
            await c.pull([k for k, _ in blocks], out=[row[: BLOCK // 2] for row in staging])
        assert (await c.stats()).active_leases == 0  # a refused pull takes no lease... or gives it back

    run(_with_client(node.grpc, go))


def test_a_restarted_node_is_mapped_afresh_and_a_dead_ones_mapping_dropped():
    """A mapping names its pool: a node back on the same address has a new pool, never read through the
    old mapping; a node that stopped renewing its deadline has its mapping (and memory) let go."""
    from tandem.redis_server import free_port

    ports = ["--port", str(free_port()), "--data-port", str(free_port()), "--heartbeat-s", "0.1"]
    nodes = [StoreNode("--capacity-gb", capacity(16), *ports)]
    old, new = random_blocks(4, seed=11), random_blocks(4, seed=12)

    async def pull_back(c: KVStoreClient, blocks) -> None:
        await c.push(blocks)
        got = await c.pull([k for k, _ in blocks])
        assert got.misses == 0 and all(np.array_equal(a, b) for a, (_, b) in zip(got.blocks, blocks, strict=True))

    async def go(c: KVStoreClient) -> None:
        await pull_back(c, old)
        old_pool = c.mappings.mapped(c.address)
        assert old_pool is not None
        nodes[0].kill(signal.SIGKILL)
        nodes.append(StoreNode("--capacity-gb", capacity(16), *ports))
        assert (await c.pull([k for k, _ in old])).misses == 4  # the old pool's blocks died with it
        await pull_back(c, new)  # read over the data plane: the answer named a pool not mapped here
        await pull_back(c, new)  # and now through a mapping of the new pool
        assert c.mappings.mapped(c.address) not in (None, old_pool)
        nodes[1].kill(signal.SIGKILL)
        await asyncio.sleep(1.5)  # past the deadline it renewed every heartbeat (10 x 0.1 s, at least 1 s)
        c.mappings.expire()
        assert c.mappings.mapped(c.address) is None

    try:
        run(_with_client(nodes[0].grpc, go))
    finally:
        for n in nodes:
            n.kill()


def test_engine_blocks_move_between_engines_through_the_store(node, tiny_llama):
    prompts = mixed_prompts(4, 256, 10, 70, seed=40)
    max_tokens = [8, 12, 6, 10]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in max_tokens]
    reference = run_engine(Engine.from_model(str(tiny_llama), num_kv_blocks=64), prompts, max_tokens)

    producer_cfg = EngineConfig(str(tiny_llama), num_kv_blocks=64, role="producer", max_num_batched_tokens=32)
    consumer_cfg = EngineConfig(str(tiny_llama), num_kv_blocks=64, role="consumer")
    producer = Engine(producer_cfg, KVStoreConnector(node.grpc, producer_cfg))
    consumer = Engine(consumer_cfg, KVStoreConnector(node.grpc, consumer_cfg))
    try:
        firsts = {}
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            producer.add_request(p, sp, request_id=f"r{i}")
        while producer.has_unfinished():
            for out in producer.step():
                firsts[out.request_id] = out.new_token_ids[0]
        producer.connector.flush()
        outs = {}
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            options = RequestOptions(output_token_ids=[firsts[f"r{i}"]], num_external_tokens=len(p))
            consumer.add_request(p, sp, f"r{i}", options)
            outs[f"r{i}"] = [firsts[f"r{i}"]]
        while consumer.has_unfinished():
            for out in consumer.step():
                outs[out.request_id] += out.new_token_ids
        assert [outs[f"r{i}"] for i in range(4)] == reference
        assert consumer.stats.kv_load_failures == 0 and consumer.stats.prompt_tokens_computed == 0
        # Partial blocks are request-scoped: dropped once pulled; full blocks stay for reuse. The drop is sent
        # when a request ends, asynchronously: give it a moment to land.
        full_blocks = sum(len(p) // 16 for p in prompts)
        deadline = time.monotonic() + 5
        while (stats := run(_with_client(node.grpc, lambda c: c.stats()))).stored_blocks != full_blocks \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stats.active_leases == 0 and stats.reserved_blocks == 0
        assert stats.stored_blocks == full_blocks
        # Exports and pulls borrowed the engines' staging rows and gave every one back.
        assert producer.staging.high_water > 0 and consumer.staging.high_water > 0
        assert producer.staging.in_use == consumer.staging.in_use == 0
    finally:
        producer.connector.close()
        consumer.connector.close()


def test_a_load_whose_request_ends_gives_its_staging_rows_back(node, tiny_llama):
    """Aborted while its KV is on the way: the engine never polls that load, and no step may come (an idle
    worker), yet its staging rows go back, whether the pull had landed or was still in flight."""
    producer_cfg = EngineConfig(str(tiny_llama), num_kv_blocks=64, role="producer")
    consumer_cfg = EngineConfig(str(tiny_llama), num_kv_blocks=64, role="consumer")
    producer = Engine(producer_cfg, KVStoreConnector(node.grpc, producer_cfg))
    consumer = Engine(consumer_cfg, KVStoreConnector(node.grpc, consumer_cfg))
    params = SamplingParams(max_tokens=4, temperature=0)

    def start_load(seed: int) -> str:
        prompt = [seed * 7 % 250 + i % 5 for i in range(64)]  # four full blocks: nothing request-scoped
        [[first]] = producer.generate([prompt], params)
        producer.connector.flush()
        options = RequestOptions(output_token_ids=[first], num_external_tokens=len(prompt))
        rid = consumer.add_request(prompt, params, options=options)
        consumer.step()  # starts the load
        return rid

    def settles(predicate) -> bool:
        deadline = time.monotonic() + 5
        while not predicate() and time.monotonic() < deadline:
            time.sleep(0.01)
        return predicate()

    try:
        rid = start_load(1)  # landed, not polled: the result holds its rows until the request ends
        assert settles(lambda: consumer.connector.num_pending_loads == 0) and consumer.staging.in_use == 4
        consumer.abort(rid)
        assert consumer.staging.in_use == 0
        rid = start_load(2)  # in flight: given back when it lands
        consumer.abort(rid)
        assert settles(lambda: consumer.connector.num_pending_loads == 0 and consumer.staging.in_use == 0)
        assert consumer.staging.high_water == 4 and consumer.stats.kv_blocks_loaded == 0  # nothing imported
    finally:
        producer.connector.close()
        consumer.connector.close()


def test_the_connector_holds_what_it_runs_until_it_is_done(node, tiny_llama, tmp_path):
    """An event loop keeps its tasks only weakly, and a task awaiting a Unix-socket answer (its reader only
    weakly held by its protocol) is a garbage cycle: a collection mid-await destroyed a pull waiting on a rank's
    agent, a failed load. Started as ``start_load`` starts a pull, nobody else holding it, such a task must
    still finish after collections while it waits."""
    cfg = EngineConfig(str(tiny_llama), num_kv_blocks=8)
    connector = KVStoreConnector(node.grpc, cfg)
    path = str(tmp_path / "agent.sock")
    answers: list[bytes] = []

    async def ask() -> None:
        reader, writer = await asyncio.open_unix_connection(path)
        writer.write(b"ping\n")
        await writer.drain()
        answers.append(await reader.readline())
        writer.close()

    try:
        with socket.socket(socket.AF_UNIX) as server:
            server.bind(path)
            server.listen()
            connector._call(ask())  # its future dropped at once, as start_load drops it
            conn, _ = server.accept()
            with conn:
                assert conn.makefile("rb").readline() == b"ping\n"  # the task now waits for the answer
                time.sleep(0.05)
                for _ in range(3):
                    gc.collect()
                conn.sendall(b"pong\n")
                deadline = time.monotonic() + 10
                while not answers and time.monotonic() < deadline:
                    time.sleep(0.01)
        assert answers == [b"pong\n"]
    finally:
        connector.close()


def test_eviction_is_lru_and_capacity_is_never_exceeded(node):
    old, new = random_blocks(40, seed=2), random_blocks(40, seed=3)

    async def go(c: KVStoreClient):
        await c.push(old)
        await c.pull([k for k, _ in old[:10]])  # the first 10 are used again: they are the newest now
        await c.push(new)  # 80 blocks into 64 slots: 16 evicted, the least recently used
        stats = await c.stats()
        assert stats.stored_blocks == 64 and stats.evictions == 16
        assert len((await c.pull([k for k, _ in old[:10]])).blocks) == 10
        assert len((await c.pull([k for k, _ in old[10:26]])).blocks) == 0
        assert len((await c.pull([k for k, _ in new])).blocks) == 40

    run(_with_client(node.grpc, go))


def test_leases_hold_blocks_and_a_full_store_refuses(node):
    blocks = random_blocks(64, seed=4)

    async def go(c: KVStoreClient):
        await c.push(blocks)
        held = await c.stub.Lookup(pb.LookupRequest(keys=[k for k, _ in blocks[:60]], lease=True))
        assert len(held.blocks) == 60 and held.lease_id
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.stub.Reserve(pb.ReserveRequest(num_blocks=5))  # 4 evictable: never over capacity
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        await c.push(random_blocks(4, seed=5))  # the 4 unleased ones make room
        assert len((await c.pull([k for k, _ in blocks[:60]])).blocks) == 60
        await c.stub.Release(pb.ReleaseRequest(lease_id=held.lease_id))
        await c.push(random_blocks(8, seed=6))
        assert (await c.stats()).evictions == 12

    run(_with_client(node.grpc, go))


def test_checksum_mismatch_is_never_served(node):
    (key, block), = random_blocks(1, seed=7)

    async def go(c: KVStoreClient):
        res = await c.stub.Reserve(pb.ReserveRequest(num_blocks=1))
        await c.data.write(res.data_address, res.token, list(res.slots), [block])
        bad = pb.CommitBlock(slot=res.slots[0], key=key, length=BLOCK, checksum=checksum(block) ^ 1)
        done = await c.stub.Commit(pb.CommitRequest(reservation_id=res.reservation_id, blocks=[bad]))
        assert (done.committed, done.rejected) == (0, 1)
        assert (await c.pull([key])).misses == 1

    run(_with_client(node.grpc, go))


def test_the_data_plane_serves_only_transfers_under_a_valid_token(node):
    blocks = random_blocks(4, seed=11)
    keys = [k for k, _ in blocks]
    garbage = [np.full(BLOCK, 0xAB, dtype=np.uint8)]

    def out(n: int = 1) -> list[np.ndarray]:
        return [np.zeros(BLOCK, dtype=np.uint8) for _ in range(n)]

    async def go(c: KVStoreClient):
        await c.push(blocks)
        held = await c.stub.Lookup(pb.LookupRequest(keys=keys[:2], lease=True))
        mine = [loc.slot for loc in held.blocks]
        others = [loc.slot for loc in (await c.stub.Lookup(pb.LookupRequest(keys=keys))).blocks[2:]]
        res = await c.stub.Reserve(pb.ReserveRequest(num_blocks=1))
        forged, raw = os.urandom(16), c.data  # the data-plane client alone: a raw UCX peer
        refused = [
            raw.read(node.data, b"", mine, out(2)),  # no token
            raw.read(node.data, forged, mine, out(2)),
            raw.read(node.data, held.lease_token, others[:1], out()),  # a token for other slots
            raw.read(node.data, held.lease_token, [*mine, others[0]], out(3)),
            raw.read(node.data, res.token, list(res.slots), out()),  # a reservation does not read
            raw.write(node.data, b"", mine[:1], garbage),
            raw.write(node.data, forged, others[:1], garbage),
            raw.write(node.data, held.lease_token, mine[:1], garbage),  # a lease does not write
            raw.write(node.data, res.token, mine[:1], garbage),  # a reservation writes its own slots only
        ]
        for attempt in refused:
            with pytest.raises(PermissionError, match="refused"):
                await attempt
        got = out(2)
        await raw.read(node.data, held.lease_token, mine, got)  # the lease holder reads, byte for byte
        assert all(np.array_equal(x, y) for x, (_, y) in zip(got, blocks[:2], strict=True))

        # Tokens die with their reservation or lease: released, committed, expired.
        await c.stub.Release(pb.ReleaseRequest(lease_id=held.lease_id, reservation_id=res.reservation_id))
        short = await c.stub.Lookup(pb.LookupRequest(keys=keys[2:], lease=True, lease_ttl_s=0.2))
        committed = await c.stub.Reserve(pb.ReserveRequest(num_blocks=1))
        await raw.write(node.data, committed.token, list(committed.slots), garbage)
        await c.stub.Commit(pb.CommitRequest(reservation_id=committed.reservation_id, blocks=[
            pb.CommitBlock(slot=committed.slots[0], key=os.urandom(32), length=BLOCK, checksum=checksum(garbage[0]))
        ]))
        await asyncio.sleep(0.4)
        dead = [
            raw.read(node.data, held.lease_token, mine, out(2)),
            raw.write(node.data, res.token, list(res.slots), garbage),
            raw.write(node.data, committed.token, list(committed.slots), out()),
            raw.read(node.data, short.lease_token, [loc.slot for loc in short.blocks], out(2)),
        ]
        for attempt in dead:
            with pytest.raises(PermissionError):
                await attempt

        pulled = await c.pull(keys)  # nothing refused touched the pool
        assert pulled.misses == 0
        assert all(np.array_equal(x, y) for x, (_, y) in zip(pulled.blocks, blocks, strict=True))
        stats = await c.stats()
        assert stats.refused_transfers == len(refused) + len(dead) and stats.reserved_blocks == 0

    run(_with_client(node.grpc, go))


def test_malformed_requests_get_clear_status_codes(node):
    async def go(c: KVStoreClient):
        for call, code in [
            (c.stub.Lookup(pb.LookupRequest(keys=[b"short"])), grpc.StatusCode.INVALID_ARGUMENT),
            (c.stub.Reserve(pb.ReserveRequest(num_blocks=0)), grpc.StatusCode.INVALID_ARGUMENT),
            (c.stub.Release(pb.ReleaseRequest(lease_id=12345)), grpc.StatusCode.NOT_FOUND),
            (c.stub.Commit(pb.CommitRequest(reservation_id=999)), grpc.StatusCode.NOT_FOUND),
            (c.stub.Release(pb.ReleaseRequest()), grpc.StatusCode.INVALID_ARGUMENT),
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == code and err.value.details()
        with pytest.raises(ValueError, match="blocks of 5 bytes"):
            await c.push([(os.urandom(32), np.zeros(5, dtype=np.uint8))])
        assert (await c.stats()).reserved_blocks == 0

    run(_with_client(node.grpc, go))


def test_two_nodes_share_a_redis_index_and_a_dead_node_is_purged():
    with RedisServer() as redis:
        a = StoreNode("--capacity-gb", capacity(32), "--redis-url", redis.url, "--heartbeat-s", "0.2")
        b = StoreNode("--capacity-gb", capacity(32), "--redis-url", redis.url, "--heartbeat-s", "0.2")
        try:
            blocks = random_blocks(8, seed=8)
            run(_with_client(a.grpc, lambda c: c.push(blocks)))

            async def through_b(c: KVStoreClient):
                found = await c.stub.Lookup(pb.LookupRequest(keys=[k for k, _ in blocks], lease=True))
                assert [loc.node_id for loc in found.blocks] == [a.node_id] * 8
                assert {loc.control_address for loc in found.blocks} == {a.grpc} and not found.lease_id
                with pytest.raises(PermissionError):  # b's lease does not cover a's blocks
                    await c.data.read(a.data, found.lease_token, [found.blocks[0].slot], [np.empty(BLOCK, np.uint8)])
                got = await c.pull([k for k, _ in blocks])  # a's lease, taken at a; the bytes from a's pool
                assert got.misses == 0 and got.in_place == 8  # a's pool, mapped from a's answer
                assert all(np.array_equal(x, y) for x, (_, y) in zip(got.blocks, blocks, strict=True))
                over_ucx = await _with_client(b.grpc, lambda d: d.pull([k for k, _ in blocks]), shared_memory=False)
                assert over_ucx.misses == 0 and over_ucx.in_place == 0  # a's data plane, under a's token
                assert all(np.array_equal(x, y) for x, (_, y) in zip(over_ucx.blocks, blocks, strict=True))

            run(_with_client(b.grpc, through_b))
            stats = run(_with_client(a.grpc, lambda c: c.stats()))
            assert stats.active_leases == 0 and stats.refused_transfers == 1
            a.kill(signal.SIGKILL)  # no clean purge: b must notice the missing heartbeats
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                found = run(_with_client(b.grpc, lambda c: c.stub.Lookup(pb.LookupRequest(keys=[blocks[0][0]]))))
                if not found.blocks:
                    break
                time.sleep(0.2)
            assert not found.blocks  # a miss, not an error: the prefill recomputes
        finally:
            a.kill()
            b.kill()


def test_redis_down_is_unavailable_and_the_node_recovers():
    with RedisServer() as redis:
        node = StoreNode("--capacity-gb", capacity(16), "--redis-url", redis.url, "--heartbeat-s", "0.2")
        try:
            blocks = random_blocks(2, seed=9)
            run(_with_client(node.grpc, lambda c: c.push(blocks)))
            redis.stop()

            async def down(c: KVStoreClient):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await c.stub.Lookup(pb.LookupRequest(keys=[blocks[0][0]]))
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "Redis" in err.value.details()
                assert (await c.stats()).stored_blocks == 2  # the node itself keeps serving Stats

            run(_with_client(node.grpc, down))
            redis.start()
            time.sleep(0.5)  # a heartbeat re-registers the node in the fresh Redis
            again = run(_with_client(node.grpc, lambda c: c.push(random_blocks(1, seed=10))))
            assert again == 1
        finally:
            node.kill()


def test_a_stopping_node_reports_not_serving_before_it_goes(node):
    async def go() -> int:
        async with grpc.aio.insecure_channel(node.grpc) as ch:
            watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=30)
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            node.proc.send_signal(signal.SIGTERM)
            return (await watch.read()).status

    assert run(go()) == health_pb2.HealthCheckResponse.NOT_SERVING
    assert node.proc.wait(10) == 0


def _slices(rows: np.ndarray | list[np.ndarray], byte_range: tuple[int, int]) -> list[np.ndarray]:
    """Each row's ``byte_range`` slice, as views: a tensor-parallel rank's heads of each block."""
    offset, length = byte_range
    return [row[offset : offset + length] for row in rows]


def test_ranged_reads_bring_each_slots_byte_range_into_the_callers_rows(node):
    """A rank reads only its heads' byte range of each block, straight into its slice of each staging row:
    slots in runs and apart, in any order, ranges aligned or not; the rest of each row is left alone."""
    blocks = random_blocks(8, seed=21)
    keys = [k for k, _ in blocks]
    order = [0, 1, 2, 5, 7, 3, 4]  # a run, gaps, then a run after them
    ranges = [(BLOCK // 4, BLOCK // 4), (100, 3001)]

    async def go(c: KVStoreClient):
        await c.push(blocks)
        held = await c.stub.Lookup(pb.LookupRequest(keys=keys, lease=True))
        slots = [held.blocks[i].slot for i in order]
        for offset, length in ranges:
            staging = np.zeros((len(order), BLOCK), dtype=np.uint8)
            views = _slices(staging, (offset, length))
            await c.data.read(node.data, held.lease_token, slots, views, byte_range=(offset, length))
            for view, i in zip(views, order, strict=True):
                assert np.array_equal(view, blocks[i][1][offset : offset + length])
            assert not staging[:, :offset].any() and not staging[:, offset + length :].any()
        with pytest.raises(ValueError, match="contiguous 1-D uint8"):  # caught before the store hears of it
            await c.data.read(node.data, held.lease_token, slots, list(staging), byte_range=ranges[0])
        await c.stub.Release(pb.ReleaseRequest(lease_id=held.lease_id))
        stats = await c.stats()
        assert stats.refused_transfers == 0 and stats.active_leases == 0
        assert stats.bytes_out == len(order) * sum(length for _, length in ranges)

    run(_with_client(node.grpc, go))


def test_ranged_writes_of_disjoint_ranges_under_one_reservation_fill_its_blocks(node):
    """Ranks write their own heads under the reservation their rank 0 took; once every range is in, the
    commit checks and a whole-block pull returns the joined bytes."""
    rng = np.random.default_rng(22)
    rows = rng.integers(0, 256, (3, BLOCK), dtype=np.uint8)
    keys = [rng.bytes(32) for _ in rows]
    split = 3000  # unaligned: one rank's range need not be a power of two

    async def go(c: KVStoreClient):
        res = await c.stub.Reserve(pb.ReserveRequest(num_blocks=len(rows)))
        slots = list(res.slots)
        for span in [(split, BLOCK - split), (0, split)]:
            await c.data.write(res.data_address, res.token, slots, _slices(rows, span), byte_range=span)
        commits = [pb.CommitBlock(slot=s, key=k, length=BLOCK, checksum=checksum(r))
                   for s, k, r in zip(slots, keys, rows, strict=True)]
        done = await c.stub.Commit(pb.CommitRequest(reservation_id=res.reservation_id, blocks=commits))
        assert (done.committed, done.rejected) == (len(rows), 0)
        got = await c.pull(keys)  # whole blocks, over the data plane
        assert got.misses == 0 and got.in_place == 0
        assert all(np.array_equal(b, r) for b, r in zip(got.blocks, rows, strict=True))
        stats = await c.stats()
        assert stats.refused_transfers == 0 and stats.reserved_blocks == 0 and stats.bytes_out == rows.nbytes

    run(_with_client(node.grpc, go, shared_memory=False))


def test_a_ranged_transfer_outside_the_block_is_refused_and_counted(node):
    """A range past the block, an empty one or one before it is refused like a bad token (the pool is never
    asked), under a token that is valid: the lease and reservation still serve good ranges afterwards."""
    blocks = random_blocks(3, seed=23)
    keys = [k for k, _ in blocks]
    bad = [(BLOCK - 100, 200), (0, 0), (-8, 16)]

    async def go(c: KVStoreClient):
        await c.push(blocks)
        held = await c.stub.Lookup(pb.LookupRequest(keys=keys, lease=True))
        slots = [loc.slot for loc in held.blocks]
        for offset, length in bad:
            out = [np.zeros(length, dtype=np.uint8) for _ in slots]
            with pytest.raises(TransferRefusedError):
                await c.data.read(node.data, held.lease_token, slots, out, byte_range=(offset, length))
        res = await c.stub.Reserve(pb.ReserveRequest(num_blocks=1))
        with pytest.raises(TransferRefusedError):
            await c.data.write(node.data, res.token, list(res.slots), [np.ones(200, np.uint8)],
                               byte_range=(BLOCK - 100, 200))
        assert (await c.stats()).refused_transfers == len(bad) + 1
        out = [np.zeros(100, dtype=np.uint8) for _ in slots]
        await c.data.read(node.data, held.lease_token, slots, out, byte_range=(BLOCK - 100, 100))
        assert all(np.array_equal(o, b[-100:]) for o, (_, b) in zip(out, blocks, strict=True))
        await c.data.write(node.data, res.token, list(res.slots), [np.ones(100, np.uint8)], byte_range=(0, 100))
        await c.stub.Release(pb.ReleaseRequest(lease_id=held.lease_id, reservation_id=res.reservation_id))
        stats = await c.stats()
        assert stats.refused_transfers == len(bad) + 1 and stats.active_leases == stats.reserved_blocks == 0

    run(_with_client(node.grpc, go))


def test_a_ranged_read_needs_the_lease_token_of_its_slots(node):
    """The ranged ops check tokens as the whole-block ones do: a read needs a lease on every slot (no token
    and a reservation's token are refused), a write a reservation of every slot (a lease does not write)."""
    blocks = random_blocks(2, seed=24)
    keys = [k for k, _ in blocks]
    span = (BLOCK // 2, BLOCK // 4)

    def out(n: int) -> list[np.ndarray]:
        return [np.zeros(span[1], dtype=np.uint8) for _ in range(n)]

    async def go(c: KVStoreClient):
        await c.push(blocks)
        held = await c.stub.Lookup(pb.LookupRequest(keys=keys, lease=True))
        leased = [loc.slot for loc in held.blocks]
        res = await c.stub.Reserve(pb.ReserveRequest(num_blocks=1))
        data = c.data
        refused = [
            data.read(node.data, b"", leased, out(2), byte_range=span),  # no token
            data.read(node.data, res.token, list(res.slots), out(1), byte_range=span),  # a write token
            data.read(node.data, res.token, leased, out(2), byte_range=span),
            data.write(node.data, held.lease_token, leased[:1], out(1), byte_range=span),  # a lease does not write
        ]
        for attempt in refused:
            with pytest.raises(TransferRefusedError):
                await attempt
        got = out(2)
        await data.read(node.data, held.lease_token, leased, got, byte_range=span)  # the lease holder reads
        assert all(np.array_equal(g, b[span[0] : sum(span)]) for g, (_, b) in zip(got, blocks, strict=True))
        await c.stub.Release(pb.ReleaseRequest(lease_id=held.lease_id, reservation_id=res.reservation_id))
        assert (await c.stats()).refused_transfers == len(refused)

    run(_with_client(node.grpc, go))
