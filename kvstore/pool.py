"""The store node's preallocated block pool: slots, reservations, commits, leases, LRU eviction.

All bookkeeping of one store node, no I/O: the service moves bytes in and out of
``buffer`` and calls these methods around the transfers. A slot is in exactly one
state: free, reserved (a writer is filling it; never served), committed (visible
under its key; served), or committed and leased (served, never evicted).

Eviction is LRU over committed slots that no lease holds; capacity is a hard limit:
a reservation that cannot be met even after evicting everything evictable fails.

Every reservation and lease carries a data-plane capability: a random 128-bit token
(``token_of``) that the control plane hands to its holder. The UCX data plane asks
``begin_transfer`` before it moves a byte: a write needs the token of an open, unexpired
reservation holding every slot written, a read the token of a held, unexpired lease
covering every slot read. A token dies with its reservation (commit, cancel, expiry) or
lease (release, expiry). A transfer in flight pins what it was granted until
``end_transfer``: a lease released meanwhile keeps its blocks, a reservation cancelled or
expired meanwhile keeps its slots, so no slot changes hands under a transfer.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from engine.kv_blocks import BlockRef, PartialRef

TOKEN_BYTES = 16  # a data-plane capability: 128 random bits


class CapacityError(Exception):
    """Not enough free or evictable slots: the caller gets RESOURCE_EXHAUSTED."""


class UnknownHandleError(KeyError):
    """A reservation or lease id that does not exist (any more): NOT_FOUND."""


@dataclass(slots=True)
class Stored:
    key: BlockRef
    length: int
    checksum: int
    expires: float | None = None  # partial blocks only
    leases: int = 0
    head_checksums: tuple[int, ...] = ()  # of each KV head's byte range, as committed (may be none)


@dataclass(slots=True)
class Grant:
    """A reservation (writes into its slots) or a lease (reads of its slots), and its token."""

    slots: list[int]
    expires: float
    token: bytes = b""
    allowed: frozenset[int] = frozenset()  # ``slots`` as a set: the data plane's check
    in_flight: int = 0  # data-plane transfers running under this grant now
    ended: bool = False  # committed, cancelled, released or expired: no new transfer

    def __post_init__(self) -> None:
        self.allowed = frozenset(self.slots)


class Reservation(Grant):
    __slots__ = ()


class Lease(Grant):
    __slots__ = ()


@dataclass(slots=True)
class PoolStats:
    evictions: int = 0
    expired_partials: int = 0
    expired_reservations: int = 0
    expired_leases: int = 0
    commits: int = 0
    refused_transfers: int = 0  # data-plane transfers without a valid token for their slots


@dataclass(slots=True)
class Commit:
    slot: int
    key: BlockRef
    length: int
    checksum: int
    head_checksums: tuple[int, ...] = ()


@dataclass(slots=True)
class Evicted:
    """Keys that left the pool: the service removes them from the index."""

    keys: list[bytes] = field(default_factory=list)


class BlockPool:
    def __init__(
        self,
        capacity_bytes: int,
        block_bytes: int,
        partial_ttl_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        memory: np.ndarray | None = None,
    ) -> None:
        """``memory``: where the slots live (flat uint8, at least ``capacity_bytes`` long; the store passes
        memory that readers on its host can map); private memory when None."""
        if block_bytes < 1:
            raise ValueError(f"block_bytes must be >= 1, got {block_bytes}")
        self.num_slots = capacity_bytes // block_bytes
        if self.num_slots < 1:
            raise ValueError(f"capacity {capacity_bytes} bytes holds no block of {block_bytes} bytes")
        self.block_bytes = block_bytes
        size = self.num_slots * block_bytes
        if memory is None:
            memory = np.empty(size, dtype=np.uint8)
        elif memory.dtype != np.uint8 or memory.ndim != 1 or memory.size < size:
            raise ValueError(f"pool memory must be flat uint8 of at least {size} bytes")
        self.buffer = memory[:size].reshape(self.num_slots, block_bytes)
        self.buffer.fill(0)  # touch every page now: first-touch faults would otherwise land on transfers
        self.partial_ttl_s = partial_ttl_s
        self.clock = clock
        self.stats = PoolStats()
        self._lock = threading.Lock()
        self._free: list[int] = list(range(self.num_slots - 1, -1, -1))
        self._stored: dict[int, Stored] = {}
        self._by_key: dict[BlockRef, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # committed, unleased, oldest use first
        self._reservations: dict[int, Reservation] = {}
        self._leases: dict[int, Lease] = {}
        self._grants: dict[bytes, Grant] = {}  # token -> open reservation or held lease
        self._ids = itertools.count(1)

    # -- writers -------------------------------------------------------------------------------

    def reserve(self, n: int, ttl_s: float) -> tuple[int, list[int], Evicted]:
        """Slots for ``n`` blocks, evicting LRU blocks when needed; raises CapacityError."""
        if n < 1:
            raise ValueError(f"reserve at least one block, got {n}")
        with self._lock:
            self._expire()
            evicted = Evicted()
            if n > len(self._free) + len(self._lru):
                raise CapacityError(
                    f"{n} blocks requested; {len(self._free)} free and {len(self._lru)} evictable of "
                    f"{self.num_slots}"
                )
            while len(self._free) < n:
                evicted.keys += self._evict_one()
            # Sorted: consecutive slots travel as one data-plane message (kvstore.data_plane.slot_runs).
            slots = sorted(self._free.pop() for _ in range(n))
            rid = next(self._ids)
            self._reservations[rid] = self._granted(Reservation(slots, self.clock() + ttl_s))
            return rid, slots, evicted

    def reserved_slots(self, reservation_id: int) -> list[int]:
        with self._lock:
            res = self._reservations.get(reservation_id)
            if res is None:
                raise UnknownHandleError(f"reservation {reservation_id} does not exist or expired")
            return list(res.slots)

    def commit(self, reservation_id: int, commits: list[Commit]) -> list[Commit]:
        """Make written slots visible; slots of the reservation left out are freed. Returns the
        commits that were stored (a key stored already keeps its first copy)."""
        with self._lock:
            res = self._reservations.pop(reservation_id, None)
            if res is None:
                raise UnknownHandleError(f"reservation {reservation_id} does not exist or expired")
            if any(c.slot not in res.allowed for c in commits):
                self._reservations[reservation_id] = res
                raise ValueError("a commit names a slot outside its reservation")
            if res.in_flight:
                self._reservations[reservation_id] = res
                raise ValueError(f"a data-plane write into reservation {reservation_id} is still running")
            self._end(res)
            stored, used = [], set()
            for c in commits:
                if c.key in self._by_key or c.slot in used:
                    continue
                expires = self.clock() + self.partial_ttl_s if isinstance(c.key, PartialRef) else None
                self._stored[c.slot] = Stored(c.key, c.length, c.checksum, expires, head_checksums=c.head_checksums)
                self._by_key[c.key] = c.slot
                self._lru[c.slot] = None
                used.add(c.slot)
                stored.append(c)
            self._free += [s for s in res.slots if s not in used]
            self.stats.commits += len(stored)
            return stored

    def forget(self, keys: list[BlockRef]) -> None:
        """Drop stored blocks (their index entry could not be written: nobody could find them)."""
        with self._lock:
            for key in keys:
                slot = self._by_key.get(key)
                if slot is not None and self._stored[slot].leases == 0:
                    self._drop(slot)

    def cancel(self, reservation_id: int) -> None:
        with self._lock:
            res = self._reservations.pop(reservation_id, None)
            if res is not None:
                self._close(res)

    def abandon(self, grant: Grant) -> None:
        """A write under this reservation broke off mid-transfer: its writer died, or gave up and releases
        it anyway (the client never retries a reservation), so its slots go back now, not at the TTL."""
        with self._lock:
            rid = next((r for r, res in self._reservations.items() if res is grant), None)
            if rid is not None:
                self._close(self._reservations.pop(rid))

    # -- readers -------------------------------------------------------------------------------

    def find(self, keys: list[BlockRef]) -> list[tuple[int, Stored] | None]:
        with self._lock:
            out = []
            for key in keys:
                slot = self._by_key.get(key)
                out.append(None if slot is None else (slot, self._stored[slot]))
            return out

    def lease(self, slots: list[int], ttl_s: float) -> int:
        """Hold committed slots against eviction until ``release`` or the lease expires."""
        with self._lock:
            for slot in slots:
                if slot not in self._stored:
                    raise UnknownHandleError(f"slot {slot} holds no committed block")
            for slot in slots:
                entry = self._stored[slot]
                entry.leases += 1
                self._lru.pop(slot, None)
            lid = next(self._ids)
            self._leases[lid] = self._granted(Lease(list(slots), self.clock() + ttl_s))
            return lid

    def release(self, lease_id: int) -> None:
        with self._lock:
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                raise UnknownHandleError(f"lease {lease_id} does not exist or expired")
            self._close(lease)

    def token_of(self, handle: int) -> bytes:
        """The data-plane token of a reservation or lease id."""
        with self._lock:
            grant = self._reservations.get(handle) or self._leases.get(handle)
            if grant is None:
                raise UnknownHandleError(f"reservation or lease {handle} does not exist or expired")
            return grant.token

    def touch(self, slots: list[int]) -> None:
        """A read: move the blocks to the most recently used end."""
        with self._lock:
            for slot in slots:
                if slot in self._lru:
                    self._lru.move_to_end(slot)

    def drop_partials(self, request_id: str) -> int:
        """The decode worker pulled a request's partial blocks: they are never shared, free them
        (a leased one when its leases end: it expires at the next ``expire``)."""
        with self._lock:
            keys = [k for k in self._by_key if isinstance(k, PartialRef) and k.request_id == request_id]
            now = self.clock()
            for key in keys:
                slot = self._by_key[key]
                if self._stored[slot].leases:
                    self._stored[slot].expires = now
                else:
                    self._drop(slot)
            return len(keys)

    # -- the data plane's capability check ----------------------------------------------------

    def begin_transfer(self, token: bytes, slots: Iterable[int], write: bool) -> Grant | None:
        """The grant a data-plane transfer runs under, or None (refused, and counted).

        A write needs the token of an open, unexpired reservation holding every slot in
        ``slots``; a read, the token of a held, unexpired lease covering every one. One dict
        lookup and one set test. The grant stays pinned until ``end_transfer``.
        """
        with self._lock:
            grant = self._grants.get(token)
            if (grant is None or isinstance(grant, Reservation) is not write or grant.expires <= self.clock()
                    or not grant.allowed.issuperset(slots)):
                self.stats.refused_transfers += 1
                return None
            grant.in_flight += 1
            return grant

    def end_transfer(self, grant: Grant) -> None:
        """The transfer is over; what ended under it (released, cancelled, expired) is let go now."""
        with self._lock:
            grant.in_flight -= 1
            if grant.in_flight == 0 and grant.ended:
                self._let_go(grant)

    def refuse_transfer(self) -> None:
        """Count a transfer the data plane refused before asking (a malformed header)."""
        with self._lock:
            self.stats.refused_transfers += 1

    # -- upkeep --------------------------------------------------------------------------------

    def expire(self) -> None:
        with self._lock:
            self._expire()

    def _expire(self) -> None:
        """Reservations, leases and partial blocks past their time (partials are not in the index)."""
        now = self.clock()
        for rid in [r for r, res in self._reservations.items() if res.expires <= now]:
            self._close(self._reservations.pop(rid))
            self.stats.expired_reservations += 1
        for lid in [i for i, lease in self._leases.items() if lease.expires <= now]:
            self._close(self._leases.pop(lid))
            self.stats.expired_leases += 1
        for slot in [s for s, e in self._stored.items() if e.expires is not None and e.expires <= now]:
            if self._stored[slot].leases == 0:
                self._drop(slot)
                self.stats.expired_partials += 1

    def _granted(self, grant: Grant) -> Grant:
        token = secrets.token_bytes(TOKEN_BYTES)
        while token in self._grants or not any(token):  # all zeros is what a peer without a token sends
            token = secrets.token_bytes(TOKEN_BYTES)
        grant.token = token
        self._grants[token] = grant
        return grant

    def _end(self, grant: Grant) -> None:
        """No transfer may start under ``grant`` any more: its token dies."""
        grant.ended = True
        self._grants.pop(grant.token, None)

    def _close(self, grant: Grant) -> None:
        """A reservation cancelled or expired, a lease released or expired."""
        self._end(grant)
        if not grant.in_flight:
            self._let_go(grant)

    def _let_go(self, grant: Grant) -> None:
        """Free a cancelled or expired reservation's slots, or end a lease's hold on its blocks."""
        if isinstance(grant, Lease):
            self._unlease(grant)
        else:
            self._free += grant.slots

    def _unlease(self, lease: Lease) -> None:
        for slot in lease.slots:
            entry = self._stored.get(slot)
            if entry is not None:
                entry.leases -= 1
                if entry.leases == 0:
                    self._lru[slot] = None

    def _evict_one(self) -> list[bytes]:
        slot, _ = self._lru.popitem(last=False)
        key = self._stored[slot].key
        self._drop(slot)
        self.stats.evictions += 1
        return [key] if isinstance(key, bytes) else []

    def _drop(self, slot: int) -> None:
        entry = self._stored.pop(slot)
        del self._by_key[entry.key]
        self._lru.pop(slot, None)
        self._free.append(slot)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {
                "capacity_blocks": self.num_slots,
                "stored_blocks": len(self._stored),
                "free_blocks": len(self._free),
                "reserved_blocks": sum(len(r.slots) for r in self._reservations.values()),
                "leased_blocks": sum(1 for e in self._stored.values() if e.leases),
                "partial_blocks": sum(1 for e in self._stored.values() if isinstance(e.key, PartialRef)),
                "active_leases": len(self._leases),
                "active_reservations": len(self._reservations),
                "evictions": self.stats.evictions,
                "refused_transfers": self.stats.refused_transfers,
            }
