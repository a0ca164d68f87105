"""The pool's UCX shared memory: what a reader maps is the store's pool and nothing else (real libucp calls;
the reader and the store are one process here, the cross-process case is in tests/e2e/test_kvstore.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvstore.ucp_memory import SharedRegion, attach

BLOCK = 64


@pytest.fixture
def region():
    r = SharedRegion(10 * BLOCK, BLOCK, os.urandom(16))
    r.array[:] = np.arange(r.array.size) % 251
    yield r
    r.close()


def test_a_mapped_region_reads_the_stores_bytes_in_place(region):
    mapped = attach(region.descriptor)
    assert mapped is not None and mapped.pool_id == region.pool_id and mapped.num_slots == 10
    try:
        with mapped.reading() as usable:
            assert usable
            assert np.array_equal(mapped.block(3, BLOCK), region.array[3 * BLOCK:4 * BLOCK])
            region.array[3 * BLOCK] = 7  # the same pages, not a copy
            assert mapped.block(3, 10)[0] == 7
            with pytest.raises(ValueError):  # read-only: a reader never writes into a store's pool
                mapped.block(3, BLOCK)[0] = 1
            assert mapped.block(10, BLOCK) is None and mapped.block(0, BLOCK + 1) is None
            assert mapped.block(-1, BLOCK) is None and mapped.block(0, 0) is None
    finally:
        mapped.close()


def test_a_descriptor_that_does_not_name_this_pool_maps_nothing(region):
    wrong_id = os.urandom(16) + region.descriptor[16:]  # the memory's header holds another pool id
    assert attach(wrong_id) is None
    assert attach(region.descriptor[:40]) is None
    assert attach(b"") is None and attach(bytes(300)) is None


def test_close_waits_for_reads_and_later_reads_are_refused(region):
    mapped = attach(region.descriptor)
    with mapped.reading() as usable:
        mapped.close()  # deferred: this read still holds the mapping
        assert usable and mapped.block(1, BLOCK)[0] == region.array[BLOCK]
    with mapped.reading() as usable:
        assert not usable


def test_a_store_that_stops_renewing_its_deadline_reads_as_dead(region):
    mapped = attach(region.descriptor)
    try:
        region.keep_alive(10.0)
        assert mapped.alive()
        region.keep_alive(-1.0)
        assert not mapped.alive()
    finally:
        mapped.close()
    region.keep_alive(10.0)
    assert not mapped.alive()  # a closed mapping is never alive
