"""Prefix caching on the default model (real weights): a shared system prompt is computed once and the output
still equals transformers'. The rest of prefix caching, on tiny random checkpoints: tests/unit/test_prefix_cache.py."""

from __future__ import annotations

from engine import Engine
from tests.hf_reference import hf_greedy, load_hf
from tests.unit.test_prefix_cache import assert_all_blocks_back, run_one


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
