"""The default model (real weights) in the engine: greedy output equals transformers' token for token, in a
batch and with chunked prefill; logprobs match. The same checks on tiny random checkpoints, and the helpers:
tests/unit/test_engine_correctness.py."""

from __future__ import annotations

import pytest

from engine import Engine, SamplingParams
from tests.hf_reference import hf_greedy, hf_greedy_logprobs, load_hf
from tests.unit.test_engine_correctness import assert_logprobs_match, run_engine, top5_logprobs


@pytest.fixture(scope="module")
def hf_default(default_model):
    return load_hf(default_model)


@pytest.mark.parametrize("budget", [2048, 24])  # 24: every prompt is chunked, mixed with running decodes
def test_default_model_greedy_batch_matches_transformers(default_model, hf_default, budget):
    from tokenizer_svc.tokenizer import TextTokenizer

    tok = TextTokenizer(default_model)
    questions = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Explain photosynthesis to a child in two sentences, using simple words and one example.",
        "2+2=",
        "List three prime numbers.",
    ]
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in questions]
    prompts.append(tok.encode("The quick brown fox"))
    max_tokens = [24, 10, 32, 3, 16, 20]
    engine = Engine.from_model(str(default_model), kv_cache_gb=0.25, max_num_seqs=4, max_num_batched_tokens=budget)
    outs = run_engine(engine, prompts, max_tokens, ignore_eos=False)  # the real model does emit EOS
    for prompt, n, out in zip(prompts, max_tokens, outs, strict=True):
        assert out == hf_greedy(hf_default, prompt, n)
    assert "Paris" in tok.decode(outs[0])


def test_default_model_logprobs_match_transformers(default_model, hf_default):
    from tokenizer_svc.tokenizer import TextTokenizer

    prompt = TextTokenizer(default_model).encode_chat([{"role": "user", "content": "Name a color."}])
    engine = Engine.from_model(str(default_model), kv_cache_gb=0.1)
    steps = top5_logprobs(engine, prompt, SamplingParams(max_tokens=4, temperature=0, logprobs=5))
    assert_logprobs_match(steps, *hf_greedy_logprobs(hf_default, prompt, 4))
