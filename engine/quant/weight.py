"""``QuantizedWeight``: a linear layer's weight as block-quantized integers, packed for the kernel."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from engine.quant.packing import BLOCK, ROW_MULTIPLE, pack, pad_rows, unpack


@dataclass(frozen=True)
class QuantizedWeight:
    """w[n, k] = scale[n, k // 32] * u[n, k] + offset[n, k // 32] (scale/offset [N, 1]: one per row).

    ``data`` holds u in the kernel's layout; rows are padded to a multiple of 4 (zero scales), and
    ``rows`` is the real count. ``kind`` names the source format (``q4_0``, ``q4_1``, ``q8_0``, ``int8``).
    """

    data: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    bits: int
    rows: int
    cols: int
    kind: str

    @classmethod
    def from_values(cls, u: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int,
                    kind: str) -> QuantizedWeight:
        """From unpacked values ``u`` [N, K] (uint8) and float32 scales/offsets [N, K/32] or [N, 1]."""
        n, k = u.shape
        if k % BLOCK:
            raise ValueError(f"quantized weights need K to be a multiple of {BLOCK}, got {k}")
        padded = -(-n // ROW_MULTIPLE) * ROW_MULTIPLE
        return cls(
            data=pad_rows(pack(u.to(torch.uint8), bits), padded),
            scale=pad_rows(scale.to(torch.float32), padded),
            offset=pad_rows(offset.to(torch.float32), padded),
            bits=bits, rows=n, cols=k, kind=kind,
        )

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.rows, self.cols))

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        """Bytes a matmul reads: the packed values and their scales and offsets."""
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.offset))

    def values(self) -> torch.Tensor:
        """The unsigned values u [N, K] (padding rows dropped)."""
        return unpack(self.data, self.cols, self.bits)[: self.rows]

    def to(self, device: torch.device | str) -> QuantizedWeight:
        return replace(self, data=self.data.to(device), scale=self.scale.to(device), offset=self.offset.to(device))

    def widened(self) -> QuantizedWeight:
        """The same weight as 8-bit values (exact: a 4-bit value is a valid 8-bit one)."""
        if self.bits == 8:
            return self
        return QuantizedWeight.from_values(self.values(), self.scale[: self.rows], self.offset[: self.rows], 8,
                                           self.kind)


def dequantize(w: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight [N, K]: scale * u + offset in float32, then cast."""
    u = w.values().to(torch.float32).view(w.rows, -1, BLOCK) if w.scale.shape[1] != 1 else w.values().float()
    scale, offset = w.scale[: w.rows], w.offset[: w.rows]
    if w.scale.shape[1] == 1:
        return (u * scale + offset).to(dtype)
    return (u * scale[..., None] + offset[..., None]).view(w.rows, w.cols).to(dtype)


def concat_rows(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Fused projections (q|k|v, gate|up): rows stacked, in one width and one scale granularity."""
    bits = max(w.bits for w in weights)
    per_row = all(w.scale.shape[1] == 1 for w in weights)
    parts = [w.widened() if w.bits != bits else w for w in weights]
    nb = weights[0].cols // BLOCK

    def rows_of(t: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
        t = t[: w.rows]
        return t if per_row or t.shape[1] != 1 else t.expand(-1, nb)

    kinds = sorted({w.kind for w in weights})
    return QuantizedWeight.from_values(
        torch.cat([p.values() for p in parts]),
        torch.cat([rows_of(p.scale, p) for p in parts]),
        torch.cat([rows_of(p.offset, p) for p in parts]),
        bits, "+".join(kinds),
    )
