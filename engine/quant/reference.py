"""The quantized matmul in plain torch: what the CPU kernel computes, for tests and other devices.

x is quantized per 32-block to int8 exactly as the kernel does it (d = max|x| / 127, q = round half to
even of x * (1 / d)); the products are then exact integers, so the kernel and this reference differ
only in the order float32 sums are taken.
"""

from __future__ import annotations

import torch

from engine.dense_linear import dense_linear
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
    """The portable path (no CPU kernels, other devices): dequantize, then torch's matmul (``dense_linear``)."""
    return dense_linear(x, dequantize(w, x.dtype).to(x.device), bias)
