"""Decode steps replayed as CUDA graphs give the eager engine's tokens: batches padded up to a capture size
(3 -> 4, 5 -> 8), requests of different lengths, greedy and seeded sampling. Needs a GPU; the GPU check runs
it too, and its device-independent parts (the Triton kernel, under Triton's interpreter) run everywhere. Here, not
in tests/unit, because Triton starts processes (ptxas, a C compiler) to build its kernels."""

from __future__ import annotations

import pytest
import torch

from engine import Engine, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs wherever there is one)")

PROMPTS = [list(range(3, 3 + n)) for n in (5, 17, 40, 2, 33)]


def _engine(path, graphs: bool) -> Engine:
    return Engine.from_model(str(path), device="cuda", dtype="float32", num_kv_blocks=64, cuda_graphs=graphs)


@pytest.mark.parametrize("batch", [1, 3, 5])
def test_graph_replays_equal_eager_steps(tiny_llama, batch):
    prompts = PROMPTS[:batch]
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True) if i % 2 == 0 else
              SamplingParams(max_tokens=24, temperature=0.8, seed=i, ignore_eos=True) for i in range(batch)]
    graphed = _engine(tiny_llama, True)
    assert graphed.runner.graphs is not None, "CUDA graphs come with the Triton backend on CUDA"
    got = graphed.generate(prompts, params)
    want = _engine(tiny_llama, False).generate(prompts, params)
    assert got == want
    padded = next(s for s in (1, 2, 4, 8) if s >= batch)
    assert padded in graphed.runner.graphs.graphs, "the decode steps of the whole batch ran as a graph"
