"""torch's own matmul for the eager paths (``--no-cpu-kernels``, dequantized weights, other devices).

On a CPU whose oneDNN has no bfloat16 GEMM (no AVX-512: Zen 1-3, Intel's Haswell to Alder Lake) torch multiplies
bfloat16 by a scalar fallback, 4.7 GFLOP/s against float32's 36 (an AVX2 EPYC, one thread, 512 x 576 x 1,536).
There the same bfloat16 values are multiplied in float32 (they widen exactly) and the result rounded once.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, through float32 where bfloat16 would take torch's slow CPU fallback."""
    if x.dtype == torch.bfloat16 and x.device.type == "cpu" and not cpu_bf16_gemm():
        out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        return out.to(x.dtype)
    return F.linear(x, weight, bias)


@functools.cache
def cpu_bf16_gemm() -> bool:
    """Whether torch multiplies bfloat16 matrices through oneDNN on this CPU (else by a scalar fallback)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
