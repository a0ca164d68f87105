"""The workers' side of the kvstore: ``push`` blocks into a store node and ``pull`` them back.

A push is Reserve -> UCX write into the reserved slots -> Commit with each
block's xxh3-64; a pull is Lookup with a lease -> UCX reads -> checksum check ->
Release. A block whose bytes do not match its checksum reads as a miss (the
prefix is cut there), never as data.

The store's data plane serves a transfer only under a token of that node's
(``kvstore.data_plane``): a write under its Reserve's, a read under a lease of
the node that holds the blocks. A Lookup's lease covers the answering node's
blocks only, so a pull takes the lease of every other node it reads from with a
leased Lookup there (at the node's ``control_address``); a block that node no
longer holds, or a node that cannot be reached, cuts the prefix like a miss.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import numpy as np
import xxhash

from kvstore.data_plane import DataPlaneClient
from kvstore.pool import BlockKey, PartialKey
from protos import kvstore_pb2 as pb
from protos import kvstore_pb2_grpc as pb_grpc
from tandem.service import channel


@dataclass(slots=True)
class PullResult:
    blocks: list[np.ndarray]  # the verified prefix, in order
    misses: int  # blocks asked for and not returned (not stored, or failed their checksum)


def checksum(block: np.ndarray) -> int:
    return xxhash.xxh3_64_intdigest(block)


def _commit_block(slot: int, key: BlockKey, block: np.ndarray) -> pb.CommitBlock:
    common = dict(slot=slot, length=block.nbytes, checksum=checksum(block))
    if isinstance(key, bytes):
        return pb.CommitBlock(key=key, **common)
    return pb.CommitBlock(partial=pb.PartialRef(request_id=key[0], index=key[1]), **common)


class KVStoreClient:
    def __init__(self, address: str) -> None:
        self.address = address
        self._channel = channel(address)  # mutual TLS when the worker was started with it
        self.stub = pb_grpc.KVStoreStub(self._channel)
        self.data = DataPlaneClient()
        self.last_data_address = ""
        self._peers: dict[str, tuple[grpc.aio.Channel, pb_grpc.KVStoreStub]] = {}  # other nodes, by gRPC address

    async def connect(self, timeout: float = 10.0) -> None:
        """Open the UCX endpoint to this node now: setting one up takes hundreds of milliseconds,
        which would otherwise land on the first request's time to first token."""
        res = await self.stub.Reserve(pb.ReserveRequest(num_blocks=1), timeout=timeout)
        try:
            await self.data.connect(res.data_address)
        finally:
            await self.stub.Release(pb.ReleaseRequest(reservation_id=res.reservation_id), timeout=timeout)

    async def push(self, blocks: Sequence[tuple[BlockKey, np.ndarray]], timeout: float = 30.0,
                   metadata: Sequence[tuple[str, str]] | None = None) -> int:
        """Store blocks (contiguous uint8 arrays of one block each); how many were new to the store.

        ``metadata`` goes with the control-plane calls (a trace context, so the store's spans join it).
        """
        if not blocks:
            return 0
        arrays = [np.ascontiguousarray(b).reshape(-1) for _, b in blocks]
        res = await self.stub.Reserve(pb.ReserveRequest(num_blocks=len(blocks)), timeout=timeout, metadata=metadata)
        wrong = [a.nbytes for a in arrays if a.nbytes != res.block_bytes]
        if wrong:
            await self.stub.Release(pb.ReleaseRequest(reservation_id=res.reservation_id), timeout=timeout)
            raise ValueError(f"blocks of {wrong[0]} bytes; this store holds blocks of {res.block_bytes} bytes")
        try:
            await self.data.write(res.data_address, res.token, list(res.slots), arrays)
        except (ConnectionError, PermissionError):
            await self.stub.Release(pb.ReleaseRequest(reservation_id=res.reservation_id), timeout=timeout)
            raise
        commit = [_commit_block(s, k, a) for s, (k, _), a in zip(res.slots, blocks, arrays, strict=True)]
        done = await self.stub.Commit(pb.CommitRequest(reservation_id=res.reservation_id, blocks=commit),
                                      timeout=timeout, metadata=metadata)
        self.last_data_address = res.data_address
        return done.committed

    async def pull(
        self, keys: Sequence[bytes], partials: Sequence[PartialKey] = (), timeout: float = 30.0,
        metadata: Sequence[tuple[str, str]] | None = None,
    ) -> PullResult:
        """The longest stored prefix of ``keys`` (then ``partials``, if every key was found)."""
        refs = [pb.PartialRef(request_id=r, index=i) for r, i in partials]
        found = await self.stub.Lookup(pb.LookupRequest(keys=list(keys), partials=refs, lease=True), timeout=timeout,
                                       metadata=metadata)
        locations = list(found.blocks)
        if len(locations) == len(keys):
            locations += list(found.partials)[: len(partials)]
        tokens = {found.node_id: found.lease_token}  # node id -> the token its reads go under
        remote: list[tuple[pb_grpc.KVStoreStub, int]] = []  # leases taken on other nodes
        try:
            locations = await self._lease_elsewhere(locations, found.node_id, tokens, remote, timeout, metadata)
            blocks = await self._read(locations, tokens)
        finally:
            await asyncio.gather(*(_release(stub, lease, timeout, metadata) for stub, lease in remote))
            if found.lease_id:
                await self.stub.Release(pb.ReleaseRequest(lease_id=found.lease_id), timeout=timeout,
                                        metadata=metadata)
        verified = []
        for loc, block in zip(locations, blocks, strict=True):
            if checksum(block[: loc.length]) != loc.checksum:
                break
            verified.append(block[: loc.length])
        return PullResult(verified, len(keys) + len(partials) - len(verified))

    async def _lease_elsewhere(
        self, locations: list[pb.BlockLocation], here: str, tokens: dict[str, bytes],
        leases: list[tuple[pb_grpc.KVStoreStub, int]], timeout: float, metadata: Sequence[tuple[str, str]] | None,
    ) -> list[pb.BlockLocation]:
        """Lease the blocks held by nodes other than ``here`` from those nodes (adding their tokens
        and leases); the prefix of ``locations`` up to the first block that could not be leased."""
        elsewhere: dict[str, list[int]] = defaultdict(list)
        for i, loc in enumerate(locations):
            if loc.node_id != here:
                elsewhere[loc.node_id].append(i)
        if not elsewhere:
            return locations
        answers = await asyncio.gather(*(self._lease_on([locations[i] for i in idx], timeout, metadata)
                                         for idx in elsewhere.values()))
        cut = len(locations)
        for (node, idx), answer in zip(elsewhere.items(), answers, strict=True):
            if answer is None:
                cut = min(cut, idx[0])
                continue
            stub, found = answer
            if found.lease_id:
                leases.append((stub, found.lease_id))
            tokens[node] = found.lease_token
            held = {b.key: b for b in found.blocks if b.node_id == node}
            for i in idx:
                loc = held.get(locations[i].key)
                if loc is None:  # evicted (or moved) since the first Lookup: a miss from here on
                    cut = min(cut, i)
                    break
                locations[i] = loc
        return locations[:cut]

    async def _lease_on(
        self, locations: list[pb.BlockLocation], timeout: float, metadata: Sequence[tuple[str, str]] | None,
    ) -> tuple[pb_grpc.KVStoreStub, pb.LookupResponse] | None:
        """A leased Lookup of ``locations`` (all on one node) at that node; None if it cannot answer."""
        address = locations[0].control_address
        if not address:
            return None  # the node does not advertise its control plane: its blocks cannot be leased
        stub = self._peer(address)
        try:
            return stub, await stub.Lookup(pb.LookupRequest(keys=[loc.key for loc in locations], lease=True),
                                           timeout=timeout, metadata=metadata)
        except grpc.aio.AioRpcError:  # down, or gone from the index: its blocks read as misses
            return None

    def _peer(self, address: str) -> pb_grpc.KVStoreStub:
        if address == self.address:
            return self.stub
        if address not in self._peers:
            peer = channel(address)
            self._peers[address] = (peer, pb_grpc.KVStoreStub(peer))
        return self._peers[address][1]

    async def _read(self, locations: list[pb.BlockLocation], tokens: dict[str, bytes]) -> list[np.ndarray]:
        size = max((loc.length for loc in locations), default=0)
        out = [np.empty(size, dtype=np.uint8) for _ in locations]
        by_node: dict[tuple[str, str], list[int]] = defaultdict(list)
        for i, loc in enumerate(locations):
            by_node[loc.node_id, loc.data_address].append(i)
        for (node, address), idx in by_node.items():
            await self.data.read(address, tokens.get(node, b""), [locations[i].slot for i in idx],
                                 [out[i] for i in idx])
        return out

    async def drop_partials(self, request_id: str, timeout: float = 10.0) -> None:
        await self.stub.Release(pb.ReleaseRequest(drop_partials_of=request_id), timeout=timeout)

    async def stats(self, timeout: float = 10.0) -> pb.StatsResponse:
        return await self.stub.Stats(pb.StatsRequest(), timeout=timeout)

    async def close(self) -> None:
        await self.data.close()
        for peer, _ in self._peers.values():
            await peer.close()
        self._peers.clear()
        await self._channel.close()


async def _release(stub: pb_grpc.KVStoreStub, lease_id: int, timeout: float,
                   metadata: Sequence[tuple[str, str]] | None) -> None:
    """End a lease taken on another node; one that cannot be reached lets it expire."""
    with contextlib.suppress(grpc.aio.AioRpcError):
        await stub.Release(pb.ReleaseRequest(lease_id=lease_id), timeout=timeout, metadata=metadata)
