"""``dense_linear``: torch's matmul, through float32 for bfloat16 where oneDNN has no bfloat16 GEMM."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine import dense_linear as dense


def _case(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 96, generator=g).to(dtype)
    w = (torch.randn(40, 96, generator=g) / 10).to(dtype)
    return x, w, torch.randn(40, generator=g).to(dtype)


def _spy_on_gemm_dtypes(monkeypatch) -> list[torch.dtype]:
    """The dtypes torch's matmul is called with, recorded on the way through."""
    seen, linear = [], F.linear

    def spy(x, w, b=None):
        seen.append(x.dtype)
        return linear(x, w, b)

    monkeypatch.setattr(dense.F, "linear", spy)
    return seen


def test_without_a_bfloat16_gemm_bfloat16_is_multiplied_in_float32_and_rounded_once(monkeypatch):
    """What an AVX2 CPU gets: the float32 product of the same values, rounded to bfloat16 at the end."""
    monkeypatch.setattr(dense, "cpu_bf16_gemm", lambda: False)
    x, w, b = _case(torch.bfloat16)
    want = F.linear(x.float(), w.float(), b.float()).to(torch.bfloat16)
    want_no_bias = F.linear(x.float(), w.float()).to(torch.bfloat16)
    seen = _spy_on_gemm_dtypes(monkeypatch)
    out, no_bias = dense.dense_linear(x, w, b), dense.dense_linear(x, w)
    assert seen == [torch.float32, torch.float32]
    assert torch.equal(out, want) and torch.equal(no_bias, want_no_bias)


def test_float32_and_cpus_with_a_bfloat16_gemm_take_torch_as_is(monkeypatch):
    x, w, b = _case(torch.float32)
    assert torch.equal(dense.dense_linear(x, w, b), F.linear(x, w, b))
    monkeypatch.setattr(dense, "cpu_bf16_gemm", lambda: True)
    x, w, b = _case(torch.bfloat16)
    seen = _spy_on_gemm_dtypes(monkeypatch)
    out = dense.dense_linear(x, w, b)
    assert seen == [torch.bfloat16]
    assert torch.equal(out, F.linear(x, w, b))
