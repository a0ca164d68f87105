"""Policies (FCFS, priority), preemption under a tiny pool, and abort at every stage of a request."""

from __future__ import annotations

import pytest

from engine import Engine, SamplingParams
from engine.kv_cache_manager import KVCacheManager
from engine.kv_transfer import LocalKVTransfer
from engine.request import Request, RequestOptions, RequestStatus
from engine.scheduler import Scheduler
from tests.hf_reference import hf_greedy, load_hf
from tests.unit.test_engine_correctness import mixed_prompts, run_engine


def req(rid: str, n: int, priority: int = 0) -> Request:
    return Request(rid, list(range(n)), SamplingParams(max_tokens=4), priority=priority)


def admitted(s: Scheduler) -> list[str]:
    return [x.request.request_id for x in s.schedule().scheduled]


def test_priority_admits_lower_values_first_ties_by_arrival():
    s = Scheduler(KVCacheManager(64, 4), max_num_seqs=1, max_num_batched_tokens=64, policy="priority")
    for rid, prio in [("low", 5), ("high", 0), ("mid-1", 2), ("mid-2", 2)]:
        s.add(req(rid, 4, prio))
    order = []
    for _ in range(4):
        (rid,) = admitted(s)
        order.append(rid)
        s.finish(s.requests[rid], RequestStatus.FINISHED_STOPPED)
    assert order == ["high", "mid-1", "mid-2", "low"]


def test_fcfs_admits_in_arrival_order_whatever_the_priority():
    s = Scheduler(KVCacheManager(64, 4), max_num_seqs=1, max_num_batched_tokens=64, policy="fcfs")
    for rid, prio in [("a", 5), ("b", 0)]:
        s.add(req(rid, 4, prio))
    assert admitted(s) == ["a"]


def test_priority_preempts_the_lowest_priority_not_the_newest():
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=False)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, policy="priority")
    urgent, background, normal = req("urgent", 8, 0), req("background", 8, 9), req("normal", 8, 1)
    for r in (urgent, background, normal):
        s.add(r)
    s.schedule()
    for r in (urgent, background, normal):
        r.num_computed_tokens = 8
        r.output_token_ids.append(1)
    out = s.schedule()  # each needs a third block and none is free
    assert out.preempted == [background]
    assert sorted(x.request.request_id for x in out.scheduled) == ["normal", "urgent"]


def test_priority_request_preempts_lower_priority_running_to_get_in():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, policy="priority")
    s.add(req("background", 16, 9))
    assert admitted(s) == ["background"]
    s.add(req("urgent", 8, 0))
    out = s.schedule()
    assert [r.request_id for r in out.preempted] == ["background"]
    assert [x.request.request_id for x in out.scheduled] == ["urgent"]
    assert s.waiting.peek().request_id == "background"


def test_fcfs_never_preempts_to_admit():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, policy="fcfs")
    s.add(req("first", 16, 9))
    s.schedule()
    s.add(req("second", 8, 0))
    out = s.schedule()
    assert not out.preempted and [x.request.request_id for x in out.scheduled] == ["first"]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_under_a_tiny_pool_matches_transformers(tiny_llama, policy):
    prompts = mixed_prompts(6, 256, 20, 70, seed=30)
    max_tokens = [40, 35, 30, 25, 20, 45]
    engine = Engine.from_model(str(tiny_llama), num_kv_blocks=12, scheduling_policy=policy)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in max_tokens]
    ids = [engine.add_request(p, sp, options=RequestOptions(priority=i % 3))
           for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
    outs: dict[str, list[int]] = {i: [] for i in ids}
    finished = []
    while engine.has_unfinished():
        for o in engine.step():
            assert o.request_id not in finished, "a request was answered after it finished"
            outs[o.request_id] += o.new_token_ids
            if o.finished:
                finished.append(o.request_id)
    assert engine.stats.num_preemptions > 0 and sorted(finished) == sorted(ids)
    hf = load_hf(tiny_llama)
    assert [outs[i] for i in ids] == [hf_greedy(hf, p, n) for p, n in zip(prompts, max_tokens, strict=True)]
    assert engine.num_free_blocks == engine.num_total_blocks


def test_request_larger_than_the_pool_is_refused(tiny_llama):
    engine = Engine.from_model(str(tiny_llama), num_kv_blocks=4)
    with pytest.raises(ValueError, match="more KV blocks than the whole cache"):
        engine.add_request(list(range(60)), SamplingParams(max_tokens=10))
    assert engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0))[0]


class HeldLoads(LocalKVTransfer):
    """A store whose pulls do not finish while ``hold`` is set, as a stalled network would."""

    hold = False

    def poll_loads(self):
        return [] if self.hold else super().poll_loads()


def test_abort_frees_everything_at_every_stage(tiny_llama):
    """Waiting, prefilling (mid-chunk), decoding, preempted and loading requests all abort cleanly,
    and a request running beside them is untouched."""
    store = HeldLoads()
    engine = Engine.from_model(str(tiny_llama), store, num_kv_blocks=12, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    prompts = mixed_prompts(4, 256, 40, 40, seed=31)
    outs: dict[str, list[int]] = {}

    def step_until(cond) -> None:
        for _ in range(200):
            if cond():
                return
            for o in engine.step():
                outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        raise AssertionError("condition never reached")

    def state(rid: str) -> Request:
        return engine.scheduler.requests[rid]

    survivor = engine.add_request(prompts[0], params)
    decoding = engine.add_request(prompts[1], params)
    step_until(lambda: state(decoding).num_output_tokens > 0)
    prefilling = engine.add_request(prompts[2], params)
    step_until(lambda: 0 < state(prefilling).num_computed_tokens < 40)
    waiting = engine.add_request(prompts[3], params)
    assert state(waiting).status is RequestStatus.WAITING
    for rid in (waiting, prefilling, decoding):
        assert engine.abort(rid) and not engine.abort(rid)
    # Three long requests in 12 blocks: the newest is preempted.
    extra = [engine.add_request(p, params) for p in prompts[1:3]]
    step_until(lambda: any(state(r).status is RequestStatus.PREEMPTED for r in extra))
    for r in sorted(extra, key=lambda r: state(r).status is not RequestStatus.PREEMPTED):
        assert engine.abort(r)
    store.hold = True
    loading = engine.add_request(prompts[3], params, None, RequestOptions(output_token_ids=[1], num_external_tokens=40))
    step_until(lambda: state(loading).status is RequestStatus.WAITING_FOR_KV)
    assert engine.abort(loading)
    store.hold = False
    step_until(lambda: not engine.has_unfinished())
    assert engine.num_free_blocks == engine.num_total_blocks and not any(engine.kv.pool.ref_counts)
    assert not engine.scheduler.requests and not engine.scheduler.loading and not engine._loads
    alone = run_engine(Engine.from_model(str(tiny_llama), num_kv_blocks=12), [prompts[0]], [60])
    assert outs[survivor] == alone[0]
