"""The compiled decode stack (``cpu_ops.DecodeStack``): the model's layers for an all-decode step in one call,
which must give the Python forward's bits, serve only what it was built for, and refuse bad input cleanly."""

from __future__ import annotations

import random

import pytest
import torch

from engine import Engine, SamplingParams
from engine.kernels import CpuKernels
from tests.unit.test_engine_correctness import batch_logprobs


def _engine(path, dtype: str, stack: bool, **overrides) -> Engine:
    engine = Engine.from_model(str(path), num_kv_blocks=64, dtype=dtype, **overrides)
    if not stack:
        engine.runner.model.decode_stack = None
    return engine


class _Counted:
    """The engine's stack, counting the steps it ran."""

    def __init__(self, stack) -> None:
        self.stack, self.calls = stack, 0

    def forward(self, *args):
        self.calls += 1
        return self.stack.forward(*args)


def _packs(engine: Engine, dtype: str) -> bool:
    kernels = engine.runner.model.kernels
    return isinstance(kernels, CpuKernels) and getattr(torch, dtype) in kernels.packed


@pytest.mark.parametrize("name", ["llama", "llama-mha-tied", "qwen2", "mistral"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_steps_through_the_stack_equal_the_python_forward_bit_for_bit(tiny_models, name, dtype):
    """Prefills of four lengths, then decodes at four context lengths: every token and every logprob the same,
    exactly (the stack calls the same kernels in the same order; qwen2 adds the q/k/v bias)."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (1, 9, 40, 77)]
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=3, ignore_eos=True)
    with_stack = _engine(tiny_models[name], dtype, stack=True)
    if not _packs(with_stack, dtype):
        assert with_stack.runner.model.decode_stack is None  # no packed kernel for this dtype on this CPU
        return
    assert with_stack.runner.model.decode_stack is not None
    assert len(with_stack.runner.model.decode_stack) == len(with_stack.runner.model.layers)
    ref = batch_logprobs(_engine(tiny_models[name], dtype, stack=False), prompts, params)
    counted = with_stack.runner.model.decode_stack = _Counted(with_stack.runner.model.decode_stack)
    got = batch_logprobs(with_stack, prompts, params)
    assert counted.calls == params.max_tokens - 1  # every step after the prefill
    for ref_steps, got_steps in zip(ref, got, strict=True):
        assert [(s.token_id, s.logprob, s.top) for s in got_steps] == \
            [(s.token_id, s.logprob, s.top) for s in ref_steps]


def test_the_stack_is_built_only_for_packed_matrices(tiny_llama):
    """Quantized matrices and the eager kernels have no stack: their steps run the Python forward."""
    assert _engine(tiny_llama, "float32", stack=True, quantization="int8").runner.model.decode_stack is None
    assert _engine(tiny_llama, "float32", stack=True, cpu_kernels=False).runner.model.decode_stack is None


def test_the_stack_refuses_caches_of_another_depth(tiny_llama):
    engine = _engine(tiny_llama, "float32", stack=True)
    model, runner = engine.runner.model, engine.runner
    if model.decode_stack is None:
        pytest.skip("no packed float32 kernel on this CPU")
    x = torch.zeros(1, model.config.hidden_size)
    one = torch.zeros(1, dtype=torch.long)
    table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="one KV cache per layer"):
        model.decode_stack.forward(x, one, model.cos, model.sin, runner.kv_caches[:-1], one, table, lens,
                                   runner.attn.block_size, runner.attn.scale)
