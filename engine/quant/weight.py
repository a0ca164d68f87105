"""``QuantizedWeight``: a linear layer's weight as block-quantized integers, packed for the kernel."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from engine.quant.packing import BLOCK, ROW_MULTIPLE, pack, pack_blocks, pad_rows, unpack, unpack_blocks


@dataclass(frozen=True)
class QuantizedWeight:
    """w[n, k] = scale[n, k // 32] * u[n, k] + offset[n, k // 32], or scale * (u - zero) without offsets.

    Block formats keep GGUF's float16 scales (and Q4_1's float16 mins as ``offset``) as they are, so a matmul
    reads the file's bytes and no more; int8 per channel has one float32 scale per row. ``data``, ``scale`` and
    ``offset`` are in the kernel's layout (``engine.quant.packing``); rows are padded to a multiple of 16 (zero
    scales), and ``rows`` is the real count.
    ``kind`` names the source format (``q4_0``, ``q4_1``, ``q8_0``, ``int8``).
    """

    data: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    zero: int
    bits: int
    rows: int
    cols: int
    kind: str

    @classmethod
    def from_values(cls, u: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, zero: int, bits: int,
                    kind: str) -> QuantizedWeight:
        """From unpacked values ``u`` [N, K] (uint8): float16 scales [N, K/32] (offsets the same, or None), or
        float32 scales [N, 1] (per row, no offsets)."""
        n, k = u.shape
        if k % BLOCK:
            raise ValueError(f"quantized weights need K to be a multiple of {BLOCK}, got {k}")
        per_block = scale.dtype == torch.float16 and scale.shape == (n, k // BLOCK)
        per_row = scale.dtype == torch.float32 and scale.shape == (n, 1) and offset is None
        if not (per_block or per_row) or (offset is not None and offset.shape != scale.shape) or (
                offset is not None and offset.dtype != torch.float16):
            raise ValueError("scales are float16 per block (offsets too) or float32 per row (no offsets)")
        padded = -(-n // ROW_MULTIPLE) * ROW_MULTIPLE
        return cls(
            data=pack(pad_rows(u.to(torch.uint8), padded), bits),
            scale=pad_rows(scale, padded).view(-1) if per_row else pack_blocks(pad_rows(scale, padded)),
            offset=None if offset is None else pack_blocks(pad_rows(offset, padded)),
            zero=zero, bits=bits, rows=n, cols=k, kind=kind,
        )

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.rows, self.cols))

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def per_row(self) -> bool:
        return self.scale.dtype == torch.float32

    @property
    def nbytes(self) -> int:
        """Bytes a matmul reads: the packed values and their scales and offsets."""
        parts = [self.data, self.scale] + ([self.offset] if self.offset is not None else [])
        return sum(t.numel() * t.element_size() for t in parts)

    def values(self) -> torch.Tensor:
        """The unsigned values u [N, K] (padding rows dropped)."""
        return unpack(self.data, self.bits)[: self.rows]

    def scales(self) -> torch.Tensor:
        """Scales as given: float16 [N, K/32], or float32 [N, 1] per row."""
        if self.per_row:
            return self.scale[: self.rows, None]
        return unpack_blocks(self.scale)[: self.rows]

    def offsets(self) -> torch.Tensor | None:
        return None if self.offset is None else unpack_blocks(self.offset)[: self.rows]

    def block_offsets(self) -> torch.Tensor:
        """The offset of every block (or row) in float32: the stored one, or -zero * scale."""
        offsets = self.offsets()
        return offsets.float() if offsets is not None else -float(self.zero) * self.scales().float()

    def to(self, device: torch.device | str) -> QuantizedWeight:
        offset = None if self.offset is None else self.offset.to(device)
        return replace(self, data=self.data.to(device), scale=self.scale.to(device), offset=offset)

    def widened(self) -> QuantizedWeight:
        """The same weight as 8-bit values (exact: a 4-bit value is a valid 8-bit one)."""
        if self.bits == 8:
            return self
        return QuantizedWeight.from_values(self.values(), self.scales(), self.offsets(), self.zero, 8, self.kind)


def dequantize(w: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight [N, K]: scale * u + offset in float32 (exact for GGUF's float16 scales), then cast."""
    u, scale, offset = w.values().float(), w.scales().float(), w.block_offsets()
    if w.per_row:
        return (u * scale + offset).to(dtype)
    u = u.view(w.rows, -1, BLOCK)
    return (u * scale[..., None] + offset[..., None]).view(w.rows, w.cols).to(dtype)


def concat_rows(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Fused projections (q|k|v, gate|up): rows stacked, in one width (4-bit rows widen exactly to 8 bits).

    Parts with different zero points or with and without offsets get explicit float16 offsets (-zero * scale,
    exact: a power-of-two multiple of a float16)."""
    if len({w.per_row for w in weights}) != 1:
        raise ValueError("cannot fuse per-row and per-block quantized weights")
    bits = max(w.bits for w in weights)
    parts = [w.widened() if w.bits != bits else w for w in weights]
    kind = "+".join(sorted({w.kind for w in weights}))
    values = torch.cat([p.values() for p in parts])
    scale = torch.cat([p.scales() for p in parts])
    if all(p.offset is None and p.zero == parts[0].zero for p in parts):
        return QuantizedWeight.from_values(values, scale, None, parts[0].zero, bits, kind)
    if parts[0].per_row:
        raise ValueError("per-row weights fuse only with one zero point")
    offset = torch.cat([p.block_offsets().to(torch.float16) for p in parts])
    return QuantizedWeight.from_values(values, scale, offset, 0, bits, kind)
