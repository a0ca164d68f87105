"""The workers' side of the kvstore: ``push`` blocks into a store node and ``pull`` them back.

A push is Reserve -> UCX write into the reserved slots -> Commit with each
block's xxh3-64; a pull is Lookup with a lease -> reads -> checksum check ->
Release. A block whose bytes do not match its checksum reads as a miss (the
prefix is cut there), never as data. A pool on this host is read in place: the
first Lookup at a node maps its pool through UCX shared memory
(``kvstore.ucp_memory``, ``kvstore.pool_mappings``) and leased blocks are then
one copy out of it; other pools are read with UCX transfers.

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
import os
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc
import numpy as np
import xxhash

from common.service import channel
from engine.kv_blocks import BlockRef, PartialRef
from kvstore.data_plane import DataPlaneClient
from kvstore.pool_mappings import PoolMappings
from kvstore.ucp_memory import MappedRegion, shared_memory_enabled
from protos import kvstore_pb2 as pb
from protos import kvstore_pb2_grpc as pb_grpc


@dataclass(slots=True)
class ReadGrant:
    """How a pull reads one node's blocks: its lease token for the data plane, and the node's pool if
    it is mapped here (with the descriptor that maps it, for other processes of this host)."""

    token: bytes
    region: MappedRegion | None
    pool: PoolDescriptor | None = None


@dataclass(frozen=True, slots=True)
class PoolDescriptor:
    """What another process on this host needs to map a node's pool itself (``kvstore.pool_mappings``)."""

    address: str  # the node's gRPC address: names the mapping
    pool_id: bytes
    pool_map: bytes


@dataclass(slots=True)
class PullResult:
    blocks: list[np.ndarray]  # the verified prefix, in order
    misses: int  # blocks asked for and not returned (not stored, or failed their checksum)
    in_place: int = 0  # of ``blocks``, those copied out of a pool mapped here (the rest came over the data plane)


class SliceTransfers(Protocol):
    """A tensor-parallel worker's transfers: each rank moves its own KV heads' byte range of every block
    between the store and rows of the worker's shared staging pool, over its own data-plane endpoint
    (``kvstore.rank_slices``). Rows are numbers of the staging pool's rows."""

    block_bytes: int

    async def read(self, address: str, token: bytes, slots: list[int], rows: list[int],
                   expected: list[list[int]], pool: PoolDescriptor | None = None) -> list[bool]:
        """Whether each block's heads matched ``expected`` (every head's checksum, per block). ``pool``: the
        node's pool is on this host (mapped by the caller): the ranks copy their heads out of it in place."""

    async def write(self, address: str, token: bytes, slots: list[int], rows: list[int]) -> list[list[int]]:
        """Every head's checksum, per block, as the ranks that own them wrote them."""


def checksum(block: np.ndarray) -> int:
    return xxhash.xxh3_64_intdigest(block)


def _partial_pb(ref: PartialRef) -> pb.PartialRef:
    return pb.PartialRef(request_id=ref.request_id, index=ref.index)


def head_checksums(data: np.ndarray, heads: int) -> list[int]:
    """The checksum of each of ``heads`` equal byte ranges of ``data`` (one block, or a rank's slice of one)."""
    size = data.nbytes // heads
    return [checksum(data[h * size : (h + 1) * size]) for h in range(heads)]


def _commit_block(slot: int, ref: BlockRef, length: int, heads: list[int], whole: int = 0) -> pb.CommitBlock:
    """With head checksums and no whole one, the store computes the whole one (see ``Commit``)."""
    common = dict(slot=slot, length=length, checksum=whole, head_checksums=heads)
    if isinstance(ref, bytes):
        return pb.CommitBlock(key=ref, **common)
    return pb.CommitBlock(partial=_partial_pb(ref), **common)


class KVStoreClient:
    def __init__(self, address: str, shared_memory: bool | None = None) -> None:
        """``shared_memory``: read pools on this host in place (default: unless ``TANDEM_KV_SHARED_MEMORY=0``)."""
        self.address = address
        self._channel = channel(address)  # mutual TLS when the worker was started with it
        self.stub = pb_grpc.KVStoreStub(self._channel)
        self.data = DataPlaneClient()
        self.mappings = PoolMappings(shared_memory_enabled() if shared_memory is None else shared_memory)
        self.last_data_address = ""  # the data plane of the node last connected to or written to
        self._peers: dict[str, tuple[grpc.aio.Channel, pb_grpc.KVStoreStub]] = {}  # other nodes, by gRPC address
        self._pool_maps: dict[str, PoolDescriptor] = {}  # pools mapped here, by node address: ranks map them too

    async def connect(self, timeout: float = 10.0) -> None:
        """Open the UCX endpoint to this node and map its pool now: each takes hundreds of milliseconds,
        which would otherwise land on the first request's time to first token."""
        res = await self.stub.Reserve(pb.ReserveRequest(num_blocks=1), timeout=timeout)
        try:
            await self.data.connect(res.data_address)
            self.last_data_address = res.data_address
        finally:
            await self.stub.Release(pb.ReleaseRequest(reservation_id=res.reservation_id), timeout=timeout)
        found = await self.stub.Lookup(pb.LookupRequest(map_pool=self.mappings.wants_map(self.address)),
                                       timeout=timeout)
        await self._region(self.address, found)  # and map the pool, if it can

    async def push(self, blocks: Sequence[tuple[BlockRef, np.ndarray]], timeout: float = 30.0,
                   metadata: Sequence[tuple[str, str]] | None = None, heads: int = 0) -> int:
        """Store blocks (contiguous uint8 arrays of one block each); how many were new to the store.

        ``metadata`` goes with the control-plane calls (a trace context, so the store's spans join it).
        ``heads``: commit a checksum per KV head (the block split into that many equal ranges) instead of
        one for the whole block, so that tensor-parallel readers can check the heads they read alone.
        """
        if not blocks:
            return 0
        arrays = [np.ascontiguousarray(b).reshape(-1) for _, b in blocks]
        res = await self.stub.Reserve(pb.ReserveRequest(num_blocks=len(blocks)), timeout=timeout, metadata=metadata)
        try:
            wrong = [a.nbytes for a in arrays if a.nbytes != res.block_bytes]
            if wrong:
                raise ValueError(f"blocks of {wrong[0]} bytes; this store holds blocks of {res.block_bytes} bytes")
            await self.data.write(res.data_address, res.token, list(res.slots), arrays)
        except BaseException:  # a failed or cancelled write frees its slots now, not at the reservation's TTL
            await _cancel(self.stub, res.reservation_id, timeout)
            raise
        commit = [_commit_block(s, k, a.nbytes, head_checksums(a, heads)) if heads else
                  _commit_block(s, k, a.nbytes, [], checksum(a))
                  for s, (k, _), a in zip(res.slots, blocks, arrays, strict=True)]
        done = await self.stub.Commit(pb.CommitRequest(reservation_id=res.reservation_id, blocks=commit),
                                      timeout=timeout, metadata=metadata)
        self.last_data_address = res.data_address
        self.mappings.expire()  # a writer that seldom reads must not keep a dead store's pool mapped either
        return done.committed

    async def push_slices(self, refs: Sequence[BlockRef], rows: list[int], slices: SliceTransfers,
                          timeout: float = 30.0, metadata: Sequence[tuple[str, str]] | None = None) -> int:
        """Store blocks that lie in staging ``rows`` of a tensor-parallel worker, each rank writing its own
        heads (``slices``); committed with the head checksums the ranks computed. New blocks, as ``push``."""
        if not refs:
            return 0
        res = await self.stub.Reserve(pb.ReserveRequest(num_blocks=len(refs)), timeout=timeout, metadata=metadata)
        try:
            if res.block_bytes != slices.block_bytes:
                raise ValueError(f"blocks of {slices.block_bytes} bytes; this store holds blocks of "
                                 f"{res.block_bytes} bytes")
            heads = await slices.write(res.data_address, res.token, list(res.slots), rows)
        except BaseException:
            await _cancel(self.stub, res.reservation_id, timeout)
            raise
        commit = [_commit_block(s, ref, res.block_bytes, h) for s, ref, h in zip(res.slots, refs, heads, strict=True)]
        done = await self.stub.Commit(pb.CommitRequest(reservation_id=res.reservation_id, blocks=commit),
                                      timeout=timeout, metadata=metadata)
        self.last_data_address = res.data_address
        return done.committed

    async def pull(
        self, keys: Sequence[bytes], partials: Sequence[PartialRef] = (), timeout: float = 30.0,
        metadata: Sequence[tuple[str, str]] | None = None, out: Sequence[np.ndarray] | None = None,
        slices: SliceTransfers | None = None, rows: list[int] | None = None,
    ) -> PullResult:
        """The longest stored prefix of ``keys`` (then ``partials``, if every key was found).

        ``out``: where the blocks go (contiguous uint8 arrays of one block each, one per key and
        partial, e.g. rows of a staging buffer or views of a cache); the result's blocks are views of
        them. Without it, fresh arrays. With ``slices``, ``out`` is the staging pool's ``rows`` and every
        rank reads its own heads into them (checked against the holder's head checksums).
        """
        if out is not None and len(out) < len(keys) + len(partials):
            raise ValueError(f"{len(out)} destination blocks for {len(keys) + len(partials)} blocks asked for")
        refs = [_partial_pb(p) for p in partials]
        found = await self.stub.Lookup(pb.LookupRequest(keys=list(keys), partials=refs, lease=True,
                                                        map_pool=self.mappings.wants_map(self.address)),
                                       timeout=timeout, metadata=metadata)
        locations = list(found.blocks)
        if len(locations) == len(keys):
            locations += list(found.partials)[: len(partials)]
        remote: list[tuple[pb_grpc.KVStoreStub, int]] = []  # leases taken on other nodes
        try:
            out = _destinations(locations, out)
            grants = {found.node_id: await self._grant(self.address, found)}  # node id -> how its blocks are read
            locations = await self._lease_elsewhere(locations, found.node_id, grants, remote, timeout, metadata)
            if slices is not None:
                verified, mapped = await _read_slices(locations, grants, slices, rows), [False] * len(locations)
            else:
                verified, mapped = await self._read(locations, grants, out)
        finally:
            await asyncio.gather(*(_release(stub, lease, timeout, metadata) for stub, lease in remote))
            if found.lease_id:
                await _release(self.stub, found.lease_id, timeout, metadata)
            self.mappings.expire()
        n = verified.index(False) if False in verified else len(verified)  # the prefix up to a bad checksum
        blocks = [out[i][: locations[i].length] for i in range(n)]
        return PullResult(blocks, len(keys) + len(partials) - n, sum(mapped[:n]))

    async def _region(self, address: str, found: pb.LookupResponse) -> MappedRegion | None:
        """The node's pool mapped here, if it can be (see ``PoolMappings.region_for``)."""
        if found.pool_map:  # sent once per pool (``wants_map``): kept for the processes that map it after us
            self._pool_maps[address] = PoolDescriptor(address, found.pool_id, found.pool_map)
        return await self.mappings.region_for(address, found.pool_id, found.pool_map)

    async def _grant(self, address: str, found: pb.LookupResponse) -> ReadGrant:
        region = await self._region(address, found)
        pool = self._pool_maps.get(address)
        usable = region is not None and pool is not None and pool.pool_id == found.pool_id
        return ReadGrant(found.lease_token, region, pool if usable else None)

    async def _lease_elsewhere(
        self, locations: list[pb.BlockLocation], here: str, grants: dict[str, ReadGrant],
        leases: list[tuple[pb_grpc.KVStoreStub, int]], timeout: float, metadata: Sequence[tuple[str, str]] | None,
    ) -> list[pb.BlockLocation]:
        """Lease the blocks held by nodes other than ``here`` from those nodes (adding their grants
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
            grants[node] = await self._grant(locations[idx[0]].control_address, found)
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
        request = pb.LookupRequest(keys=[loc.key for loc in locations], lease=True,
                                   map_pool=self.mappings.wants_map(address))
        try:
            return stub, await stub.Lookup(request, timeout=timeout, metadata=metadata)
        except grpc.aio.AioRpcError:  # down, or gone from the index: its blocks read as misses
            return None

    def _peer(self, address: str) -> pb_grpc.KVStoreStub:
        if address == self.address:
            return self.stub
        if address not in self._peers:
            peer = channel(address)
            self._peers[address] = (peer, pb_grpc.KVStoreStub(peer))
        return self._peers[address][1]

    async def _read(self, locations: list[pb.BlockLocation], grants: dict[str, ReadGrant],
                    out: Sequence[np.ndarray]) -> tuple[list[bool], list[bool]]:
        """Fill ``out`` with the blocks at ``locations``: whether each one matched its checksum, and
        whether it was read in place.

        Blocks of a pool mapped here are copied out of it in place; the others move over the UCX
        data plane, one transfer per node.
        """
        verified = [False] * len(locations)
        mapped = [False] * len(locations)
        by_node: dict[tuple[str, str], list[int]] = defaultdict(list)
        for i, loc in enumerate(locations):
            by_node[loc.node_id, loc.data_address].append(i)
        for (node, address), idx in by_node.items():
            grant = grants.get(node, ReadGrant(b"", None))
            if grant.region is not None and await _copy_mapped(grant.region, locations, idx, out, verified):
                for i in idx:
                    mapped[i] = True
                continue
            size = max(locations[i].length for i in idx)
            await self.data.read(address, grant.token, [locations[i].slot for i in idx], [out[i][:size] for i in idx])
            for i in idx:
                verified[i] = checksum(out[i][: locations[i].length]) == locations[i].checksum
        return verified, mapped

    async def drop_partials(self, request_id: str, timeout: float = 10.0) -> None:
        await self.stub.Release(pb.ReleaseRequest(drop_partials_of=request_id), timeout=timeout)

    async def stats(self, timeout: float = 10.0) -> pb.StatsResponse:
        return await self.stub.Stats(pb.StatsRequest(), timeout=timeout)

    async def close(self) -> None:
        await self.data.close()
        self.mappings.close()
        for peer, _ in self._peers.values():
            await peer.close()
        self._peers.clear()
        await self._channel.close()


def _destinations(locations: list[pb.BlockLocation], out: Sequence[np.ndarray] | None) -> Sequence[np.ndarray]:
    """Where a pull's blocks go: the caller's arrays, checked, or fresh ones."""
    size = max((loc.length for loc in locations), default=0)
    if out is None:
        return [np.empty(size, dtype=np.uint8) for _ in locations]
    for a in out[: len(locations)]:
        if a.dtype != np.uint8 or a.ndim != 1 or not a.flags.c_contiguous or a.nbytes < size:
            raise ValueError(f"a destination block must be a contiguous 1-D uint8 array of >= {size} bytes")
    return out


# A mapped copy of this many bytes or more runs in worker threads, one per this many bytes up to
# _COPY_THREADS: numpy's copy and xxhash let go of the GIL, so the caller's event loop keeps serving its
# other transfers meanwhile, and two threads move 256 blocks 1.2-1.4x faster than one on two cores.
_COPY_CHUNK_BYTES = 8 << 20
_COPY_THREADS = min(4, os.cpu_count() or 1)


async def _copy_mapped(region: MappedRegion, locations: list[pb.BlockLocation], idx: list[int],
                       out: Sequence[np.ndarray], verified: list[bool]) -> bool:
    """Copy blocks out of a mapped pool, checksumming each while it is still in cache; False if the
    mapping was closed meanwhile (the caller reads over the data plane instead)."""

    def copy(part: list[int]) -> bool:
        with region.reading() as usable:
            if not usable:
                return False
            for i in part:
                loc = locations[i]
                block = region.block(loc.slot, loc.length)
                if block is not None:
                    dst = out[i][: loc.length]
                    np.copyto(dst, block)
                    verified[i] = checksum(dst) == loc.checksum
            return True

    threads = min(_COPY_THREADS, sum(locations[i].length for i in idx) // _COPY_CHUNK_BYTES)
    if threads == 0:
        return copy(idx)
    return all(await asyncio.gather(*(asyncio.to_thread(copy, idx[k::threads]) for k in range(threads))))


async def _read_slices(locations: list[pb.BlockLocation], grants: dict[str, ReadGrant], slices: SliceTransfers,
                       rows: list[int]) -> list[bool]:
    """Every rank reads its heads of the blocks at ``locations`` into ``rows``, one transfer per node and
    rank; a block not a whole row, or without head checksums (its writer committed none), reads as a miss."""
    verified = [False] * len(locations)
    by_node: dict[tuple[str, str], list[int]] = defaultdict(list)
    for i, loc in enumerate(locations):
        if loc.length == slices.block_bytes and loc.head_checksums:
            by_node[loc.node_id, loc.data_address].append(i)
    for (node, address), idx in by_node.items():
        grant = grants.get(node, ReadGrant(b"", None))
        ok = await slices.read(address, grant.token, [locations[i].slot for i in idx], [rows[i] for i in idx],
                               [list(locations[i].head_checksums) for i in idx], grant.pool)
        for i, good in zip(idx, ok, strict=True):
            verified[i] = good
    return verified


async def _cancel(stub: pb_grpc.KVStoreStub, reservation_id: int, timeout: float) -> None:
    with contextlib.suppress(grpc.aio.AioRpcError):
        await stub.Release(pb.ReleaseRequest(reservation_id=reservation_id), timeout=timeout)


async def _release(stub: pb_grpc.KVStoreStub, lease_id: int, timeout: float,
                   metadata: Sequence[tuple[str, str]] | None) -> None:
    """End a lease; a node that cannot be reached (or has died since) lets it expire."""
    with contextlib.suppress(grpc.aio.AioRpcError):
        await stub.Release(pb.ReleaseRequest(lease_id=lease_id), timeout=timeout, metadata=metadata)
