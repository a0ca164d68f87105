"""Prefix caching: shared prefixes are computed once, keys never collide, eviction is LRU."""

from __future__ import annotations

import pytest

from engine import Engine, SamplingParams
from engine.block_hash import (
    block_hash,
    model_fingerprint,
    prompt_block_hashes,
    root_hash,
    weights_digest,
)
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from tests.hf_reference import hf_greedy, load_hf
from tests.unit.test_engine_correctness import mixed_prompts


def greedy(n: int, ignore_eos: bool = True) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=ignore_eos)


def run_one(engine: Engine, prompt: list[int], n: int, ignore_eos: bool = True, **kwargs) -> tuple[list[int], int]:
    """Output tokens, and how many prompt tokens the engine computed for them."""
    before = engine.stats.prompt_tokens_computed
    out = []
    rid = engine.add_request(prompt, greedy(n, ignore_eos), **kwargs)
    while engine.has_unfinished():
        out += [t for o in engine.step() if o.request_id == rid for t in o.new_token_ids]
    return out, engine.stats.prompt_tokens_computed - before


def assert_all_blocks_back(engine: Engine) -> None:
    assert engine.num_free_blocks == engine.num_total_blocks
    assert all(c == 0 for c in engine.kv.pool.ref_counts)


@pytest.fixture(scope="module")
def hf_tiny(tiny_llama):
    return load_hf(tiny_llama)


def test_second_request_computes_only_its_new_blocks(tiny_llama, hf_tiny):
    engine = Engine.from_model(str(tiny_llama), num_kv_blocks=64)
    first = mixed_prompts(1, 256, 70, 70, seed=5)[0]
    second = first[:64] + mixed_prompts(1, 256, 10, 10, seed=6)[0]
    out1, computed1 = run_one(engine, first, 8)
    assert computed1 == 70 and engine.stats.prefix_cache.hit_blocks == 0
    out2, computed2 = run_one(engine, second, 8)
    stats = engine.stats.prefix_cache
    assert computed2 == 10  # the 4 shared blocks (64 tokens) came from the cache
    assert (stats.hit_blocks, stats.miss_blocks) == (4, 4)  # first: 4 misses; second: 4 hits
    assert out1 == hf_greedy(hf_tiny, first, 8) and out2 == hf_greedy(hf_tiny, second, 8)
    assert_all_blocks_back(engine)


def test_fully_cached_prompt_still_computes_its_last_block(tiny_llama, hf_tiny):
    engine = Engine.from_model(str(tiny_llama), num_kv_blocks=64)
    prompt = mixed_prompts(1, 256, 64, 64, seed=7)[0]
    out1, _ = run_one(engine, prompt, 6)
    out2, computed = run_one(engine, prompt, 6)
    assert computed == 16  # 3 of 4 blocks reused: the last token must be computed to sample
    assert out1 == out2 == hf_greedy(hf_tiny, prompt, 6)
    assert_all_blocks_back(engine)


def test_generated_tokens_are_cached_for_the_next_turn(tiny_llama, hf_tiny):
    engine = Engine.from_model(str(tiny_llama), num_kv_blocks=64)
    prompt = mixed_prompts(1, 256, 20, 20, seed=8)[0]
    reply, _ = run_one(engine, prompt, 30)
    follow_up = prompt + reply + [7, 8, 9]
    out, computed = run_one(engine, follow_up, 5)
    # 49 of the 50 computed tokens filled 3 blocks; only the rest is computed again.
    assert computed == len(follow_up) - 48
    assert out == hf_greedy(hf_tiny, follow_up, 5)


def test_concurrent_requests_share_prefix_blocks(tiny_llama, hf_tiny):
    engine = Engine.from_model(str(tiny_llama), num_kv_blocks=64, max_num_batched_tokens=48)
    prefix = mixed_prompts(1, 256, 48, 48, seed=9)[0]
    prompts = [prefix + [10 + i] * (5 + i) for i in range(3)]
    run_one(engine, prefix + [1], 1)  # warm the cache with the prefix's 3 blocks
    ids = [engine.add_request(p, greedy(6)) for p in prompts]
    outs = {i: [] for i in ids}
    for o in engine.step():
        outs[o.request_id] += o.new_token_ids
    shared = engine.scheduler.requests[ids[0]].block_ids[:3]
    assert all(engine.scheduler.requests[i].block_ids[:3] == shared for i in ids)
    assert [engine.kv.pool.ref_counts[b] for b in shared] == [3, 3, 3]
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] += o.new_token_ids
    assert [outs[i] for i in ids] == [hf_greedy(hf_tiny, p, 6) for p in prompts]
    assert_all_blocks_back(engine)


def test_cache_salt_separates_tenants(tiny_llama):
    engine = Engine.from_model(str(tiny_llama), num_kv_blocks=64)
    prompt = mixed_prompts(1, 256, 40, 40, seed=10)[0]
    run_one(engine, prompt, 2, cache_salt="tenant-a")
    _, computed_b = run_one(engine, prompt, 2, cache_salt="tenant-b")
    _, computed_unsalted = run_one(engine, prompt, 2)
    _, computed_a = run_one(engine, prompt, 2, cache_salt="tenant-a")
    assert computed_b == computed_unsalted == 40  # another salt (or none) sees nothing
    assert computed_a == 40 - 32  # the same tenant reuses its 2 full blocks


def test_keys_never_collide_across_salts_or_models():
    tokens = list(range(64))
    fp = model_fingerprint({"model_type": "llama", "hidden_size": 64}, "float32", 16, "w1")
    others = [
        model_fingerprint({"model_type": "llama", "hidden_size": 64}, "bfloat16", 16, "w1"),
        model_fingerprint({"model_type": "llama", "hidden_size": 64}, "float32", 32, "w1"),
        model_fingerprint({"model_type": "llama", "hidden_size": 64}, "float32", 16, "w2"),
        model_fingerprint({"model_type": "llama", "hidden_size": 128}, "float32", 16, "w1"),
        model_fingerprint({"model_type": "llama", "hidden_size": 64}, "float32", 16, "w1", layout="v2"),
    ]
    chains = [prompt_block_hashes(fp, tokens, 16)]
    chains += [prompt_block_hashes(fp, tokens, 16, salt) for salt in ("a", "b", b"a\x00")]
    chains += [prompt_block_hashes(other, tokens, 16) for other in others]
    keys = [k for chain in chains for k in chain]
    assert len(keys) == len(set(keys)) == 4 * len(chains)
    assert prompt_block_hashes(fp, tokens, 16, "a") == prompt_block_hashes(fp, tokens, 16, b"a")


def test_keys_follow_the_contract():
    """h0 = sha256("tandem-kv-v1" | fingerprint | salt), h_i = sha256(h_{i-1} | int32 LE tokens)."""
    import hashlib
    import struct

    fp = bytes(range(32))
    h0 = hashlib.sha256(b"tandem-kv-v1" + fp + b"salt").digest()
    assert root_hash(fp, "salt") == h0
    h1 = hashlib.sha256(h0 + struct.pack("<4i", 1, 2, 3, 70000)).digest()
    assert block_hash(h0, [1, 2, 3, 70000]) == h1
    assert prompt_block_hashes(fp, [1, 2, 3, 70000, 5], 4, "salt") == [h1]  # the partial block has no key
    with pytest.raises(ValueError, match="32 bytes"):
        root_hash(b"short")


def test_engine_fingerprint_covers_dtype_block_size_and_weights(tiny_llama, tmp_path):
    base = Engine.from_model(str(tiny_llama), num_kv_blocks=8)
    assert base.fingerprint == Engine.from_model(str(tiny_llama), num_kv_blocks=16).fingerprint
    assert base.fingerprint != Engine.from_model(str(tiny_llama), num_kv_blocks=8, dtype="bfloat16").fingerprint
    assert base.fingerprint != Engine.from_model(str(tiny_llama), num_kv_blocks=8, block_size=8).fingerprint
    dummy = Engine.from_model(str(tiny_llama), num_kv_blocks=8, load_format="dummy")
    assert base.fingerprint != dummy.fingerprint
    files = sorted(tiny_llama.glob("*.safetensors"))
    changed = tmp_path / files[0].name
    data = bytearray(files[0].read_bytes())
    data[-1] ^= 0xFF  # the digest samples the end of every file
    changed.write_bytes(bytes(data))
    assert weights_digest(files) != weights_digest([changed])


def test_freed_blocks_stay_cached_until_evicted_lru():
    kv = KVCacheManager(num_blocks=6, block_size=4)

    def finished(rid: str, tokens: list[int]) -> Request:
        r = Request(rid, tokens, greedy(1))
        assert kv.admit(r, len(tokens), len(tokens) - 1)
        r.num_computed_tokens = len(tokens)
        kv.cache_computed_blocks(r)
        kv.free(r)
        return r

    finished("a", list(range(8)))  # blocks 0, 1 cached
    finished("b", list(range(100, 108)))  # blocks 2, 3 cached
    assert kv.num_free_blocks == 6 and kv.pool.num_cached_blocks == 4
    c = Request("c", list(range(200, 212)), greedy(1))  # needs 3 blocks: 4, 5 (empty), then the LRU
    assert kv.admit(c, 12, 11)
    assert c.block_ids == [4, 5, 1]  # a's tail block, freed first of the cached ones
    assert kv.pool.num_evictions == 1
    again = Request("a2", list(range(8)) + [0], greedy(1))
    assert kv.cached_prefix_tokens(again, 8) == 4  # a's first block survived
    kv.free(c)
    assert kv.reset_prefix_cache() == 3 and kv.pool.num_cached_blocks == 0


def test_prefix_caching_off_computes_everything(tiny_llama):
    engine = Engine.from_model(str(tiny_llama), num_kv_blocks=64, enable_prefix_caching=False)
    prompt = mixed_prompts(1, 256, 40, 40, seed=11)[0]
    run_one(engine, prompt, 2)
    _, computed = run_one(engine, prompt, 2)
    assert computed == 40 and engine.kv.pool.num_cached_blocks == 0


def test_default_model_shared_system_prompt_matches_transformers(default_model):
    from tokenizer_svc.tokenizer import TextTokenizer

    tok = TextTokenizer(default_model)
    system = {"role": "system", "content": "You are a terse geography tutor. Answer in one short sentence. " * 3}
    prompts = [
        tok.encode_chat([system, {"role": "user", "content": q}])
        for q in ("What is the capital of France?", "What is the capital of Japan?")
    ]
    engine = Engine.from_model(str(default_model), kv_cache_gb=0.1)
    out1, computed1 = run_one(engine, prompts[0], 12, ignore_eos=False)
    out2, computed2 = run_one(engine, prompts[1], 12, ignore_eos=False)
    shared = next(i for i, (a, b) in enumerate(zip(*prompts, strict=False)) if a != b)
    assert computed1 == len(prompts[0])
    assert computed2 == len(prompts[1]) - shared // 16 * 16
    hf = load_hf(default_model)
    assert out1 == hf_greedy(hf, prompts[0], 12) and out2 == hf_greedy(hf, prompts[1], 12)
    assert_all_blocks_back(engine)
