"""The quantized matmul in plain torch: what the CPU kernel computes, for tests and other devices.

x is quantized per 32-block to int8 exactly as the kernel does it (d = max|x| / 127, q = round half to
even of x * (1 / d)); the products are then exact integers, so the kernel and this reference differ
only in the order float32 sums are taken.
"""

from __future__ import annotations

import functools

import torch

from engine.quant.packing import BLOCK
from engine.quant.weight import QuantizedWeight, dequantize


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K/32, 32] int8 values as float32, d [M, K/32])."""
    xb = x.float().view(x.shape[0], -1, BLOCK)
    d = xb.abs().amax(dim=-1) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    return torch.round(xb * inv[..., None]), d


def qlinear_reference(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T in float64 from the int8 activations the kernel uses: exact up to summation order."""
    q, d = quantize_activations(x)
    xq = (q.double() * d.double()[..., None]).view(x.shape[0], -1)
    y = xq @ dequantize(w, torch.float64).T
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype)


def qlinear_dequantized(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The portable path (no CPU kernels, other devices): dequantize, then an ordinary matmul. bfloat16 on a CPU
    whose oneDNN has no bfloat16 GEMM (no AVX-512) multiplies the same bfloat16 values in float32: torch's own
    bfloat16 GEMM there ran 4.7 GFLOP/s against float32's 36 (an AVX2 EPYC, one thread, 512 x 576 x 1536)."""
    weight = dequantize(w, x.dtype).to(x.device)
    if x.dtype == torch.bfloat16 and x.device.type == "cpu" and not cpu_bf16_gemm():
        out = torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
        return out.to(x.dtype)
    return torch.nn.functional.linear(x, weight, bias)


@functools.cache
def cpu_bf16_gemm() -> bool:
    """Whether torch multiplies bfloat16 matrices through oneDNN on this CPU (else by a scalar fallback)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
