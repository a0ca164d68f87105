"""The default model's own GGUF served directly (Q4_1 projections, Q8_0 embedding / lm_head) and int8 weights,
against transformers' dequantized model and tandem's float model of the same weights; perplexity on a fixed
11.5k-token text. First differences in greedy output are reported with their logprob gap (-rA shows them)."""

from __future__ import annotations

import pytest
import torch

from engine import Engine, EngineConfig
from tandem.bench.perplexity import integer_kernels_only, perplexity, text_tokens, window_logits, window_nll
from tandem.model_fetch import gguf_path
from tests.hf_reference import load_hf
from tests.unit.test_engine_correctness import run_engine
from tests.unit.test_quantization import assert_greedy_equal_or_near_tie

QUESTIONS = [  # the prompts of test_engine_correctness's parity test, and more of their kind
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a child in two sentences, using simple words and one example.",
    "2+2=",
    "List three prime numbers.",
    "Who wrote Romeo and Juliet?",
    "Give me a short recipe for pancakes.",
    "Translate 'good morning' into Spanish.",
]
# nats: a first difference must be a near-tie of the float model (seen: at most 0.19, the logits' spread is ~7)
MAX_GAP = 0.5


@pytest.fixture(scope="module")
def prompts(tok):
    return [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]


def test_fetch_model_keeps_the_gguf(default_model):
    assert gguf_path(default_model).is_file()
    cfg = EngineConfig(model=str(gguf_path(default_model)))
    assert cfg.quantization == "gguf" and cfg.model == str(default_model)


def test_gguf_logits_close_to_transformers(default_model, prompts, record_property):
    """Every position's logits of a 300-token text, GGUF-direct in float32 against transformers' float32 model of
    the dequantized GGUF: the differences are int8 activations' rounding, a small fraction of the logits' spread."""
    tokens = text_tokens(default_model)[:300]
    hf = load_hf(default_model)
    with torch.inference_mode():
        want = hf(torch.tensor([tokens])).logits[0, :-1].float()
    runner = Engine.from_model(str(default_model), quantization="gguf", num_kv_blocks=32).runner
    integer_kernels_only(runner)
    got = window_logits(runner, tokens)
    err = (got - want).abs()
    spread = want.std().item()
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    record_property("logits", {"max_abs_err": err.max().item(), "mean_abs_err": err.mean().item(),
                               "logit_std": spread, "top1_agreement": agree})
    assert err.mean().item() < 0.05 * spread
    assert err.max().item() < 0.5 * spread
    assert agree > 0.95


@pytest.fixture(scope="module")
def float_reference(default_model, prompts) -> tuple[Engine, list[list[int]]]:
    """tandem's float32 model of the same weights, and its greedy answers (shared by both quantizations)."""
    reference = Engine.from_model(str(default_model), kv_cache_gb=0.25)
    return reference, run_engine(reference, prompts, [32] * len(prompts))


@pytest.mark.parametrize("quantization", ["gguf", "int8"])
def test_greedy_equals_float_model_or_near_tie(default_model, prompts, float_reference, quantization,
                                               record_property):
    """Against tandem's float32 model of the same weights (which equals transformers token for token:
    test_engine_correctness). int8 activations (as llama.cpp's) tip near-ties, so most 32-token answers differ
    somewhere; every first difference must be one, and is reported."""
    reference, want = float_reference
    engine = Engine.from_model(str(default_model), kv_cache_gb=0.25, quantization=quantization)
    got = run_engine(engine, prompts, [32] * len(prompts))
    assert_greedy_equal_or_near_tie(reference, prompts, want, got, MAX_GAP, record_property)


def test_perplexity_within_bounds_of_bfloat16(default_model, record_property):
    """11.5k tokens in 512-token windows; the quantized runs take the decode path's integer kernel throughout."""
    tokens = text_tokens(default_model)
    assert len(tokens) >= 10_000
    configs = {q: EngineConfig(model=str(default_model), dtype="bfloat16", quantization=q)
               for q in ("none", "int8", "gguf")}
    ppl = {q: perplexity(cfg, tokens, decode_kernels=True) for q, cfg in configs.items()}
    record_property("perplexity", ppl)
    assert ppl["int8"] <= ppl["none"] * 1.01
    assert ppl["gguf"] <= ppl["none"] * 1.03
    assert 1.5 < ppl["none"] < 50  # a sane figure for English legal text


def test_window_nll_counts_every_token_but_the_first(default_model):
    runner = Engine.from_model(str(default_model), num_kv_blocks=8).runner
    nll, n = window_nll(runner, text_tokens(default_model)[:40])
    assert n == 39 and nll > 0
