"""Producer -> consumer handoff in process: the blocks move, the output equals the aggregated engine's."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import torch

from engine import Engine, SamplingParams
from engine.async_engine import AsyncEngine
from engine.block_hash import prompt_block_hashes
from engine.kv_transfer import LoadResult, LocalKVTransfer, PartialRef
from engine.request import Request, RequestOptions
from tests.hf_reference import hf_greedy, load_hf
from tests.unit.test_engine_correctness import mixed_prompts, run_engine


class RecordingTransfer(LocalKVTransfer):
    """The local store, remembering each save call (to check blocks leave chunk by chunk)."""

    def __init__(self) -> None:
        super().__init__()
        self.saves: list[tuple[str, int, int]] = []
        self.loads: list[tuple[str, int, int]] = []

    def save_blocks(self, request, first_block, refs, data, release=None, ready=None):
        self.saves.append((request.request_id, first_block, len(refs)))
        super().save_blocks(request, first_block, refs, data, release, ready)

    def start_load(self, request, first_block, num_blocks):
        self.loads.append((request.request_id, first_block, num_blocks))
        super().start_load(request, first_block, num_blocks)


class DelayedTransfer(LocalKVTransfer):
    """Loads complete only after a few polls, as a network pull would."""

    def __init__(self, delay_polls: int = 3) -> None:
        super().__init__()
        self.delay = delay_polls
        self._pending: list[tuple[int, LoadResult]] = []

    def poll_loads(self) -> list[LoadResult]:
        self._pending += [(self.delay, r) for r in super().poll_loads()]
        ready = [r for n, r in self._pending if n <= 0]
        self._pending = [(n - 1, r) for n, r in self._pending if n > 0]
        return ready


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def prefill(producer: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, tuple]:
    """Run the producer; request id -> (first token, finish reason)."""
    firsts = {}
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        producer.add_request(p, sp, request_id=f"r{i}")
    while producer.has_unfinished():
        for out in producer.step():
            assert out.finished and len(out.new_token_ids) == 1
            firsts[out.request_id] = (out.new_token_ids[0], out.finish_reason)
    return firsts


def decode(
    consumer: Engine, prompts: list[list[int]], params: list[SamplingParams], firsts: dict, ids: list[str] | None = None
) -> list[list[int]]:
    """Admit each prompt with its first token and its KV from outside; full outputs, first token included."""
    ids = ids or [f"r{i}" for i in range(len(prompts))]
    outs = {}
    for rid, p, sp in zip(ids, prompts, params, strict=True):
        token, _ = firsts[rid]
        consumer.add_request(p, sp, rid, RequestOptions(output_token_ids=[token], num_external_tokens=len(p)))
        outs[rid] = [token]
    while consumer.has_unfinished():
        for out in consumer.step():
            outs[out.request_id] += out.new_token_ids
    return [outs[rid] for rid in ids]


def assert_all_blocks_back(*engines: Engine) -> None:
    for e in engines:
        assert e.num_free_blocks == e.num_total_blocks and not any(e.kv.pool.ref_counts)


def test_producer_to_consumer_equals_aggregated(tiny_llama):
    dtype = "float32"
    prompts = mixed_prompts(5, 256, 5, 80, seed=20)
    max_tokens = [12, 20, 7, 15, 30]
    params = [greedy(n) for n in max_tokens]
    aggregated = run_engine(Engine.from_model(str(tiny_llama), num_kv_blocks=64, dtype=dtype), prompts, max_tokens)
    hf = load_hf(tiny_llama)
    assert aggregated == [hf_greedy(hf, p, n) for p, n in zip(prompts, max_tokens, strict=True)]

    store = RecordingTransfer()
    producer = Engine.from_model(
        str(tiny_llama), store, num_kv_blocks=64, dtype=dtype, role="producer", max_num_batched_tokens=32
    )
    firsts = prefill(producer, prompts, params)
    assert {reason for _, reason in firsts.values()} == {"prefilled"}
    # Chunked prefill: the 80-token prompt's full blocks left in several saves, before its last chunk.
    longest = f"r{max(range(5), key=lambda i: len(prompts[i]))}"
    assert len([s for s in store.saves if s[0] == longest]) > 1
    consumer = Engine.from_model(str(tiny_llama), store, num_kv_blocks=64, dtype=dtype, role="consumer")
    assert decode(consumer, prompts, params, firsts) == aggregated
    assert consumer.stats.prompt_tokens_computed == 0  # no prompt token was recomputed
    assert consumer.stats.kv_blocks_loaded == sum(-(-len(p) // 16) for p in prompts)
    assert not store.partial  # request-scoped tail blocks are gone once pulled
    assert_all_blocks_back(producer, consumer)


def test_bfloat16_handoff_is_bit_exact(tiny_llama):
    """One request at a time runs the same kernels on both sides, so bf16 must agree exactly too."""
    prompts = mixed_prompts(3, 256, 20, 60, seed=26)
    store = LocalKVTransfer()
    kwargs = dict(num_kv_blocks=32, dtype="bfloat16")
    producer = Engine.from_model(str(tiny_llama), store, role="producer", **kwargs)
    consumer = Engine.from_model(str(tiny_llama), store, role="consumer", **kwargs)
    aggregated = Engine.from_model(str(tiny_llama), **kwargs)
    for prompt in prompts:
        firsts = prefill(producer, [prompt], [greedy(16)])
        assert decode(consumer, [prompt], [greedy(16)], firsts) == run_engine(aggregated, [prompt], [16])
    assert_all_blocks_back(producer, consumer)


def test_consumer_loads_only_what_its_own_cache_lacks(tiny_llama):
    prefix = mixed_prompts(1, 256, 48, 48, seed=21)[0]
    prompts = [prefix + [5, 6, 7], prefix + [8, 9]]
    params = [greedy(6), greedy(6)]
    store = RecordingTransfer()
    producer = Engine.from_model(str(tiny_llama), store, num_kv_blocks=64, role="producer")
    consumer = Engine.from_model(str(tiny_llama), store, num_kv_blocks=64, role="consumer")
    firsts = prefill(producer, prompts, params)
    outs = decode(consumer, prompts[:1], params[:1], firsts)
    # The second request shares 3 full blocks with the first, which the consumer has cached.
    outs += decode(consumer, prompts[1:], params[1:], firsts, ids=["r1"])
    assert store.loads == [("r0", 0, 4), ("r1", 3, 1)]
    assert consumer.stats.prefix_cache.hit_blocks == 3
    assert outs == run_engine(Engine.from_model(str(tiny_llama), num_kv_blocks=64), prompts, [6, 6])


def test_missing_blocks_fall_back_to_recomputation(tiny_llama):
    prompts = mixed_prompts(2, 256, 40, 40, seed=22)
    params = [greedy(8), greedy(8)]
    store = LocalKVTransfer()
    firsts = prefill(Engine.from_model(str(tiny_llama), store, num_kv_blocks=64, role="producer"), prompts, params)
    store.full.clear()  # the store lost the blocks (a node died)
    consumer = Engine.from_model(str(tiny_llama), store, num_kv_blocks=64, role="consumer")
    outs = decode(consumer, prompts, params, firsts)
    assert outs == run_engine(Engine.from_model(str(tiny_llama), num_kv_blocks=64), prompts, [8, 8])
    assert consumer.stats.kv_load_failures == 2 and consumer.stats.prompt_tokens_computed == 80
    assert_all_blocks_back(consumer)


def test_blocks_of_another_shape_are_refused_and_recomputed(tiny_llama, tiny_models):
    prompt = mixed_prompts(1, 256, 30, 30, seed=23)[0]
    store = LocalKVTransfer()
    mha = str(tiny_models["llama-mha-tied"])  # 4 KV heads instead of 2
    firsts = prefill(Engine.from_model(mha, store, num_kv_blocks=16, role="producer"), [prompt], [greedy(4)])
    # Forge the keys the consumer will look up, so that it finds the wrong-shaped blocks.
    consumer = Engine.from_model(str(tiny_llama), store, num_kv_blocks=16, role="consumer")
    probe = Request("probe", prompt, greedy(4))
    consumer.kv.update_hashes(probe, len(prompt))
    (wrong,) = store.full.values()
    store.full = {probe.block_hashes[0]: wrong}
    store.partial = {PartialRef("r0", 1): wrong}
    out = decode(consumer, [prompt], [greedy(4)], firsts)
    assert consumer.stats.kv_load_failures == 1 and len(out[0]) == 4
    assert_all_blocks_back(consumer)


def test_producer_stops_for_real_when_the_first_token_ends_the_request(tiny_llama):
    prompt = mixed_prompts(1, 256, 10, 10, seed=24)[0]
    store = LocalKVTransfer()
    producer = Engine.from_model(str(tiny_llama), store, num_kv_blocks=16, role="producer")
    first, reason = prefill(producer, [prompt], [greedy(5)])["r0"]
    assert reason == "prefilled"
    assert prefill(producer, [prompt], [greedy(1)])["r0"][1] == "length"
    stop = SamplingParams(max_tokens=5, temperature=0, stop_token_ids=[first])
    assert prefill(producer, [prompt], [stop])["r0"][1] == "stop"


def test_handoff_arguments_are_validated(tiny_llama):
    consumer = Engine.from_model(str(tiny_llama), LocalKVTransfer(), num_kv_blocks=16, role="consumer")
    bare = Engine.from_model(str(tiny_llama), num_kv_blocks=16)
    prompt = [1, 2, 3]
    with pytest.raises(ValueError, match="num_external_tokens"):
        consumer.add_request(prompt, greedy(4), options=RequestOptions(output_token_ids=[4], num_external_tokens=4))
    with pytest.raises(ValueError, match="nothing left within max_tokens"):
        consumer.add_request(prompt, greedy(1), options=RequestOptions(output_token_ids=[4], num_external_tokens=3))
    with pytest.raises(ValueError, match="output token ids"):
        consumer.add_request(prompt, greedy(4), options=RequestOptions(output_token_ids=[10**6], num_external_tokens=3))
    with pytest.raises(ValueError, match="needs a KV connector"):
        bare.add_request(prompt, greedy(4), options=RequestOptions(output_token_ids=[4], num_external_tokens=3))


def test_block_hashes_never_name_a_block_loaded_partially(tiny_llama):
    """The producer pushed the prompt's partial block by request; with the first token it is full here, but a
    key for it would make the load look it up by key, miss, and recompute the prompt."""
    consumer = Engine.from_model(str(tiny_llama), LocalKVTransfer(), num_kv_blocks=16, role="consumer")
    prompt = list(range(3, 50))  # 47 tokens: 2 full blocks and a partial one, full once the first token joins
    keys = prompt_block_hashes(consumer.fingerprint, prompt + [4], 16)
    handoff = RequestOptions(output_token_ids=[4], num_external_tokens=47, block_hashes=keys)
    with pytest.raises(ValueError, match="partial block"):
        consumer.add_request(prompt, greedy(4), options=handoff)
    rid = consumer.add_request(prompt, greedy(4), options=replace(handoff, block_hashes=keys[:2]))
    assert consumer.scheduler.requests[rid].block_hashes == keys[:2] and consumer.abort(rid)


def test_async_consumer_waits_for_loads_and_abort_while_loading_frees_blocks(tiny_llama):
    prompts = mixed_prompts(2, 256, 33, 33, seed=25)
    params = [greedy(10), greedy(10)]
    store = DelayedTransfer(delay_polls=3)
    firsts = prefill(Engine.from_model(str(tiny_llama), store, num_kv_blocks=32, role="producer"), prompts, params)
    reference = run_engine(Engine.from_model(str(tiny_llama), num_kv_blocks=32), prompts, [10, 10])

    consumer = Engine.from_model(str(tiny_llama), store, num_kv_blocks=32, role="consumer")
    rid = consumer.add_request(
        prompts[1], params[1], "r1", RequestOptions(output_token_ids=[firsts["r1"][0]], num_external_tokens=33)
    )
    consumer.step()  # admitted: blocks held while the load is in flight
    assert consumer.scheduler.loading and consumer.num_free_blocks == 32 - 3
    assert consumer.abort(rid) and consumer.num_free_blocks == 32
    assert consumer.step() == [] and not consumer.has_unfinished()

    async def stream() -> list[int]:
        engine = AsyncEngine(consumer)
        try:
            out = [firsts["r0"][0]]
            async for o in engine.generate(
                prompts[0], params[0], "r0", RequestOptions(output_token_ids=[firsts["r0"][0]], num_external_tokens=33)
            ):
                out += o.new_token_ids
            return out
        finally:
            engine.shutdown()

    assert asyncio.run(stream()) == reference[0]
    assert consumer.stats.kv_blocks_loaded == 3
    assert_all_blocks_back(consumer)


def test_export_import_round_trip_preserves_the_wire_layout(tiny_llama):
    engine = Engine.from_model(str(tiny_llama), num_kv_blocks=8)
    cfg = engine.model_config
    data = torch.randn(3, cfg.num_kv_heads, cfg.num_layers, 2, 16, cfg.head_dim)  # KV heads first (layout v2)
    engine.runner.import_blocks([5, 1, 6], data)
    assert torch.equal(engine.runner.export_blocks([5, 1, 6]), data)
    assert torch.equal(engine.runner.export_blocks([1]), data[1:2])
    # Slot s of block b holds token b*16+s: the cache layout agrees with the wire layout.
    layer0 = engine.runner.kv_caches[0]
    assert torch.equal(layer0[0, :, 1 * 16 + 3], data[1, :, 0, 0, 3])
    # A rank's heads are one contiguous range of each block's bytes.
    flat = data[1].reshape(-1)
    per_head = flat.numel() // cfg.num_kv_heads
    assert torch.equal(flat[per_head : 2 * per_head], data[1, 1].reshape(-1))
