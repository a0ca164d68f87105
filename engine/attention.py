"""Attention over the paged KV cache, behind one interface with several backends.

The cache of one layer is a tensor ``[2, num_blocks * block_size, num_kv_heads,
head_dim]``: block ``b`` holds slots ``b*block_size ... (b+1)*block_size - 1``.
``AttentionMetadata`` is built once per step from the block tables and shared by
every layer, so per-layer work is only the kernel calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillSpan:
    """One request's query tokens this step that attend over ``context_len`` cached tokens."""

    start: int
    length: int
    context_len: int
    context_blocks: torch.Tensor | None  # None when the span is the whole context (no earlier tokens)
    mask: torch.Tensor | None  # causal mask offset by the earlier context


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] cache slot each new token's K/V is written to
    decode_token_index: torch.Tensor | None  # [num_decodes] positions in the step's token stream
    decode_blocks: torch.Tensor | None  # [num_decodes * max_blocks] block ids to read, row-major
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size] True where attended
    prefills: list[PrefillSpan]
    # what the flash-attn backend needs
    block_tables: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None


def build_metadata(
    spans: list[tuple[int, int, list[int]]], block_size: int, device: torch.device
) -> AttentionMetadata:
    """Turn (num_computed_before, num_new, block_ids) per request into step metadata."""
    slots, dec_index, dec_lens, dec_tables, prefills = [], [], [], [], []
    start = 0
    for computed, new, block_ids in spans:
        blocks = torch.tensor(block_ids, dtype=torch.long)
        positions = torch.arange(computed, computed + new)
        slots.append(blocks[positions // block_size] * block_size + positions % block_size)
        context = computed + new
        if new == 1:
            dec_index.append(start)
            dec_lens.append(context)
            dec_tables.append(blocks)
        else:
            prefills.append(_prefill_span(start, new, context, blocks, block_size, device))
        start += new
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots).to(device),
        decode_token_index=None,
        decode_blocks=None,
        decode_mask=None,
        prefills=prefills,
    )
    if dec_index:
        _add_decode_metadata(meta, dec_index, dec_lens, dec_tables, block_size, device)
    return meta


def _prefill_span(
    start: int, new: int, context: int, blocks: torch.Tensor, block_size: int, device: torch.device
) -> PrefillSpan:
    if context == new:
        return PrefillSpan(start, new, context, None, None)
    ctx_blocks = blocks[: -(-context // block_size)]
    mask = torch.ones(new, context, dtype=torch.bool).tril(context - new)
    return PrefillSpan(start, new, context, ctx_blocks.to(device), mask.to(device))


def _add_decode_metadata(
    meta: AttentionMetadata,
    index: list[int],
    lens: list[int],
    tables: list[torch.Tensor],
    block_size: int,
    device: torch.device,
) -> None:
    max_len = max(lens)
    max_blocks = -(-max_len // block_size)
    table = torch.zeros(len(tables), max_blocks, dtype=torch.long)
    for i, t in enumerate(tables):
        table[i, : len(t)] = t[:max_blocks]
    width = max_blocks * block_size
    positions = torch.arange(width)
    lens_t = torch.tensor(lens)
    meta.decode_token_index = torch.tensor(index, device=device)
    meta.decode_blocks = table.flatten().to(device)
    meta.decode_mask = (positions[None, :] < lens_t[:, None]).view(len(lens), 1, 1, width).to(device)
    meta.block_tables = table.to(device=device, dtype=torch.int32)
    meta.context_lens = lens_t.to(device=device, dtype=torch.int32)


class AttentionBackend:
    """Writes the step's K/V into the cache and attends; one instance serves every layer."""

    name = "base"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D], kv: this layer's cache. Returns [T, Hq * D]."""
        kv[0].index_copy_(0, meta.slot_mapping, k)
        kv[1].index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        if meta.decode_token_index is not None:
            out[meta.decode_token_index] = self.decode(q[meta.decode_token_index], kv, meta)
        for span in meta.prefills:
            sl = slice(span.start, span.start + span.length)
            out[sl] = self.prefill(q[sl], k[sl], v[sl], kv, span)
        return out.view(q.shape[0], -1)

    def decode(self, q: torch.Tensor, kv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        raise NotImplementedError

    def prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, span: PrefillSpan
    ) -> torch.Tensor:
        raise NotImplementedError


class TorchAttentionBackend(AttentionBackend):
    """Portable backend: gathers the paged context block by block, then uses torch SDPA.

    Gathering whole blocks with ``index_select`` copies rows of block_size * heads *
    head_dim elements; per-slot indexing is an order of magnitude slower on CPU.
    """

    name = "torch"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim)
        self.block_size = block_size

    def gather(self, cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """[n_blocks] block ids -> [n_blocks * block_size, Hkv, D] of one K or V cache."""
        rows = cache.view(-1, self.block_size * self.num_kv_heads * self.head_dim).index_select(0, blocks)
        return rows.view(-1, self.num_kv_heads, self.head_dim)

    def decode(self, q: torch.Tensor, kv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # Grouped heads become the query length, so GQA needs no repeated K/V.
        b, group = q.shape[0], self.num_heads // self.num_kv_heads
        qg = q.view(b, self.num_kv_heads, group, self.head_dim)
        shape = (b, -1, self.num_kv_heads, self.head_dim)
        keys = self.gather(kv[0], meta.decode_blocks).view(shape).transpose(1, 2)  # [B, Hkv, L, D]
        values = self.gather(kv[1], meta.decode_blocks).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=meta.decode_mask, scale=self.scale)
        return out.reshape(b, self.num_heads, self.head_dim)

    def prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, span: PrefillSpan
    ) -> torch.Tensor:
        if span.context_blocks is not None:
            k = self.gather(kv[0], span.context_blocks)[: span.context_len]
            v = self.gather(kv[1], span.context_blocks)[: span.context_len]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            attn_mask=span.mask,
            is_causal=span.mask is None,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return out.transpose(0, 1)


class FlashAttnBackend(TorchAttentionBackend):
    """CUDA only: flash-attn's paged KV kernel for decode, SDPA for prefill spans.

    flash-attn's paged cache needs a block size that is a multiple of 256; with
    smaller blocks the engine uses the torch backend instead.
    """

    name = "flash_attn"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, block_size)
        from flash_attn import flash_attn_with_kvcache

        self._kernel = flash_attn_with_kvcache

    def decode(self, q: torch.Tensor, kv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        shape = (-1, self.block_size, self.num_kv_heads, self.head_dim)
        out = self._kernel(
            q.unsqueeze(1),
            kv[0].view(shape),
            kv[1].view(shape),
            cache_seqlens=meta.context_lens,
            block_table=meta.block_tables,
            softmax_scale=self.scale,
            causal=True,
        )
        return out.squeeze(1)


def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def select_backend(
    name: str, device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> AttentionBackend:
    """``auto``: flash-attn's paged kernel on CUDA when importable and the block size allows, else torch."""
    if name == "auto":
        usable = device.type == "cuda" and flash_attn_available() and block_size % 256 == 0
        name = "flash_attn" if usable else "torch"
    if name == "flash_attn":
        if device.type != "cuda" or not flash_attn_available():
            raise ValueError("attention_backend 'flash_attn' needs CUDA and the flash-attn package")
        return FlashAttnBackend(num_heads, num_kv_heads, head_dim, block_size)
    if name in ("torch", "sdpa"):
        return TorchAttentionBackend(num_heads, num_kv_heads, head_dim, block_size)
    raise ValueError(f"unknown attention backend {name!r}; choose auto, torch, sdpa or flash_attn")
