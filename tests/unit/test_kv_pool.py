"""The store node's pool: reservations, commits, leases, LRU eviction and expiry, on a fake clock."""

from __future__ import annotations

import numpy as np
import pytest

from engine.kv_blocks import PartialRef
from kvstore.pool import TOKEN_BYTES, BlockPool, CapacityError, Commit, UnknownHandleError


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
    store(pool, [PartialRef("req-1", 3), key(9)])
    rid, _, _ = pool.reserve(1, ttl_s=2)
    lease = pool.lease([pool.find([key(9)])[0][0]], ttl_s=3)
    clock.now = 6
    pool.expire()
    assert pool.find([PartialRef("req-1", 3)]) == [None]  # request-scoped block past its TTL
    assert pool.find([key(9)])[0] is not None  # full blocks do not expire
    snap = pool.snapshot()
    assert snap["active_reservations"] == 0 and snap["active_leases"] == 0 and snap["free_blocks"] == 3
    with pytest.raises(UnknownHandleError):
        pool.release(lease)
    with pytest.raises(UnknownHandleError):
        pool.reserved_slots(rid)


def test_pulled_partials_are_dropped_for_their_request_only():
    pool = BlockPool(4 * 16, 16)
    store(pool, [PartialRef("a", 0), PartialRef("a", 1), PartialRef("b", 0)])
    assert pool.drop_partials("a") == 2
    assert (pool.find([PartialRef("a", 0), PartialRef("b", 0)])[0] is None
            and pool.find([PartialRef("b", 0)])[0] is not None)


# -- data-plane capabilities ----------------------------------------------------------------------


def test_a_reservation_token_admits_writes_into_its_own_slots_only():
    pool = BlockPool(8 * 16, 16)
    rid, slots, _ = pool.reserve(3, 10)
    other, other_slots, _ = pool.reserve(2, 10)
    token = pool.token_of(rid)
    assert len(token) == TOKEN_BYTES and token != pool.token_of(other)
    grant = pool.begin_transfer(token, slots, write=True)
    assert grant is not None
    pool.end_transfer(grant)
    pool.end_transfer(pool.begin_transfer(token, slots[1:], write=True))  # a subset is fine
    refused = [
        (token, slots, False),  # a reservation is for writes, never reads
        (token, [*slots, other_slots[0]], True),  # another reservation's slot
        (token, [pool.num_slots - 1], True),  # a free slot
        (pool.token_of(other), slots[:1], True),
        (bytes(TOKEN_BYTES), slots, True),  # what a peer without a token sends
        (b"", slots, True),
        (bytes([token[0] ^ 1]) + token[1:], slots, True),  # forged
    ]
    for t, s, write in refused:
        assert pool.begin_transfer(t, s, write) is None
    assert pool.snapshot()["refused_transfers"] == len(refused)
    pool.refuse_transfer()  # the data plane counts a malformed header here
    assert pool.stats.refused_transfers == len(refused) + 1


def test_a_lease_token_admits_reads_of_its_blocks_only():
    pool = BlockPool(8 * 16, 16)
    slots = store(pool, [key(1), key(2), key(3)])
    lease = pool.lease(slots[:2], ttl_s=10)
    token = pool.token_of(lease)
    pool.end_transfer(pool.begin_transfer(token, slots[:2], write=False))
    assert pool.begin_transfer(token, slots[:2], write=True) is None  # a lease never writes
    assert pool.begin_transfer(token, slots, write=False) is None  # slots[2] is not leased
    assert pool.stats.refused_transfers == 2


def test_tokens_die_with_their_reservation_or_lease():
    clock = Clock()
    pool = BlockPool(8 * 16, 16, clock=clock)
    committed, cancelled, expiring = (pool.reserve(1, ttl_s=5) for _ in range(3))
    tokens = {name: (pool.token_of(r[0]), r[1]) for name, r in
              [("committed", committed), ("cancelled", cancelled), ("expiring", expiring)]}
    pool.commit(committed[0], [Commit(committed[1][0], key(1), 1, 0)])
    pool.cancel(cancelled[0])
    clock.now = 5  # expired, not yet swept: refused all the same
    for token, slots in tokens.values():
        assert pool.begin_transfer(token, slots, write=True) is None
    with pytest.raises(UnknownHandleError):
        pool.token_of(committed[0])

    clock.now = 0
    pool.expire()
    slot = pool.find([key(1)])[0][0]
    released, expiring = pool.lease([slot], ttl_s=5), pool.lease([slot], ttl_s=5)
    released_token, expiring_token = pool.token_of(released), pool.token_of(expiring)
    pool.release(released)
    assert pool.begin_transfer(released_token, [slot], write=False) is None
    clock.now = 5
    assert pool.begin_transfer(expiring_token, [slot], write=False) is None
    pool.expire()
    assert pool.snapshot()["active_leases"] == 0 and pool.stats.refused_transfers == 5


def test_a_transfer_in_flight_pins_its_blocks_and_slots():
    clock = Clock()
    pool = BlockPool(2 * 16, 16, clock=clock)
    (slot,) = store(pool, [key(1)])
    lease = pool.lease([slot], ttl_s=10)
    reading = pool.begin_transfer(pool.token_of(lease), [slot], write=False)
    pool.release(lease)  # mid-read: the block must not change under the reader
    with pytest.raises(CapacityError):
        pool.reserve(2, 10)  # 1 free; the block is still held by the read
    pool.end_transfer(reading)
    _, _, evicted = pool.reserve(2, 10)
    assert evicted.keys == [key(1)]

    pool = BlockPool(2 * 16, 16, clock=clock)
    rid, slots, _ = pool.reserve(1, ttl_s=1)
    writing = pool.begin_transfer(pool.token_of(rid), slots, write=True)
    with pytest.raises(ValueError, match="still running"):
        pool.commit(rid, [Commit(slots[0], key(2), 1, 0)])
    clock.now = 2
    pool.expire()  # expired mid-write: its slot is not handed to another writer yet
    assert pool.snapshot()["free_blocks"] == 1 and pool.begin_transfer(writing.token, slots, write=True) is None
    pool.end_transfer(writing)
    assert pool.snapshot()["free_blocks"] == 2


def test_a_leased_partial_block_outlives_its_drop_until_the_lease_ends():
    pool = BlockPool(4 * 16, 16)
    (slot,) = store(pool, [PartialRef("req", 0)])
    lease = pool.lease([slot], ttl_s=10)
    assert pool.drop_partials("req") == 1
    pool.expire()
    assert pool.snapshot()["stored_blocks"] == 1  # a reader holds it: its slot is not reused under it
    pool.release(lease)
    pool.expire()
    assert pool.find([PartialRef("req", 0)]) == [None] and pool.snapshot()["free_blocks"] == 4


def test_slot_runs_and_back_to_back_arrays():
    from kvstore.data_plane import MAX_RUN_BYTES, _joined, slot_runs

    assert slot_runs([4, 5, 6, 9, 10, 2], 1024) == [(0, 3), (3, 2), (5, 1)]
    assert slot_runs([7], 1024) == [(0, 1)] and slot_runs([], 1024) == []
    assert slot_runs(list(range(5)), MAX_RUN_BYTES // 2) == [(0, 2), (2, 2), (4, 1)]  # cut at MAX_RUN_BYTES
    buf = np.arange(40, dtype=np.uint8).reshape(4, 10)
    joined = _joined(list(buf[1:4]))
    assert joined is not None and np.array_equal(joined, buf[1:4].reshape(-1))
    assert _joined([buf[0], buf[2]]) is None  # a gap between them


def test_the_pool_hands_out_sorted_slots():
    pool = BlockPool(64, 8)
    _, first, _ = pool.reserve(4, 10)
    assert first == [0, 1, 2, 3]


def test_an_abandoned_write_frees_its_reservation_at_once():
    pool = BlockPool(64, 8)
    rid, slots, _ = pool.reserve(3, ttl_s=30)
    token = pool.token_of(rid)
    grant = pool.begin_transfer(token, slots, write=True)
    assert grant is not None
    pool.end_transfer(grant)
    pool.abandon(grant)
    snap = pool.snapshot()
    assert snap["reserved_blocks"] == 0 and snap["active_reservations"] == 0 and snap["free_blocks"] == 8
    assert pool.begin_transfer(token, slots, write=True) is None  # the token died with the reservation
    with pytest.raises(UnknownHandleError):
        pool.token_of(rid)
