"""The staging pool's bookkeeping: contiguous rows lent and given back, runs coalesced, a request that
fits nowhere refused (the caller allocates instead), a double release caught, and threads sharing it."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.kv_staging import StagingPool


def pool(capacity: int = 10) -> StagingPool:
    return StagingPool((2, 4), torch.float32, capacity)


def test_rows_are_lent_contiguously_and_coalesce_when_given_back():
    p = pool()
    a, b, c = p.take(3), p.take(4), p.take(3)
    assert (a.start, b.start, c.start) == (0, 3, 7) and p.in_use == 10 and p.take(1) is None
    assert a.tensor.shape == (3, 2, 4) and a.tensor.data_ptr() == p.buffer.data_ptr()
    b.release()
    assert p.free_runs == [(3, 4)] and p.take(5) is None and p.fallbacks == 2
    a.release()
    assert p.free_runs == [(0, 7)]  # the two runs merged
    c.release()
    assert p.free_runs == [(0, 10)] and p.in_use == 0 and p.high_water == 10


def test_first_fit_reuses_a_hole():
    p = pool()
    a, b = p.take(2), p.take(2)
    a.release()
    again = p.take(2)
    assert again.start == 0 and p.free_runs == [(4, 6)]
    b.release()
    again.release()


def test_a_double_release_is_a_bug_not_a_silent_corruption():
    p = pool()
    s = p.take(2)
    s.release()
    with pytest.raises(RuntimeError, match="released twice"):
        s.release()
    assert p.free_runs == [(0, 10)] and p.in_use == 0


def test_writes_land_in_the_shared_buffer_and_stay_apart():
    p = pool()
    a, b = p.take(2), p.take(2)
    a.tensor.fill_(1)
    b.tensor.fill_(2)
    assert p.buffer[:2].eq(1).all() and p.buffer[2:4].eq(2).all() and p.buffer[4:].eq(0).all()


def test_threads_share_it_without_losing_rows():
    p = pool(64)

    def churn() -> None:
        for i in range(500):
            s = p.take(1 + i % 5)
            if s is not None:
                s.release()

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert p.in_use == 0 and p.free_runs == [(0, 64)]


def test_an_empty_pool_is_refused():
    with pytest.raises(ValueError, match="at least one block"):
        StagingPool((2,), torch.float32, 0)
