"""The kvstore's gRPC control plane: Lookup, Reserve, Commit, Release, Stats over one node's pool.

Errors follow ARCHITECTURE.md (``STATUSES``, which the server's status interceptor applies): bad input
is INVALID_ARGUMENT, a full store is RESOURCE_EXHAUSTED, an unknown lease or reservation is NOT_FOUND,
an index that cannot be reached (Redis down) is UNAVAILABLE. Index calls may block on the network, so
they run in a worker thread, never on the event loop.

Reserve and a leased Lookup hand out the data plane's tokens (``kvstore.pool``): a
lease, and so its token, covers this node's blocks only. A node advertises its
gRPC address next to its UCX address in the index (``node_address``), so that a
reader of blocks on another node can take that node's lease there.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc
import xxhash
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from common import telemetry
from common.status import DEFAULT_STATUSES, outcome
from engine.kv_blocks import BlockRef, PartialRef
from kvstore.index import BlockIndex, IndexEntry, IndexUnavailableError, check_key, check_keys
from kvstore.pool import BlockPool, CapacityError, Commit, UnknownHandleError
from protos import kvstore_pb2 as pb
from protos import kvstore_pb2_grpc as pb_grpc

MAX_KEYS = 65536
STATUSES = DEFAULT_STATUSES.extend({
    CapacityError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    UnknownHandleError: lambda exc: (grpc.StatusCode.NOT_FOUND, str(exc.args[0])),  # a KeyError's str quotes
    IndexUnavailableError: grpc.StatusCode.UNAVAILABLE,
})


@dataclass(slots=True)
class Counters:
    lookups: int = 0
    hit_blocks: int = 0
    miss_blocks: int = 0
    bytes_in: int = 0
    bytes_out: int = 0


def _rpc(method: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Trace a call made on behalf of a traced request (a trace context in its metadata) as a
    ``kvstore.<method>`` span in that request's trace, ending with the status the call ends with;
    other calls are not traced. (The server's interceptor turns the exceptions into that status.)
    """
    span_name = f"kvstore.{method.__name__.lower()}"

    @functools.wraps(method)
    async def wrapper(self: KVStoreService, request: Any, context: grpc.aio.ServicerContext) -> Any:
        parent = telemetry.incoming(context.invocation_metadata())
        if not trace.get_current_span(parent).get_span_context().is_valid:
            return await method(self, request, context)
        span = telemetry.tracer().start_span(span_name, context=parent, kind=SpanKind.SERVER)
        try:
            return await method(self, request, context)
        except BaseException as exc:
            telemetry.fail(span, *outcome(exc, context, STATUSES))
            raise
        finally:
            span.end()

    return wrapper


def node_address(data_address: str, control_address: str = "") -> str:
    """What a node registers in the index: its UCX address, then its gRPC address if it has one."""
    return f"{data_address} {control_address}" if control_address else data_address


def split_node_address(address: str) -> tuple[str, str]:
    """(UCX address, gRPC address or "") of what a node registered."""
    data, _, control = address.partition(" ")
    return data, control


def _check_keys(keys: list[bytes]) -> list[bytes]:
    if len(keys) > MAX_KEYS:
        raise ValueError(f"at most {MAX_KEYS} keys per call, got {len(keys)}")
    return check_keys(keys)


class KVStoreService(pb_grpc.KVStoreServicer):
    def __init__(
        self,
        pool: BlockPool,
        index: BlockIndex,
        node_id: str,
        data_address: str,
        lease_ttl_s: float = 30.0,
        reserve_ttl_s: float = 30.0,
        control_address: str = "",
        pool_id: bytes = b"",
        pool_map: bytes = b"",
    ) -> None:
        self.pool = pool
        self.index = index
        self.node_id = node_id
        self.data_address = data_address
        self.control_address = control_address  # this node's gRPC address, as other nodes' readers reach it
        self.lease_ttl_s = lease_ttl_s
        self.reserve_ttl_s = reserve_ttl_s
        self.pool_id = pool_id  # names this pool: a reader's mapping of an earlier one is stale
        self.pool_map = pool_map  # the pool's UCX shared-memory descriptor (kvstore.ucp_memory), or b""
        self.counters = Counters()

    @property
    def node_address(self) -> str:
        """What this node registers in the index (``register_node``)."""
        return node_address(self.data_address, self.control_address)

    async def _index(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args)

    @_rpc
    async def Lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext) -> pb.LookupResponse:
        keys = _check_keys(list(request.keys))
        entries: list[IndexEntry] = await self._index(self.index.lookup, keys) if keys else []
        entries, heads = self._still_here(entries)
        addresses: dict[str, str] = await self._index(self.index.nodes) if entries else {}
        blocks = [self._location(e, addresses.get(e.node_id, ""), h) for e, h in zip(entries, heads, strict=True)]
        partials = self._partials(request.partials)
        self.counters.lookups += 1
        self.counters.hit_blocks += len(blocks)
        self.counters.miss_blocks += len(keys) - len(blocks)
        lease_id, token = 0, b""
        local = [b.slot for b in blocks + partials if b.node_id == self.node_id]
        if request.lease and local:
            lease_id = self.pool.lease(local, request.lease_ttl_s or self.lease_ttl_s)
            token = self.pool.token_of(lease_id)
            self.pool.touch(local)
        return pb.LookupResponse(blocks=blocks, partials=partials, lease_id=lease_id, lease_token=token,
                                 node_id=self.node_id, pool_id=self.pool_id,
                                 pool_map=self.pool_map if request.map_pool else b"")

    def _still_here(self, entries: list[IndexEntry]) -> tuple[list[IndexEntry], list[tuple[int, ...]]]:
        """Cut the prefix at a local block the pool no longer holds (evicted after the index answered);
        with each block's head checksums, which only the node that holds it knows (the index has none)."""
        local = self.pool.find([e.key for e in entries])
        heads = []
        for i, (e, hit) in enumerate(zip(entries, local, strict=True)):
            if e.node_id != self.node_id:
                heads.append(())
                continue
            if hit is None or hit[0] != e.slot:
                return entries[:i], heads
            heads.append(hit[1].head_checksums)
        return entries, heads

    def _location(self, e: IndexEntry, address: str, head_checksums: tuple[int, ...]) -> pb.BlockLocation:
        if e.node_id == self.node_id:
            data, control = self.data_address, self.control_address
        else:
            data, control = split_node_address(address)
        return pb.BlockLocation(key=e.key, node_id=e.node_id, data_address=data, control_address=control,
                                slot=e.slot, length=e.length, checksum=e.checksum, head_checksums=head_checksums)

    def _partials(self, refs: Iterable[pb.PartialRef]) -> list[pb.BlockLocation]:
        found = self.pool.find([PartialRef(r.request_id, r.index) for r in refs])
        return [
            pb.BlockLocation(node_id=self.node_id, data_address=self.data_address,
                             control_address=self.control_address, slot=slot, length=s.length, checksum=s.checksum,
                             head_checksums=s.head_checksums)
            for hit in found
            if hit is not None
            for slot, s in [hit]
        ]

    @_rpc
    async def Reserve(self, request: pb.ReserveRequest, context: grpc.aio.ServicerContext) -> pb.ReserveResponse:
        rid, slots, evicted = self.pool.reserve(request.num_blocks, request.ttl_s or self.reserve_ttl_s)
        if evicted.keys:
            await self._index(self.index.remove, self.node_id, evicted.keys)
        return pb.ReserveResponse(
            reservation_id=rid,
            slots=slots,
            node_id=self.node_id,
            data_address=self.data_address,
            block_bytes=self.pool.block_bytes,
            token=self.pool.token_of(rid),
        )

    @_rpc
    async def Commit(self, request: pb.CommitRequest, context: grpc.aio.ServicerContext) -> pb.CommitResponse:
        slots = set(self.pool.reserved_slots(request.reservation_id))
        commits, rejected = [], 0
        for b in request.blocks:
            if b.slot not in slots:
                raise ValueError(f"slot {b.slot} is not part of reservation {request.reservation_id}")
            if not 0 < b.length <= self.pool.block_bytes:
                raise ValueError(f"block length {b.length} is outside (0, {self.pool.block_bytes}]")
            key = self._commit_key(b)
            whole = self._verified(b)
            if whole is None:
                rejected += 1  # the bytes in the slot are not what the writer meant: never serve them
                continue
            commits.append(Commit(b.slot, key, b.length, whole, tuple(b.head_checksums)))
        stored = self.pool.commit(request.reservation_id, commits)
        full = [IndexEntry(c.key, self.node_id, c.slot, c.length, c.checksum) for c in stored
                if isinstance(c.key, bytes)]
        if full:
            try:
                await self._index(self.index.commit, full)
            except IndexUnavailableError:
                self.pool.forget([e.key for e in full])
                raise
        self.counters.bytes_in += sum(c.length for c in stored)
        return pb.CommitResponse(committed=len(stored), rejected=rejected)

    def _verified(self, b: pb.CommitBlock) -> int | None:
        """The block's whole checksum if its bytes match what the writer committed, else None.

        Writers that each wrote some heads (tensor-parallel ranks) commit only head checksums: the
        whole one, which whole-block readers and the index use, is computed here from the bytes.
        """
        block = self.pool.buffer[b.slot, : b.length]
        heads = len(b.head_checksums)
        if heads:
            if b.length % heads:
                raise ValueError(f"a block of {b.length} bytes does not split into {heads} equal heads")
            size = b.length // heads
            if any(xxhash.xxh3_64_intdigest(block[h * size : (h + 1) * size]) != c
                   for h, c in enumerate(b.head_checksums)):
                return None
        whole = xxhash.xxh3_64_intdigest(block)
        if b.checksum != whole and (b.checksum or not heads):
            return None
        return whole

    def _commit_key(self, b: pb.CommitBlock) -> BlockRef:
        if b.key:
            return check_key(b.key)
        if not b.partial.request_id:
            raise ValueError("a committed block needs a 32-byte key or a partial (request id, index)")
        return PartialRef(b.partial.request_id, b.partial.index)

    @_rpc
    async def Release(self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext) -> pb.ReleaseResponse:
        if not (request.lease_id or request.reservation_id or request.drop_partials_of):
            raise ValueError("Release needs a lease_id, a reservation_id or drop_partials_of")
        if request.reservation_id:
            self.pool.cancel(request.reservation_id)
        if request.drop_partials_of:
            self.pool.drop_partials(request.drop_partials_of)
        if request.lease_id:
            self.pool.release(request.lease_id)
        return pb.ReleaseResponse()

    @_rpc
    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        snap = self.pool.snapshot()
        c = self.counters
        return pb.StatsResponse(
            node_id=self.node_id,
            block_bytes=self.pool.block_bytes,
            lookups=c.lookups,
            hit_blocks=c.hit_blocks,
            miss_blocks=c.miss_blocks,
            bytes_in=c.bytes_in,
            bytes_out=c.bytes_out,
            **snap,
        )
