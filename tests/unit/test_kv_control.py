"""The control plane hands out the data plane's tokens: two store nodes on one index, in-process."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import xxhash

from kvstore.client import KVStoreClient, ReadGrant, head_checksums
from kvstore.control import KVStoreService, node_address, split_node_address
from kvstore.index import MemoryIndex
from kvstore.pool import BlockPool
from protos import kvstore_pb2 as pb

BLOCK = 64


class Context:
    """The part of grpc.aio.ServicerContext the service uses."""

    def invocation_metadata(self):
        return ()

    async def abort(self, code, message):
        raise AssertionError(f"{code}: {message}")


def node(index: MemoryIndex, name: str) -> KVStoreService:
    service = KVStoreService(BlockPool(8 * BLOCK, BLOCK), index, name, f"{name}-ucx:1", control_address=f"{name}:2")
    index.register_node(name, service.node_address, ttl_s=60)
    return service


async def push(service: KVStoreService, keys: list[bytes]) -> list[int]:
    res = await service.Reserve(pb.ReserveRequest(num_blocks=len(keys)), Context())
    blocks = []
    for slot, k in zip(res.slots, keys, strict=True):
        service.pool.buffer[slot] = np.frombuffer(k * 2, dtype=np.uint8)  # what a UCX write would leave
        blocks.append(pb.CommitBlock(slot=slot, key=k, length=BLOCK,
                                     checksum=xxhash.xxh3_64_intdigest(service.pool.buffer[slot])))
    await service.Commit(pb.CommitRequest(reservation_id=res.reservation_id, blocks=blocks), Context())
    return list(res.slots)


def test_node_addresses_carry_the_control_plane_when_there_is_one():
    assert split_node_address(node_address("h:1", "h:2")) == ("h:1", "h:2")
    assert split_node_address(node_address("h:1")) == ("h:1", "")


def test_reserve_and_leased_lookup_hand_out_tokens_for_their_own_node_only():
    async def go():
        index = MemoryIndex()
        a, b = node(index, "a"), node(index, "b")
        res = await a.Reserve(pb.ReserveRequest(num_blocks=2), Context())
        assert len(res.token) == 16
        grant = a.pool.begin_transfer(res.token, list(res.slots), write=True)
        assert grant is not None and b.pool.begin_transfer(res.token, list(res.slots), write=True) is None
        a.pool.end_transfer(grant)
        await a.Release(pb.ReleaseRequest(reservation_id=res.reservation_id), Context())

        keys = [bytes([i]) * 32 for i in (1, 2, 3)]
        slots = await push(a, keys[:2]) + await push(b, keys[2:])
        via_b = await b.Lookup(pb.LookupRequest(keys=keys, lease=True), Context())
        assert via_b.node_id == "b" and [loc.node_id for loc in via_b.blocks] == ["a", "a", "b"]
        assert [(loc.data_address, loc.control_address) for loc in via_b.blocks] == \
            [("a-ucx:1", "a:2")] * 2 + [("b-ucx:1", "b:2")]
        # b's lease covers b's block only; a's blocks need a's lease, taken at a's control address.
        assert b.pool.begin_transfer(via_b.lease_token, slots[2:], write=False) is not None
        assert a.pool.begin_transfer(via_b.lease_token, slots[:2], write=False) is None
        via_a = await a.Lookup(pb.LookupRequest(keys=keys[:2], lease=True), Context())
        assert a.pool.begin_transfer(via_a.lease_token, [loc.slot for loc in via_a.blocks], write=False)
        for service in (a, b):  # each refused the other's token once
            assert (await service.Stats(pb.StatsRequest(), Context())).refused_transfers == 1

        unleased = await a.Lookup(pb.LookupRequest(keys=keys[:2]), Context())
        assert unleased.lease_id == 0 and unleased.lease_token == b""

    asyncio.run(go())


class Stub:
    """A KVStoreStub that calls a service in this process."""

    def __init__(self, service: KVStoreService) -> None:
        self.service = service

    async def Lookup(self, request, timeout=None, metadata=None):
        return await self.service.Lookup(request, Context())


def test_a_pull_through_one_node_takes_the_other_nodes_leases_there():
    async def go():
        index = MemoryIndex()
        a, b, c = node(index, "a"), node(index, "b"), node(index, "c")
        keys = [bytes([i]) * 32 for i in range(1, 6)]
        await push(a, keys[:2])
        await push(b, keys[2:3])
        await push(c, keys[3:])
        client = KVStoreClient("b:2")
        client.stub, client._peers = Stub(b), {"a:2": (None, Stub(a)), "c:2": (None, Stub(c))}

        async def locate() -> tuple[list[pb.BlockLocation], dict[str, bytes], list]:
            found = await b.Lookup(pb.LookupRequest(keys=keys, lease=True), Context())
            grants, leases = {found.node_id: ReadGrant(found.lease_token, None)}, []
            locations = await client._lease_elsewhere(list(found.blocks), "b", grants, leases, 1.0, None)
            return locations, {node: g.token for node, g in grants.items()}, leases

        locations, tokens, leases = await locate()
        assert [loc.node_id for loc in locations] == ["a", "a", "b", "c", "c"] and len(leases) == 2
        for service in (a, b, c):  # each node's token reads that node's blocks
            mine = [loc.slot for loc in locations if loc.node_id == service.node_id]
            grant = service.pool.begin_transfer(tokens[service.node_id], mine, write=False)
            assert grant is not None
            service.pool.end_transfer(grant)

        for service in (a, b, c):
            for lease in list(service.pool._leases):
                service.pool.release(lease)
        c.pool.forget([keys[4]])  # evicted between b's answer and c's: the prefix stops there
        locations, _, leases = await locate()
        assert [loc.node_id for loc in locations] == ["a", "a", "b", "c"] and len(leases) == 2

        index.register_node("a", "a-ucx:1", ttl_s=60)  # a node that does not advertise its control plane
        locations, _, leases = await locate()
        assert locations == [] and len(leases) == 1  # c's, released by pull
        await client._channel.close()

    asyncio.run(go())


def test_commit_checks_each_heads_checksum_and_the_holder_hands_them_to_readers():
    """Ranks that each wrote their heads commit head checksums only: the store checks every head, computes
    the whole block's checksum itself, and the node holding the block gives the head checksums to readers
    (a rank checks the heads it read alone); a node that does not hold the block has none to give."""

    async def go():
        index = MemoryIndex()
        a, b = node(index, "a"), node(index, "b")
        res = await a.Reserve(pb.ReserveRequest(num_blocks=3), Context())
        keys = [bytes([i]) * 32 for i in (1, 2, 3)]
        heads = []
        for slot, k in zip(res.slots, keys, strict=True):
            a.pool.buffer[slot] = np.frombuffer(k * 2, dtype=np.uint8)
            heads.append(head_checksums(a.pool.buffer[slot], 4))
        bad = list(heads[2])
        bad[3] ^= 1  # the last head's bytes are not what its rank wrote
        blocks = [pb.CommitBlock(slot=s, key=k, length=BLOCK, head_checksums=h)
                  for s, k, h in zip(res.slots, keys, [*heads[:2], bad], strict=True)]
        done = await a.Commit(pb.CommitRequest(reservation_id=res.reservation_id, blocks=blocks), Context())
        assert (done.committed, done.rejected) == (2, 1)

        here = await a.Lookup(pb.LookupRequest(keys=keys[:2]), Context())
        assert [list(loc.head_checksums) for loc in here.blocks] == heads[:2]
        assert [loc.checksum for loc in here.blocks] == [xxhash.xxh3_64_intdigest(a.pool.buffer[s])
                                                           for s in res.slots[:2]]
        elsewhere = await b.Lookup(pb.LookupRequest(keys=keys[:2]), Context())
        assert len(elsewhere.blocks) == 2 and not any(loc.head_checksums for loc in elsewhere.blocks)

        res = await a.Reserve(pb.ReserveRequest(num_blocks=1), Context())
        uneven = pb.CommitBlock(slot=res.slots[0], key=bytes([9]) * 32, length=BLOCK, head_checksums=[1, 2, 3])
        with pytest.raises(ValueError, match="does not split into 3 equal heads"):  # INVALID_ARGUMENT
            await a.Commit(pb.CommitRequest(reservation_id=res.reservation_id, blocks=[uneven]), Context())

    asyncio.run(go())
