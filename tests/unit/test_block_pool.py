"""The block pool and the scheduler, with exact block ids and token counts."""

from __future__ import annotations

from engine.block_pool import BlockPool
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler


def req(rid: str, n: int, max_tokens: int = 4) -> Request:
    return Request(rid, list(range(n)), SamplingParams(max_tokens=max_tokens))


def test_pool_allocates_in_order_and_refuses_without_taking():
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) is None and pool.num_free_blocks == 1
    pool.free([2, 1])
    assert pool.allocate(3) == [2, 1, 3]  # blocks holding nothing cached are reused first, in free order


def test_requests_free_tail_first():
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=False)
    r = req("a", 10)
    assert kv.allocate_slots(r, 10) and r.block_ids == [0, 1, 2]
    r.num_computed_tokens = 10
    assert kv.allocate_slots(r, 2) and r.block_ids == [0, 1, 2]  # still fits in block 2
    assert kv.allocate_slots(r, 3) and r.block_ids == [0, 1, 2, 3]
    kv.free(r)
    assert kv.pool.allocate(6) == [3, 2, 1, 0, 4, 5]


def test_decode_first_then_prefill_within_token_budget():
    kv = KVCacheManager(num_blocks=100, block_size=4)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=10)
    a = req("a", 6)
    s.add(a)
    out = s.schedule()
    assert [(x.request.request_id, x.num_tokens) for x in out.scheduled] == [("a", 6)]
    a.num_computed_tokens = 6
    a.output_token_ids.append(1)  # a now decodes
    b, c = req("b", 20), req("c", 3)
    s.add(b)
    s.add(c)
    out = s.schedule()
    # a's decode first, then 9 tokens of b's prompt (chunked); c waits for budget.
    assert [(x.request.request_id, x.num_tokens) for x in out.scheduled] == [("a", 1), ("b", 9)]
    assert out.scheduled[0].samples and not out.scheduled[1].samples


def test_preempts_newest_and_requeues_it_first():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = req("a", 8), req("b", 8)
    s.add(a)
    s.add(b)
    s.schedule()
    for r in (a, b):
        r.num_computed_tokens = 8
        r.output_token_ids.append(1)
    out = s.schedule()  # both need a third block; only 0 free: b is preempted for a
    assert [x.request.request_id for x in out.scheduled] == ["a"]
    assert out.preempted == [b] and b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert s.waiting.peek() is b and kv.num_free_blocks == 1


def test_max_num_seqs_and_abort_everywhere():
    kv = KVCacheManager(num_blocks=100, block_size=4)
    s = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=64)
    for rid in "abc":
        s.add(req(rid, 5))
    out = s.schedule()
    assert [x.request.request_id for x in out.scheduled] == ["a", "b"]
    assert s.abort("a") and s.abort("c") and not s.abort("zzz")
    assert [r.request_id for r in s.running] == ["b"] and not s.waiting
    s.abort("b")
    assert kv.num_free_blocks == 100 and s.num_unfinished == 0


def test_decodes_group_by_length_within_2x():
    import torch

    from engine.attention import MIN_DECODE_GROUP, group_by_length

    decodes = [(i, n, torch.tensor([0])) for i, n in enumerate([700] * 8 + [400] * 8 + [300] * 8 + [100] * 3)]
    groups = group_by_length(decodes)
    assert [[d[1] for d in g] for g in groups] == [[700] * 8 + [400] * 8, [300] * 8 + [100] * 3]
    assert all(len(g) >= MIN_DECODE_GROUP for g in groups)
    few = decodes[:10]
    assert group_by_length(few) == [few]  # too few to be worth a second group; stream order kept
