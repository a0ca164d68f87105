"""The workers' side of the kvstore: ``push`` blocks into a store node and ``pull`` them back.

A push is Reserve -> UCX write into the reserved slots -> Commit with each
block's xxh3-64; a pull is Lookup with a lease -> UCX reads -> checksum check ->
Release. A block whose bytes do not match its checksum reads as a miss (the
prefix is cut there), never as data.
"""

from __future__ import annotations

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
        self._channel = grpc.aio.insecure_channel(address)
        self.stub = pb_grpc.KVStoreStub(self._channel)
        self.data = DataPlaneClient()
        self.last_data_address = ""

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
            await self.data.write(res.data_address, list(res.slots), arrays)
        except ConnectionError:
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
        try:
            blocks = await self._read(locations)
        finally:
            if found.lease_id:
                await self.stub.Release(pb.ReleaseRequest(lease_id=found.lease_id), timeout=timeout,
                                        metadata=metadata)
        verified = []
        for loc, block in zip(locations, blocks, strict=True):
            if checksum(block[: loc.length]) != loc.checksum:
                break
            verified.append(block[: loc.length])
        return PullResult(verified, len(keys) + len(partials) - len(verified))

    async def _read(self, locations: list[pb.BlockLocation]) -> list[np.ndarray]:
        size = max((loc.length for loc in locations), default=0)
        out = [np.empty(size, dtype=np.uint8) for _ in locations]
        by_node: dict[str, list[int]] = defaultdict(list)
        for i, loc in enumerate(locations):
            by_node[loc.data_address].append(i)
        for address, idx in by_node.items():
            await self.data.read(address, [locations[i].slot for i in idx], [out[i] for i in idx])
        return out

    async def drop_partials(self, request_id: str, timeout: float = 10.0) -> None:
        await self.stub.Release(pb.ReleaseRequest(drop_partials_of=request_id), timeout=timeout)

    async def stats(self, timeout: float = 10.0) -> pb.StatsResponse:
        return await self.stub.Stats(pb.StatsRequest(), timeout=timeout)

    async def close(self) -> None:
        await self.data.close()
        await self._channel.close()
