"""The kernel's byte layout (see ``engine/csrc/quant_ops.cpp``), in both directions.

A row's 32-blocks go in chunks of 16. Inside a chunk of L blocks, step s (0..7) holds bytes 4s..4s+3
of each block, block after block, so that 32-bit lane l of a vector load belongs to block l; 4-bit
values put step 2t in the low nibble and step 2t+1 in the high nibble of one byte.
"""

from __future__ import annotations

from functools import cache

import torch

BLOCK = 32
CHUNK = 16
ROW_MULTIPLE = 4  # the kernel reads weight rows four at a time


@cache
def layout_order(k: int) -> torch.Tensor:
    """For each byte position of an 8-bit row in layout order, the column k it holds."""
    nb = k // BLOCK
    order = []
    for c in range(0, nb, CHUNK):
        lanes = min(CHUNK, nb - c)
        for s in range(8):
            for lane in range(lanes):
                base = (c + lane) * BLOCK + 4 * s
                order.extend(range(base, base + 4))
    return torch.tensor(order, dtype=torch.long)


@cache
def nibble_order(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For a 4-bit row: the columns of each byte's low and high nibble."""
    nb, low, high = k // BLOCK, [], []
    order = layout_order(k).tolist()
    pos = 0
    for c in range(0, nb, CHUNK):
        step = 4 * min(CHUNK, nb - c)
        for t in range(4):
            low.extend(order[pos + 2 * t * step : pos + (2 * t + 1) * step])
            high.extend(order[pos + (2 * t + 1) * step : pos + (2 * t + 2) * step])
        pos += 8 * step
    return torch.tensor(low, dtype=torch.long), torch.tensor(high, dtype=torch.long)


def pack(u: torch.Tensor, bits: int) -> torch.Tensor:
    """Values ``u`` [N, K] (uint8, < 2**bits) -> layout bytes [N, K * bits / 8]."""
    k = u.shape[1]
    if bits == 8:
        return u[:, layout_order(k)].contiguous()
    low, high = nibble_order(k)
    return (u[:, low] | (u[:, high] << 4)).contiguous()


def unpack(data: torch.Tensor, k: int, bits: int) -> torch.Tensor:
    """Layout bytes -> values [N, K] (uint8)."""
    u = torch.empty(data.shape[0], k, dtype=torch.uint8, device=data.device)
    if bits == 8:
        u[:, layout_order(k).to(data.device)] = data
        return u
    low, high = (t.to(data.device) for t in nibble_order(k))
    u[:, low] = data & 0x0F
    u[:, high] = data >> 4
    return u


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended up to ``rows`` (zero scale: those outputs are never read)."""
    if t.shape[0] == rows:
        return t.contiguous()
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]).contiguous()
