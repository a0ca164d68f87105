"""FP8 weights for CUDA (``--quantization fp8``): e4m3 values with one float32 scale per output channel,
multiplied by ``torch._scaled_mm`` on the GPU's FP8 tensor cores (compute capability 8.9 and newer: Ada,
Hopper, Blackwell). Activations are cast to e4m3 per call with one dynamic scale per tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448
MIN_CAPABILITY = (8, 9)


def fp8_supported(device: torch.device) -> tuple[bool, str]:
    """Whether ``device`` multiplies FP8 on tensor cores, and why not when it does not."""
    if device.type != "cuda":
        return False, f"FP8 weights run on CUDA GPUs only, not on {device.type}"
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        return False, (f"{torch.cuda.get_device_name(device)} (compute capability {cap[0]}.{cap[1]}) has no FP8 "
                       f"tensor cores; FP8 needs {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer")
    return True, ""


@dataclass(frozen=True)
class Fp8Weight:
    """w[n, k] = scale[n] * q[n, k], q in e4m3. ``q_t`` is q transposed in column-major order, as
    ``_scaled_mm`` takes its second operand."""

    q_t: torch.Tensor  # [K, N], column-major (a transposed view of a contiguous [N, K])
    scale: torch.Tensor  # [N] float32

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.q_t.shape[1], self.q_t.shape[0]))

    @property
    def device(self) -> torch.device:
        return self.q_t.device

    @property
    def nbytes(self) -> int:
        return self.q_t.nbytes + self.scale.nbytes

    def to(self, device: torch.device | str) -> Fp8Weight:
        return replace(self, q_t=self.q_t.t().contiguous().to(device).t(), scale=self.scale.to(device))


def quantize_fp8(w: torch.Tensor) -> Fp8Weight:
    """Per output channel: scale = max|w| / 448, q = e4m3(w / scale)."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    q = (w / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return Fp8Weight(q_t=q.t(), scale=scale)


def dequantize_fp8(w: Fp8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (w.q_t.t().float() * w.scale[:, None]).to(dtype)


def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T through ``_scaled_mm``: x cast to e4m3 with one scale (max|x| / 448), the weight's per-channel
    scales applied to the output. Shapes the tensor cores refuse (dimensions not multiples of 16) fall back to
    a dequantized matmul."""
    n, k = w.shape
    if k % 16 or n % 16:
        return torch.nn.functional.linear(x, dequantize_fp8(w, x.dtype), bias)
    x_scale = (x.abs().amax().float() / E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    xq = (x.float() / x_scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    out = torch._scaled_mm(xq, w.q_t, scale_a=x_scale.reshape(()), scale_b=_unit(x.device), out_dtype=torch.float32)
    out = out * w.scale
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


@cache
def _unit(device: torch.device) -> torch.Tensor:
    """The weight operand's scale (1: its per-channel scales apply to the output), made once per device rather
    than on every matmul."""
    return torch.ones((), device=device)
