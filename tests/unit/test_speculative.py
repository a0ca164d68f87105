"""Speculative decoding in one engine: greedy and seeded outputs equal those without speculation, token for
token, batched, with both proposers; the sampled distribution is the target's (a two-sample chi-square
test); rejected drafts leave no block held or misregistered; preemption, stop tokens, max_tokens, logprobs,
the per-request switch and the back-off behave.

Tiny random Llamas stand in for the models (the default model under ``tandem up`` is in
tests/e2e/test_speculative.py): the target drafts for itself (every greedy guess right), or a different
tiny model drafts (most guesses wrong), or prompt lookup drafts from repetitive prompts.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from pathlib import Path

import pytest

from engine import Engine, SamplingParams
from engine.spec_decode.ngram import NgramProposer
from tests.conftest import _save_tiny

MAX_TOKENS = 40


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory) -> Path:
    """A tiny model of the same vocabulary with other weights: its guesses are mostly wrong."""
    return _save_tiny(tmp_path_factory.mktemp("draft"), "llama", hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts with repeated spans, so that prompt lookup finds something to propose."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(3, 250) for _ in range(rng.randint(3, 8))]
        out.append([rng.randrange(3, 250) for _ in range(rng.randint(2, 10))] + phrase * rng.randint(2, 5))
    return out


def engine(model: Path, method: str = "none", draft: Path | None = None, **kwargs) -> Engine:
    kwargs.setdefault("num_kv_blocks", 256)
    return Engine.from_model(str(model), speculative_method=method,
                             speculative_model=str(draft) if draft else None, **kwargs)


def speculating(tiny_llama: Path, other_draft: Path) -> list[tuple[str, Engine]]:
    return [("ngram", engine(tiny_llama, "ngram")), ("draft-self", engine(tiny_llama, "draft", tiny_llama)),
            ("draft-other", engine(tiny_llama, "draft", other_draft))]


@pytest.fixture(scope="module")
def engines(tiny_llama, other_draft) -> list[tuple[str, Engine]]:
    return speculating(tiny_llama, other_draft)


@pytest.fixture(scope="module")
def plain(tiny_llama) -> Engine:
    return engine(tiny_llama)


def test_greedy_and_seeded_outputs_equal_those_without_speculation(plain, engines):
    ps = prompts(12)
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0) if i % 2 else
              SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=100 + i) for i in range(12)]
    expected = plain.generate(ps, params)
    for name, e in engines:
        drafts = e.spec.stats.num_draft_tokens
        assert e.generate(ps, params) == expected, name
        assert e.spec.stats.num_draft_tokens > drafts, f"{name} proposed something"
    accepted = {name: e.spec.stats.num_accepted_tokens for name, e in engines}
    assert accepted["draft-self"] > accepted["draft-other"], "the target's own guesses are right more often"


def test_logprobs_and_max_tokens_with_speculation(plain, engines):
    ps = prompts(4, seed=1)
    params = [SamplingParams(max_tokens=m, temperature=0, logprobs=3) for m in (1, 2, 7, 33)]

    def run(e: Engine) -> list[list]:
        ids = [e.add_request(p, sp) for p, sp in zip(ps, params, strict=True)]
        got: dict[str, list] = {i: [] for i in ids}
        while e.has_unfinished():
            for out in e.step():
                assert len(out.new_logprobs) == len(out.new_token_ids)
                got[out.request_id] += list(zip(out.new_token_ids, out.new_logprobs, strict=True))
        return [got[i] for i in ids]

    expected = run(plain)
    assert [len(x) for x in expected] == [1, 2, 7, 33]
    for name, e in engines:
        for want, have in zip(expected, run(e), strict=True):
            assert [t for t, _ in have] == [t for t, _ in want], name
            for (_, a), (_, b) in zip(want, have, strict=True):  # verified in one pass: equal up to rounding
                assert a.rank == b.rank and math.isclose(a.logprob, b.logprob, abs_tol=1e-4)
                assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_a_stop_token_inside_an_accepted_draft_ends_the_request_there(plain, engines):
    ps = prompts(3, seed=2)
    free = plain.generate(ps, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    for p, out in zip(ps, free, strict=True):
        stop = out[len(out) // 2]
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, stop_token_ids=[stop])
        expected = plain.generate([p], params)[0]
        assert expected[-1] == stop and len(expected) < len(out)
        for name, e in engines:
            assert e.generate([p], params)[0] == expected, name


def test_rejected_drafts_leave_no_block_held_or_misregistered(tiny_llama, other_draft):
    """Every block comes back; a prompt that extends an earlier output reuses its registered blocks and gets
    what an engine without a cache gets (a block registered with a rejected token's KV would differ)."""
    e = engine(tiny_llama, "draft", other_draft, num_kv_blocks=256, block_size=4, speculative_min_acceptance=0.0)
    ps = prompts(6, seed=3)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    ids = [e.add_request(p, greedy) for p in ps]
    outs: dict[str, list[int]] = {i: [] for i in ids}
    while e.has_unfinished():
        for out in e.step():
            outs[out.request_id] += out.new_token_ids
        for r in e.scheduler.running:  # a decode's rejected draft slots are given back at once
            if r.num_computed_tokens == r.num_tokens - 1:
                assert len(r.block_ids) <= -(-r.num_tokens // 4), (len(r.block_ids), r.num_tokens)
    outs = [outs[i] for i in ids]
    assert e.spec.stats.num_draft_tokens > e.spec.stats.num_accepted_tokens > 0, "some drafts were rejected"
    assert e.kv.num_free_blocks == e.num_total_blocks
    assert e.spec.proposer.kv.num_free_blocks == e.spec.proposer.runner.num_blocks, "the draft's mirrors too"
    longer = [p + o for p, o in zip(ps, outs, strict=True)]
    hits = e.kv.stats.hit_tokens
    reused = e.generate(longer, SamplingParams(max_tokens=8, temperature=0))
    assert e.kv.stats.hit_tokens - hits >= sum(len(p) for p in longer) // 2, "the earlier blocks were reused"
    fresh = engine(tiny_llama, enable_prefix_caching=False, block_size=4)
    assert reused == fresh.generate(longer, SamplingParams(max_tokens=8, temperature=0))


def test_preemption_with_speculation_loses_nothing(plain, tiny_llama):
    ps = prompts(8, seed=4)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, seed=3)
    expected = plain.generate(ps, params)
    tight = engine(tiny_llama, "draft", tiny_llama, num_kv_blocks=14)
    assert tight.generate(ps, params) == expected
    assert tight.stats.num_preemptions > 0 and tight.kv.num_free_blocks == tight.num_total_blocks


def test_a_request_may_turn_speculation_off(tiny_llama):
    e = engine(tiny_llama, "draft", tiny_llama)
    e.generate(prompts(2), SamplingParams(max_tokens=MAX_TOKENS, temperature=0, speculative=False))
    assert e.spec.stats.num_drafts == 0
    e.generate(prompts(2), SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    assert e.spec.stats.num_drafts > 0


def test_speculation_backs_off_where_it_does_not_pay(tiny_llama, other_draft):
    """Above the batch limit nobody speculates; a request whose guesses keep failing pauses."""
    e = engine(tiny_llama, "draft", tiny_llama, speculative_max_batch=4)
    e.generate(prompts(5, seed=5), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert e.spec.stats.num_drafts == 0, "5 decodes > max batch 4"
    wrong = engine(tiny_llama, "draft", other_draft, num_speculative_tokens=4, speculative_min_acceptance=0.5)
    steps = wrong.stats.num_steps
    wrong.generate(prompts(1, seed=6), SamplingParams(max_tokens=120, temperature=1.0, seed=1))
    decode_steps = wrong.stats.num_steps - steps
    assert wrong.spec.stats.num_drafts < decode_steps / 2, "it paused for most of the request"


def chi_square_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at p = 0.999 (z), by Wilson and Hilferty's approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_the_sampled_distribution_is_the_targets(plain, tiny_llama, other_draft):
    """Two independent samples, one with speculation (a wrong-guessing draft: many rejections and resamples),
    one without: their tokens at each position are drawn from the same distribution (chi-square, p = 0.001)."""
    n, prompt = 1500, prompts(1, seed=7)[0]
    params = [SamplingParams(max_tokens=4, temperature=1.0, top_k=6, seed=s) for s in range(n)]
    e = engine(tiny_llama, "draft", other_draft, speculative_max_batch=n, speculative_min_acceptance=0.0,
               num_kv_blocks=2048)
    with_spec = e.generate([prompt] * n, params)
    assert e.spec.stats.num_draft_tokens > 3 * e.spec.stats.num_accepted_tokens > 0
    others = [SamplingParams(max_tokens=4, temperature=1.0, top_k=6, seed=n + s) for s in range(n)]
    without = plain.generate([prompt] * n, others)
    for position in (1, 2, 3):  # the tokens a verification produces (position 0 is the prefill's)
        a, b = Counter(o[position] for o in with_spec), Counter(o[position] for o in without)
        tokens = [t for t in set(a) | set(b) if a[t] + b[t] >= 10]
        stat = sum((a[t] - b[t]) ** 2 / (a[t] + b[t]) for t in tokens)  # two equal-size samples
        assert stat < chi_square_critical(len(tokens) - 1), (position, stat, len(tokens))


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    p = NgramProposer(2, 4)
    assert p.lookup([1, 2, 3, 4, 5, 9, 9, 1, 2, 3], 3) == [4, 5, 9]
    assert p.lookup([1, 2, 3, 8, 1, 2, 3, 7, 2, 3], 2) == [7, 2]  # the latest of two matches of [2, 3]
    assert p.lookup([1, 2, 3, 4, 5], 3) == []
    assert p.lookup([7, 7, 7, 7], 3) == [7]
    with pytest.raises(ValueError):
        NgramProposer(3, 2)


@pytest.mark.parametrize("kwargs, message", [
    ({"speculative_method": "medusa"}, "speculative_method must be one of"),
    ({"speculative_method": "draft"}, "needs speculative_model"),
    ({"speculative_method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"speculative_method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
])
def test_bad_speculative_settings_are_refused(tiny_llama, kwargs, message):
    with pytest.raises(ValueError, match=message):
        Engine.from_model(str(tiny_llama), num_kv_blocks=16, **kwargs)


def test_a_draft_with_a_larger_vocabulary_is_refused(tiny_llama, tmp_path):
    big = _save_tiny(tmp_path / "big", "llama", vocab_size=512)
    with pytest.raises(ValueError, match="same tokenizer"):
        engine(tiny_llama, "draft", big)
