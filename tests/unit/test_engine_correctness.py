"""Greedy output equals transformers' token for token; logprobs match; blocks come back. On tiny random
checkpoints; the same on the default model: tests/e2e/test_engine_correctness.py."""

from __future__ import annotations

import random

import pytest
import torch

from engine import Engine, SamplingParams
from tests.hf_reference import hf_greedy, hf_greedy_logprobs, load_hf


def mixed_prompts(n: int, vocab: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_engine(
    engine: Engine, prompts: list[list[int]], max_tokens: list[int], ignore_eos: bool = True
) -> list[list[int]]:
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=ignore_eos) for m in max_tokens]
    outs = engine.generate(prompts, params)
    assert engine.num_free_blocks == engine.num_total_blocks, "KV blocks leaked"
    return outs


def top5_logprobs(engine: Engine, prompt: list[int], params: SamplingParams) -> list:
    rid = engine.add_request(prompt, params)
    steps = []
    while engine.has_unfinished():
        steps += [lp for out in engine.step() if out.request_id == rid for lp in out.new_logprobs]
    return steps


def batch_logprobs(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[list]:
    """Every request's logprobs, step by step, with all of them running in one batch."""
    ids = [engine.add_request(p, params) for p in prompts]
    collected: dict[str, list] = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            collected[out.request_id] += out.new_logprobs
    return [collected[i] for i in ids]


def assert_same_tokens_close_logprobs(ref: list[list], other: list[list], atol: float) -> None:
    for ref_steps, other_steps in zip(ref, other, strict=True):
        assert [s.token_id for s in ref_steps] == [s.token_id for s in other_steps]
        for a, b in zip(ref_steps, other_steps, strict=True):
            assert abs(a.logprob - b.logprob) < atol


def assert_logprobs_match(steps: list, tokens: list[int], reference: list[torch.Tensor]) -> None:
    """Same greedy tokens, same top-5 ids, top-5 logprobs within 1e-3 (float32)."""
    assert [s.token_id for s in steps] == tokens
    for step, ref_lp in zip(steps, reference, strict=True):
        ref_vals, ref_ids = ref_lp.topk(5)
        assert [t for t, _ in step.top] == ref_ids.tolist()
        assert torch.allclose(torch.tensor([v for _, v in step.top]), ref_vals, atol=1e-3)


@pytest.mark.parametrize("name", ["llama", "llama-mha-tied", "qwen2", "mistral"])
def test_tiny_greedy_matches_transformers(tiny_models, name):
    path = tiny_models[name]
    prompts = mixed_prompts(7, 256, 1, 70)
    max_tokens = [5, 30, 12, 1, 25, 8, 17]  # requests finish at different steps
    # max_num_seqs=3: waiting requests join as running ones leave, mid-batch.
    engine = Engine.from_model(str(path), num_kv_blocks=64, max_num_seqs=3)
    outs = run_engine(engine, prompts, max_tokens)
    hf = load_hf(path)
    for prompt, n, out in zip(prompts, max_tokens, outs, strict=True):
        assert out == hf_greedy(hf, prompt, n)


def test_tiny_chunked_prefill_and_preemption_match(tiny_llama):
    prompts = mixed_prompts(6, 256, 20, 90, seed=1)
    max_tokens = [40, 35, 30, 25, 20, 45]
    reference = run_engine(Engine.from_model(str(tiny_llama), num_kv_blocks=128), prompts, max_tokens)
    hf = load_hf(tiny_llama)
    assert reference == [hf_greedy(hf, p, n) for p, n in zip(prompts, max_tokens, strict=True)]

    chunked = Engine.from_model(str(tiny_llama), num_kv_blocks=128, max_num_batched_tokens=24)
    assert run_engine(chunked, prompts, max_tokens) == reference

    # 14 blocks of 16 tokens cannot hold every request at once: the newest are preempted.
    tight = Engine.from_model(str(tiny_llama), num_kv_blocks=14, max_num_batched_tokens=64)
    assert run_engine(tight, prompts, max_tokens) == reference
    assert tight.scheduler.num_preemptions > 0


def test_tiny_logprobs_match_transformers(tiny_llama):
    prompt = mixed_prompts(1, 256, 12, 12, seed=2)[0]
    engine = Engine.from_model(str(tiny_llama), num_kv_blocks=16)
    steps = top5_logprobs(engine, prompt, SamplingParams(max_tokens=6, temperature=0, logprobs=5, ignore_eos=True))
    assert_logprobs_match(steps, *hf_greedy_logprobs(load_hf(tiny_llama), prompt, 6))
    assert all(s.rank == 1 and abs(s.logprob - s.top[0][1]) < 1e-6 for s in steps)


def test_bfloat16_agrees_with_float32_on_first_token(tiny_llama):
    prompts = mixed_prompts(4, 256, 5, 40, seed=3)
    fp32 = run_engine(Engine.from_model(str(tiny_llama), num_kv_blocks=32), prompts, [1] * 4)
    bf16 = run_engine(Engine.from_model(str(tiny_llama), num_kv_blocks=32, dtype="bfloat16"), prompts, [1] * 4)
    assert bf16 == fp32


@pytest.mark.parametrize("dtype, atol, steps", [("float32", 1e-4, 6), ("bfloat16", 0.05, 2)])
def test_attention_backends_agree(tiny_llama, dtype, atol, steps):
    """Every backend available here gives the same logprobs within the dtype's tolerance.

    In bfloat16 greedy paths of a random model may fork after a near-tie, so only
    the first tokens (prefill, then one decode) are compared there.
    """
    prompts = mixed_prompts(3, 256, 10, 50, seed=4)
    results = {}
    for backend in ("torch", "sdpa", "cpu"):
        engine = Engine.from_model(str(tiny_llama), num_kv_blocks=32, dtype=dtype, attention_backend=backend)
        params = SamplingParams(max_tokens=steps, temperature=0, logprobs=3, ignore_eos=True)
        results[backend] = batch_logprobs(engine, prompts, params)
    for name in ("sdpa", "cpu"):
        assert_same_tokens_close_logprobs(results["torch"], results[name], atol)


def test_decodes_grouped_by_length_match_transformers(tiny_llama):
    """20 decodes from 3 to 200 tokens of context: attended in several length groups (the torch
    backend's way; the CPU kernel reads each sequence's own length and needs no groups)."""
    from engine.attention import group_by_length

    rng = random.Random(5)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (3, 5, 8, 12, 20, 30, 45, 60, 80, 100) * 2]
    decodes = [(i, len(p) + 1, torch.tensor([0])) for i, p in enumerate(prompts)]
    assert len(group_by_length(decodes)) > 1
    engine = Engine.from_model(str(tiny_llama), num_kv_blocks=256, attention_backend="torch")
    outs = run_engine(engine, prompts, [12] * len(prompts))
    hf = load_hf(tiny_llama)
    assert outs == [hf_greedy(hf, p, 12) for p in prompts]
