"""Prefix caching: shared prefixes are computed once, keys never collide, eviction is LRU. A shared system
prompt on the default model: tests/e2e/test_prefix_cache.py."""

from __future__ import annotations

import pytest

from engine import Engine, SamplingParams, kv_cache_manager
from engine.block_hash import (
    block_hash,
    model_fingerprint,
    prompt_block_hashes,
    root_hash,
    weights_digest,
)
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestOptions
from tests.hf_reference import hf_greedy, load_hf
from tests.unit.test_engine_correctness import mixed_prompts


def greedy(n: int, ignore_eos: bool = True) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=ignore_eos)


def run_one(
    engine: Engine, prompt: list[int], n: int, ignore_eos: bool = True, options: RequestOptions | None = None
) -> tuple[list[int], int]:
    """Output tokens, and how many prompt tokens the engine computed for them."""
    before = engine.stats.prompt_tokens_computed
    out = []
    rid = engine.add_request(prompt, greedy(n, ignore_eos), options=options)
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
    run_one(engine, prompt, 2, options=RequestOptions(cache_salt="tenant-a"))
    _, computed_b = run_one(engine, prompt, 2, options=RequestOptions(cache_salt="tenant-b"))
    _, computed_unsalted = run_one(engine, prompt, 2)
    _, computed_a = run_one(engine, prompt, 2, options=RequestOptions(cache_salt="tenant-a"))
    assert computed_b == computed_unsalted == 40  # another salt (or none) sees nothing
    assert computed_a == 40 - 32  # the same tenant reuses its 2 full blocks


def test_an_empty_cache_salt_is_no_salt():
    """Protobuf strings cannot be absent: ``""`` arrives for "no salt" and becomes None in one place."""
    options = RequestOptions(cache_salt="", output_token_ids=[1, 2], block_hashes=[b"k" * 32])
    assert options.cache_salt is None and RequestOptions(cache_salt="a").cache_salt == "a"
    assert options.output_token_ids == (1, 2) and options.block_hashes == (b"k" * 32,)  # frozen all through


def test_supplied_block_hashes_are_used_instead_of_hashing_again(tiny_llama, monkeypatch):
    """A worker that hashed the prompt already (to build or check a handoff) passes the keys on: the engine
    files the blocks under them and hashes only beyond, so a process hashes a prompt once."""
    engine = Engine.from_model(str(tiny_llama), num_kv_blocks=64)
    prompt = mixed_prompts(1, 256, 40, 40, seed=12)[0]
    keys = prompt_block_hashes(engine.fingerprint, prompt, 16, "tenant")
    hashed = []
    chain_hashes = kv_cache_manager.chain_hashes
    monkeypatch.setattr(kv_cache_manager, "chain_hashes", lambda *a: hashed.append(a) or chain_hashes(*a))
    rid = engine.add_request(prompt, greedy(2), options=RequestOptions(cache_salt="tenant", block_hashes=keys))
    assert engine.scheduler.requests[rid].block_hashes == keys
    while engine.has_unfinished():
        engine.step()
    assert hashed == []  # 41 tokens computed: no full block beyond the two supplied
    # They are the keys the engine computes itself: a request that brings none hits the blocks filed under them.
    _, computed = run_one(engine, prompt, 2, options=RequestOptions(cache_salt="tenant"))
    assert computed == 40 - 32 and hashed
    # Taken as given, not rehashed: blocks filed under other keys are found by those keys only.
    forged = [bytes([1]) * 32, bytes([2]) * 32]
    _, computed_forged = run_one(engine, prompt, 2, options=RequestOptions(block_hashes=forged))
    _, computed_again = run_one(engine, prompt, 2, options=RequestOptions(block_hashes=forged))
    _, computed_unsalted = run_one(engine, prompt, 2)
    assert (computed_forged, computed_again, computed_unsalted) == (40, 8, 40)
    assert_all_blocks_back(engine)


def test_malformed_block_hashes_are_refused(tiny_llama):
    engine = Engine.from_model(str(tiny_llama), num_kv_blocks=64)
    prompt = mixed_prompts(1, 256, 31, 31, seed=13)[0]
    with_output = prompt_block_hashes(engine.fingerprint, prompt + [5], 16)  # 32 tokens: 2 full blocks
    for keys, message in [
        (with_output, "at most one per full block"),  # the prompt alone fills only one
        ([with_output[0][:31]], "32-byte keys"),
        ([with_output[0].hex()[:32]], "32-byte keys"),
        ([bytes(33)], "32-byte keys"),
    ]:
        with pytest.raises(ValueError, match=message):
            engine.add_request(prompt, greedy(2), options=RequestOptions(block_hashes=keys))
    assert not engine.has_unfinished()
    # Full blocks count generated tokens too: with its output the same request has two.
    engine.add_request(prompt, greedy(2), options=RequestOptions(output_token_ids=[5], block_hashes=with_output))
    while engine.has_unfinished():
        engine.step()
    assert_all_blocks_back(engine)


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
    """h0 = sha256("tandem-kv-v2" | fingerprint | salt), h_i = sha256(h_{i-1} | int32 LE tokens)."""
    import hashlib
    import struct

    fp = bytes(range(32))
    h0 = hashlib.sha256(b"tandem-kv-v2" + fp + b"salt").digest()
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
