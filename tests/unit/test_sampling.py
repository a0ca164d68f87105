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


def _mixed_requests() -> list[Request]:
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=50, min_p=0.01),
        SamplingParams(temperature=1.0, seed=7, logprobs=5),
        SamplingParams(temperature=0, repetition_penalty=1.3, presence_penalty=0.5, logprobs=2),
        SamplingParams(temperature=0.7, top_k=3, seed=3),
    ]
    requests = []
    for i, p in enumerate(params):
        r = Request(f"r{i}", [1, 2, 3, 4 + i], p, ())
        r.output_token_ids = [5, 6]
        requests.append(r)
    return requests


def test_sampling_brings_back_token_ids_and_requested_logprobs_only(monkeypatch):
    """On a GPU the logits stay where they are: what crosses to the host is one id per row and the top-n of
    the rows that asked for logprobs, never a vocabulary-wide row (131 MB a step at vocab 128k, batch 256)."""
    vocab = 4096
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(0))
    moved: list[int] = []
    real_tolist = torch.Tensor.tolist

    def tolist(t):
        moved.append(t.numel())
        return real_tolist(t)

    def refuse(*args, **kwargs):
        raise AssertionError("the sampler moved a tensor to the host")

    from engine.sampler import Sampler

    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    for name in ("cpu", "numpy", "item"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    tokens, logprobs = Sampler(0).sample(logits.clone(), _mixed_requests())
    assert len(tokens) == 5 and [lp is not None for lp in logprobs] == [False, False, True, True, False]
    assert moved and max(moved) <= 5 * 5 and sum(moved) < vocab  # ids, ranks, chosen and top-n values


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs wherever there is one)")
def test_sampling_on_the_gpu_matches_the_cpu_for_greedy_rows():
    from engine.sampler import Sampler

    logits = torch.randn(6, 32000, generator=torch.Generator().manual_seed(1))
    requests = [Request(f"r{i}", [1, 2], SamplingParams(temperature=0, logprobs=3), ()) for i in range(6)]
    cpu_tokens, cpu_lps = Sampler(0).sample(logits, requests)
    gpu_tokens, gpu_lps = Sampler(0).sample(logits.cuda(), requests)
    assert gpu_tokens == cpu_tokens
    assert [lp.rank for lp in gpu_lps] == [lp.rank for lp in cpu_lps]
