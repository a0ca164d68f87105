"""Which attention backend an engine gets, checked when it is built against device, dtype, block size and
head_dim: an explicit choice that cannot run is refused naming the flag, never built to fail every step.
Pure logic, so the CUDA cases run here too (flash-attn's presence is a parameter)."""

from __future__ import annotations

import pytest
import torch

from engine import Engine
from engine.attention import backend_choice

BF16, F32, F16 = torch.bfloat16, torch.float32, torch.float16


@pytest.mark.parametrize("device,dtype,block,head_dim,cpu_ops,flash,want", [
    ("cpu", F32, 16, 64, True, False, "cpu"),
    ("cpu", BF16, 16, 64, False, False, "torch"),
    ("cuda", BF16, 256, 128, False, True, "flash_attn"),
    ("cuda", F16, 512, 64, False, True, "flash_attn"),
    ("cuda", BF16, 16, 128, False, True, "sdpa"),  # 16-token blocks are no flash-attn page, and no Triton here
    ("cuda", F32, 256, 128, False, True, "sdpa"),  # flash-attn rejects float32
    ("cuda", BF16, 256, 96 + 4, False, True, "sdpa"),  # head_dim not a multiple of 8
    ("cuda", BF16, 256, 128, False, False, "sdpa"),  # not installed
    ("other", F32, 16, 64, False, False, "torch"),
])
def test_auto_picks_what_can_run(device, dtype, block, head_dim, cpu_ops, flash, want):
    assert backend_choice("auto", device, dtype, block, head_dim, cpu_ops, flash) == want


@pytest.mark.parametrize("device,dtype,block,flash,message", [
    ("cuda", BF16, 16, True, "--block-size a multiple of 256, not 16"),
    ("cuda", F32, 256, True, "float16 or bfloat16, not float32 (--dtype)"),
    ("cuda", BF16, 256, False, "flash-attn package is not installed"),
    ("cpu", BF16, 256, True, "needs --device cuda"),
])
def test_an_explicit_flash_attn_that_cannot_run_is_refused_naming_the_flag(device, dtype, block, flash, message):
    with pytest.raises(ValueError, match="--attention-backend flash_attn cannot run here") as err:
        backend_choice("flash_attn", device, dtype, block, 64, False, flash)
    assert message in str(err.value) and "--attention-backend auto" in str(err.value)


@pytest.mark.parametrize("dtype,block,head_dim,flash,want", [
    (BF16, 16, 128, True, "triton"),  # the prefix cache's blocks: Triton's paged kernel, not SDPA
    (F32, 16, 64, False, "triton"),  # float32 too
    (BF16, 256, 128, True, "flash_attn"),  # flash-attn where its pages fit
    (BF16, 24, 128, False, "sdpa"),  # not a power of two
    (BF16, 16, 96, False, "sdpa"),  # head_dim not a power of two
])
def test_auto_on_cuda_with_triton(dtype, block, head_dim, flash, want):
    assert backend_choice("auto", "cuda", dtype, block, head_dim, False, flash, has_triton=True) == want


@pytest.mark.parametrize("device,block,head_dim,triton,message", [
    ("cpu", 16, 64, True, "needs --device cuda"),
    ("cuda", 16, 64, False, "triton package is not installed"),
    ("cuda", 24, 64, True, "--block-size a power of two, not 24"),
    ("cuda", 16, 80, True, "power of two from 16 to 256, and this model's is 80"),
])
def test_an_explicit_triton_that_cannot_run_is_refused_naming_the_flag(device, block, head_dim, triton, message):
    with pytest.raises(ValueError, match="--attention-backend triton cannot run here") as err:
        backend_choice("triton", device, BF16, block, head_dim, False, False, has_triton=triton)
    assert message in str(err.value)


def test_other_explicit_choices():
    assert backend_choice("sdpa", "cuda", BF16, 16, 64, False, True) == "sdpa"
    assert backend_choice("torch", "cpu", F32, 16, 64, True, False) == "torch"
    with pytest.raises(ValueError, match="--attention-backend cpu needs --device cpu"):
        backend_choice("cpu", "cuda", BF16, 16, 64, False, False)
    with pytest.raises(ValueError, match="--no-cpu-kernels"):
        backend_choice("cpu", "cpu", F32, 16, 64, False, False)
    assert backend_choice("triton", "cuda", F32, 16, 64, False, False, has_triton=True) == "triton"
    with pytest.raises(ValueError, match="unknown attention backend 'paged'"):
        backend_choice("paged", "cpu", F32, 16, 64, True, False)


def test_an_engine_with_a_backend_that_cannot_run_fails_at_build(tiny_llama):
    with pytest.raises(ValueError, match="--attention-backend flash_attn cannot run here: it needs --device cuda"):
        Engine.from_model(str(tiny_llama), num_kv_blocks=8, attention_backend="flash_attn")
