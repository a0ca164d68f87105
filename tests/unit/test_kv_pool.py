"""The store node's pool: reservations, commits, leases, LRU eviction and expiry, on a fake clock."""

from __future__ import annotations

import pytest

from kvstore.pool import BlockPool, CapacityError, Commit, UnknownHandleError


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def key(i: int) -> bytes:
    return bytes([i]) * 32


def store(pool: BlockPool, keys: list, ttl: float = 10.0) -> list[int]:
    rid, slots, _ = pool.reserve(len(keys), ttl)
    pool.commit(rid, [Commit(s, k, 1, 0) for s, k in zip(slots, keys, strict=True)])
    return slots


def test_reserved_slots_are_invisible_until_committed_and_capacity_is_hard():
    pool = BlockPool(4 * 16, 16)
    rid, slots, _ = pool.reserve(3, 10)
    assert pool.find([key(1)]) == [None]
    with pytest.raises(CapacityError):
        pool.reserve(2, 10)  # 1 free, nothing evictable
    stored = pool.commit(rid, [Commit(slots[0], key(1), 16, 7)])
    assert [c.key for c in stored] == [key(1)] and pool.snapshot()["free_blocks"] == 3  # unused slots back
    with pytest.raises(UnknownHandleError):
        pool.commit(rid, [])


def test_first_copy_of_a_key_wins_and_lru_evicts_unleased_only():
    pool = BlockPool(3 * 16, 16)
    store(pool, [key(1), key(2), key(3)])
    rid, slots, evicted = pool.reserve(1, 10)  # evicts key(1), the least recently used
    assert evicted.keys == [key(1)]
    assert pool.commit(rid, [Commit(slots[0], key(2), 1, 0)]) == []  # key(2) is stored already
    lease = pool.lease([pool.find([key(2)])[0][0]], ttl_s=10)
    _, _, evicted = pool.reserve(2, 10)
    assert evicted.keys == [key(3)]
    assert pool.find([key(2)])[0] is not None  # leased: kept
    pool.release(lease)
    with pytest.raises(UnknownHandleError):
        pool.release(lease)


def test_partials_leases_and_reservations_expire():
    clock = Clock()
    pool = BlockPool(4 * 16, 16, partial_ttl_s=5, clock=clock)
    store(pool, [("req-1", 3), key(9)])
    rid, _, _ = pool.reserve(1, ttl_s=2)
    lease = pool.lease([pool.find([key(9)])[0][0]], ttl_s=3)
    clock.now = 6
    pool.expire()
    assert pool.find([("req-1", 3)]) == [None]  # request-scoped block past its TTL
    assert pool.find([key(9)])[0] is not None  # full blocks do not expire
    snap = pool.snapshot()
    assert snap["active_reservations"] == 0 and snap["active_leases"] == 0 and snap["free_blocks"] == 3
    with pytest.raises(UnknownHandleError):
        pool.release(lease)
    with pytest.raises(UnknownHandleError):
        pool.reserved_slots(rid)


def test_pulled_partials_are_dropped_for_their_request_only():
    pool = BlockPool(4 * 16, 16)
    store(pool, [("a", 0), ("a", 1), ("b", 0)])
    assert pool.drop_partials("a") == 2
    assert pool.find([("a", 0), ("b", 0)])[0] is None and pool.find([("b", 0)])[0] is not None
