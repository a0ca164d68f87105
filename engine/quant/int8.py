"""int8 per-channel weights from a float checkpoint (``--quantization int8``)."""

from __future__ import annotations

import torch

from engine.quant.weight import QuantizedWeight


def quantize_int8(w: torch.Tensor) -> QuantizedWeight:
    """Symmetric per output channel: q = round(w / s) in [-127, 127], s = max|w| / 127 of the row.

    Stored as u = q + 128 with zero point 128, the unsigned form the kernel's integer dot products take.
    """
    w = w.float()
    s = w.abs().amax(dim=1, keepdim=True) / 127.0
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    q = torch.round(w * inv).clamp_(-127, 127)
    return QuantizedWeight.from_values((q + 128).to(torch.uint8), s, None, 128, 8, "int8")
