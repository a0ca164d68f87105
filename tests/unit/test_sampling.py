"""Sampling: seeded reproducibility whatever the batch, filters, penalties, stops."""

from __future__ import annotations

import pytest
import torch

from engine import Engine, SamplingParams
from engine.request import Request
from engine.sampler import apply_penalties, filtered_probs
from tests.hf_reference import hf_greedy, load_hf

PROMPT = [5, 17, 42, 99, 3, 250, 7]


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return Engine.from_model(str(tiny_llama), num_kv_blocks=64)


def collect(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    outs = engine.generate([p for p, _ in requests], [sp for _, sp in requests])
    assert engine.num_free_blocks == engine.num_total_blocks
    return outs


def test_same_seed_same_output_whatever_else_is_in_the_batch(engine):
    seeded = SamplingParams(max_tokens=20, temperature=1.0, seed=1234, ignore_eos=True)
    alone = collect(engine, [(PROMPT, seeded)])[0]
    noisy = SamplingParams(max_tokens=30, temperature=1.3, top_p=0.9, ignore_eos=True)
    crowded = collect(engine, [([1, 2, 3], noisy), (PROMPT, seeded), ([9] * 40, noisy), (PROMPT, seeded)])
    assert crowded[1] == alone and crowded[3] == alone
    other_seed = collect(engine, [(PROMPT, SamplingParams(max_tokens=20, seed=4321, ignore_eos=True))])[0]
    assert other_seed != alone


def test_filters_that_leave_one_token_are_greedy(engine):
    greedy = collect(engine, [(PROMPT, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))])[0]
    for kw in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        sp = SamplingParams(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True, **kw)
        assert collect(engine, [(PROMPT, sp)])[0] == greedy, kw


def test_filtered_probs_top_k_top_p_min_p():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))
    assert (filtered_probs(logits, SamplingParams(top_k=2)) > 0).tolist() == [True, True, False, False]
    top_p = filtered_probs(logits, SamplingParams(top_p=0.7))
    assert (top_p > 0).tolist() == [True, True, False, False]
    assert torch.allclose(top_p[:2], torch.tensor([2 / 3, 1 / 3]))
    assert (filtered_probs(logits, SamplingParams(min_p=0.3)) > 0).tolist() == [True, True, True, False]


def test_repetition_penalty_matches_transformers(engine, tiny_llama):
    sp = SamplingParams(max_tokens=16, temperature=0, repetition_penalty=1.3, ignore_eos=True)
    ours = collect(engine, [(PROMPT, sp)])[0]
    assert ours == hf_greedy(load_hf(tiny_llama), PROMPT, 16, repetition_penalty=1.3)


def test_presence_and_frequency_penalties_subtract_per_output_count():
    r = Request("r", [1], SamplingParams(presence_penalty=0.5, frequency_penalty=0.25))
    r.output_token_ids = [2, 2, 3]
    row = apply_penalties(torch.zeros(5), r)
    assert row.tolist() == [0.0, 0.0, -1.0, -0.75, 0.0]


def test_stop_token_ids_eos_and_max_tokens(engine):
    greedy = collect(engine, [(PROMPT, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))])[0]
    stop_at = greedy[3]
    sp = SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_at])
    rid = engine.add_request(PROMPT, sp)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    tokens = [t for o in outs for t in o.new_token_ids]
    assert tokens == greedy[: greedy.index(stop_at) + 1]
    assert outs[-1].finished and outs[-1].finish_reason == "stop"
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=4, temperature=0))
    last = None
    while engine.has_unfinished():
        last = next((o for o in engine.step() if o.request_id == rid), last)
    assert last.finish_reason == "length" and last.num_output_tokens == 4
