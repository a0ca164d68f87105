"""The kernel's byte layout (see ``engine/csrc/quant_ops.cpp``), in both directions.

Rows go in groups of 16, one per 32-bit lane. For each group and 32-block, step s (0..7) is 64 bytes: bytes
4s..4s+3 of the block of each of the 16 rows, row after row. 4-bit values put step 2t in the low nibble and
step 2t+1 in the high nibble of one byte. Per-block scales (and offsets) follow the same order:
[groups, blocks, 16].
"""

from __future__ import annotations

import torch

BLOCK = 32
GROUP = 16
ROW_MULTIPLE = GROUP  # the kernel computes 16 rows at a time


def pack(u: torch.Tensor, bits: int) -> torch.Tensor:
    """Values ``u`` [N, K] (uint8, < 2**bits; N a multiple of 16) -> layout bytes [N/16, K/32, 512 * bits / 8]."""
    n, k = u.shape
    g, nb = n // GROUP, k // BLOCK
    if bits == 8:
        return u.view(g, GROUP, nb, 8, 4).permute(0, 2, 3, 1, 4).reshape(g, nb, 512).contiguous()
    steps = u.view(g, GROUP, nb, 4, 2, 4).permute(0, 2, 3, 4, 1, 5)  # [g, nb, t, low/high, lane, byte]
    return (steps[:, :, :, 0] | (steps[:, :, :, 1] << 4)).reshape(g, nb, 256).contiguous()


def unpack(data: torch.Tensor, bits: int) -> torch.Tensor:
    """Layout bytes -> values [N, K] (uint8)."""
    g, nb, _ = data.shape
    if bits == 8:
        return data.view(g, nb, 8, GROUP, 4).permute(0, 3, 1, 2, 4).reshape(g * GROUP, nb * BLOCK)
    packed = data.view(g, nb, 4, GROUP, 4)
    steps = torch.stack([packed & 0x0F, packed >> 4], dim=3)  # [g, nb, t, low/high, lane, byte]
    return steps.permute(0, 4, 1, 2, 3, 5).reshape(g * GROUP, nb * BLOCK)


def pack_blocks(t: torch.Tensor) -> torch.Tensor:
    """Per-block values [N, K/32] -> [N/16, K/32, 16]."""
    n, nb = t.shape
    return t.view(n // GROUP, GROUP, nb).permute(0, 2, 1).contiguous()


def unpack_blocks(t: torch.Tensor) -> torch.Tensor:
    g, nb, _ = t.shape
    return t.permute(0, 2, 1).reshape(g * GROUP, nb)


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended up to ``rows`` (zero scale: those outputs are never read)."""
    if t.shape[0] == rows:
        return t.contiguous()
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]).contiguous()
