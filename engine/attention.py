"""Attention over the paged KV cache, behind one interface with several backends.

A block ``b`` holds the tokens at slots ``b*block_size ... (b+1)*block_size - 1``;
each backend lays the slots of one layer's cache out in the order its kernels read
fastest (``cache_shape``).
``AttentionMetadata`` is built once per step from the block tables and shared by
every layer, so per-layer work is only the kernel calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import numpy as np
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
    block_table: torch.Tensor  # every block of the request (for kernels that read the cache directly)


@dataclass(slots=True)
class DecodeGroup:
    """Decodes of similar context length, attended together over one padded width.

    Grouping by length keeps the padding each decode gathers and attends over
    under 2x its own context, instead of padding every decode to the longest one.
    """

    token_index: torch.Tensor  # [n] positions in the step's token stream
    blocks: torch.Tensor  # [n * max_blocks] block ids to read, row-major
    pad_mask: torch.Tensor  # [1, n, 1, max_blocks * block_size] True on padding
    block_table: torch.Tensor  # [n, max_blocks] int32, for kernels that read the cache directly
    context_lens: torch.Tensor  # [n] int32


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] cache slot each new token's K/V is written to
    decodes: list[DecodeGroup]
    prefills: list[PrefillSpan]
    all_decode: bool = False  # one decode group covering the whole stream, in stream order


MIN_DECODE_GROUP = 8
_Decode = tuple[int, int, torch.Tensor]  # (position in the stream, context length, block ids)


def build_metadata(
    spans: list[tuple[int, int, list[int]]], block_size: int, device: torch.device, group_by_len: bool = True
) -> AttentionMetadata:
    """Turn (num_computed_before, num_new, block_ids) per request into step metadata."""
    if not group_by_len and spans and all(new == 1 for _, new, _ in spans):
        return decode_metadata(spans, block_size, device)
    return general_metadata(spans, block_size, device, group_by_len)


def general_metadata(
    spans: list[tuple[int, int, list[int]]], block_size: int, device: torch.device, group_by_len: bool
) -> AttentionMetadata:
    """``build_metadata`` of any step: prefills, decodes grouped by length or not."""
    slots, decodes, prefills = [], [], []
    start = 0
    for computed, new, block_ids in spans:
        blocks = torch.tensor(block_ids, dtype=torch.long)
        positions = torch.arange(computed, computed + new)
        slots.append(blocks[positions // block_size] * block_size + positions % block_size)
        context = computed + new
        if new == 1:
            decodes.append((start, context, blocks))
        else:
            prefills.append(_prefill_span(start, new, context, blocks, block_size, device))
        start += new
    groups = group_by_length(decodes) if group_by_len else [decodes] if decodes else []
    return AttentionMetadata(
        slot_mapping=torch.cat(slots).to(device),
        decodes=[_decode_group(g, block_size, device) for g in groups],
        prefills=prefills,
        all_decode=not prefills and len(groups) == 1,
    )


def decode_metadata(
    spans: list[tuple[int, int, list[int]]], block_size: int, device: torch.device
) -> AttentionMetadata:
    """``build_metadata`` of a step where every request decodes one token, as one group: the common step of a
    large batch, built with a handful of array operations instead of several tensor ops per request (at 256
    requests that was ~10 ms a step)."""
    n = len(spans)
    max_blocks = -(-max(computed + 1 for computed, _, _ in spans) // block_size)
    table = np.zeros((n, max_blocks), dtype=np.int64)
    lens, slots = fill_decode_table(table, spans, block_size)
    width = max_blocks * block_size
    blocks = torch.from_numpy(table)
    group = DecodeGroup(
        token_index=torch.arange(n, device=device),
        blocks=blocks.flatten().to(device),
        pad_mask=torch.from_numpy(np.arange(width)[None, :] >= lens[:, None]).view(1, n, 1, width).to(device),
        block_table=blocks.to(device=device, dtype=torch.int32),
        context_lens=torch.from_numpy(lens).to(device=device, dtype=torch.int32),
    )
    return AttentionMetadata(slot_mapping=torch.from_numpy(slots).to(device), decodes=[group], prefills=[],
                             all_decode=True)


def fill_decode_table(table: np.ndarray, spans: list[tuple[int, int, list[int]]], block_size: int
                      ) -> tuple[np.ndarray, np.ndarray]:
    """Decode spans' block tables into the first rows of ``table`` (cut at its width); each request's context
    length and the cache slot its new token's K/V goes to."""
    n = len(spans)
    lens = np.fromiter((computed + 1 for computed, _, _ in spans), dtype=np.int64, count=n)
    for i, (_, _, ids) in enumerate(spans):
        k = min(len(ids), table.shape[1])
        table[i, :k] = ids[:k]
    last = lens - 1
    return lens, table[np.arange(n), last // block_size] * block_size + last % block_size


def group_by_length(decodes: list[_Decode]) -> list[list[_Decode]]:
    """Groups whose lengths lie within 2x of the group's longest, each of at least
    MIN_DECODE_GROUP decodes (every group costs one more round of kernel launches)."""
    if len(decodes) < 2 * MIN_DECODE_GROUP:
        return [decodes] if decodes else []
    groups: list[list[_Decode]] = [[]]
    for d in sorted(decodes, key=lambda d: d[1], reverse=True):
        if len(groups[-1]) >= MIN_DECODE_GROUP and d[1] * 2 < groups[-1][0][1]:
            groups.append([])
        groups[-1].append(d)
    if len(groups) > 1 and len(groups[-1]) < MIN_DECODE_GROUP:
        groups[-2].extend(groups.pop())
    return groups if len(groups) > 1 else [decodes]


def _prefill_span(
    start: int, new: int, context: int, blocks: torch.Tensor, block_size: int, device: torch.device
) -> PrefillSpan:
    table = blocks.to(device)
    if context == new:
        return PrefillSpan(start, new, context, None, None, table)
    ctx_blocks = blocks[: -(-context // block_size)]
    mask = torch.ones(new, context, dtype=torch.bool).tril(context - new)
    return PrefillSpan(start, new, context, ctx_blocks.to(device), mask.to(device), table)


def _decode_group(decodes: list[_Decode], block_size: int, device: torch.device) -> DecodeGroup:
    lens = [d[1] for d in decodes]
    max_blocks = -(-max(lens) // block_size)
    table = torch.zeros(len(decodes), max_blocks, dtype=torch.long)
    for i, (_, _, blocks) in enumerate(decodes):
        table[i, : len(blocks)] = blocks[:max_blocks]
    width = max_blocks * block_size
    lens_t = torch.tensor(lens)
    pad = (torch.arange(width)[None, :] >= lens_t[:, None]).view(1, len(lens), 1, width)
    return DecodeGroup(
        token_index=torch.tensor([d[0] for d in decodes], device=device),
        blocks=table.flatten().to(device),
        pad_mask=pad.to(device),
        block_table=table.to(device=device, dtype=torch.int32),
        context_lens=lens_t.to(device=device, dtype=torch.int32),
    )


class AttentionBackend:
    """Writes the step's K/V into the cache and attends; one instance serves every layer.

    A backend also chooses its cache layout (``cache_shape``), since kernels differ
    in what they read fastest.
    """

    name = "base"
    groups_by_length = True  # whether decodes attend in groups of similar length (see DecodeGroup)
    # whether an all-decode step's kernels depend only on the block table's width, not on the lengths, so that
    # a CUDA graph captured at a fixed width replays any step (engine.cuda_graphs)
    static_decode = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.scale = head_dim**-0.5

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        raise NotImplementedError

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D], kv: this layer's cache. Returns [T, Hq * D]."""
        self.write(k, v, kv, meta.slot_mapping)
        if meta.all_decode:  # the common step: no scatter of partial results needed
            return self.decode(q, kv, meta.decodes[0]).reshape(q.shape[0], -1)
        out = torch.empty_like(q)
        for group in meta.decodes:
            out[group.token_index] = self.decode(q[group.token_index], kv, group)
        for span in meta.prefills:
            sl = slice(span.start, span.start + span.length)
            out[sl] = self.prefill(q[sl], k[sl], v[sl], kv, span)
        return out.view(q.shape[0], -1)

    def write(self, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor) -> None:
        raise NotImplementedError

    def read_blocks(self, kv: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """Whole blocks of one layer in the wire layout ``[n, 2, block_size, Hkv, D]`` (a view or a copy)."""
        raise NotImplementedError

    def write_blocks(self, kv: torch.Tensor, block_ids: torch.Tensor, data: torch.Tensor) -> None:
        """The inverse of ``read_blocks``: ``data`` is ``[n, 2, block_size, Hkv, D]``."""
        raise NotImplementedError

    def decode(self, q: torch.Tensor, kv: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
        raise NotImplementedError

    def prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, span: PrefillSpan
    ) -> torch.Tensor:
        raise NotImplementedError


class TorchAttentionBackend(AttentionBackend):
    """Portable backend (CPU or CUDA): gathers the paged context, then matmul-softmax or SDPA.

    The cache is head-major, ``[2, Hkv, slots, D]``, so that gathering whole blocks
    with one ``index_select`` per K and V yields ``[Hkv, B, L, D]``, contiguous and
    ready for batched matmuls without a transpose copy. Per-slot indexing or a
    token-major layout is several times slower on CPU.
    """

    name = "torch"

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (2, self.num_kv_heads, num_blocks * self.block_size, self.head_dim)

    def write(self, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor) -> None:
        kv[0].index_copy_(1, slots, k.transpose(0, 1))
        kv[1].index_copy_(1, slots, v.transpose(0, 1))

    def _block_slots(self, block_ids: torch.Tensor) -> torch.Tensor:
        offsets = torch.arange(self.block_size, device=block_ids.device)
        return (block_ids[:, None] * self.block_size + offsets).flatten()

    def read_blocks(self, kv: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        n = block_ids.shape[0]
        x = kv.index_select(2, self._block_slots(block_ids))  # [2, Hkv, n * bs, D]
        return x.view(2, self.num_kv_heads, n, self.block_size, self.head_dim).permute(2, 0, 3, 1, 4)

    def write_blocks(self, kv: torch.Tensor, block_ids: torch.Tensor, data: torch.Tensor) -> None:
        rows = data.permute(1, 3, 0, 2, 4).reshape(2, self.num_kv_heads, -1, self.head_dim)
        kv.index_copy_(2, self._block_slots(block_ids), rows)

    def gather(self, cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """[n] block ids -> [Hkv, n * block_size, D] from one K or V cache.

        One ``index_select`` over dim 0 per head: on CPU that is up to 10x faster
        than a single ``index_select`` over dim 1 of the whole cache.
        """
        rows = cache.view(self.num_kv_heads, -1, self.block_size * self.head_dim)
        out = rows.new_empty(self.num_kv_heads, blocks.shape[0], rows.shape[-1])
        for head in range(self.num_kv_heads):
            torch.index_select(rows[head], 0, blocks, out=out[head])
        return out.view(self.num_kv_heads, -1, self.head_dim)

    def decode(self, q: torch.Tensor, kv: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
        # Grouped query heads become rows of one matmul per KV head: GQA needs no repeated K/V.
        b, per_kv = q.shape[0], self.num_heads // self.num_kv_heads
        qg = q.view(b, self.num_kv_heads, per_kv, self.head_dim).transpose(0, 1)  # [Hkv, B, G, D]
        keys = self.gather(kv[0], group.blocks).view(self.num_kv_heads, b, -1, self.head_dim)
        values = self.gather(kv[1], group.blocks).view(self.num_kv_heads, b, -1, self.head_dim)
        scores = torch.matmul(qg, keys.transpose(-1, -2)).mul_(self.scale)  # [Hkv, B, G, L]
        scores.masked_fill_(group.pad_mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, values).transpose(0, 1).reshape(b, self.num_heads, self.head_dim)

    def prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, span: PrefillSpan
    ) -> torch.Tensor:
        if span.context_blocks is not None:
            k = self.gather(kv[0], span.context_blocks)[:, : span.context_len]
            v = self.gather(kv[1], span.context_blocks)[:, : span.context_len]
        else:
            k, v = k.transpose(0, 1), v.transpose(0, 1)
        return sdpa_prefill(q, k, v, span.mask, self.scale)


def sdpa_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                 scale: float) -> torch.Tensor:
    """One request's prefill queries ``[L, Hq, D]`` against its keys and values ``[Hkv, C, D]``, causal (offset
    by ``mask`` when earlier context is cached). 4-D inputs: with 3-D ones SDPA takes its slow math path on CPU."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.unsqueeze(0),
        v.unsqueeze(0),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[0],
    )
    return out[0].transpose(0, 1)


class SdpaAttentionBackend(TorchAttentionBackend):
    """The torch backend with decode through ``F.scaled_dot_product_attention`` too.

    The default on CUDA without flash-attn, where SDPA dispatches to fused kernels;
    on CPU the explicit matmul-softmax of the torch backend is faster for decode.
    """

    name = "sdpa"

    def decode(self, q: torch.Tensor, kv: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
        b, per_kv = q.shape[0], self.num_heads // self.num_kv_heads
        qg = q.view(b, self.num_kv_heads, per_kv, self.head_dim).transpose(0, 1)  # [Hkv, B, G, D]
        keys = self.gather(kv[0], group.blocks).view(self.num_kv_heads, b, -1, self.head_dim)
        values = self.gather(kv[1], group.blocks).view(self.num_kv_heads, b, -1, self.head_dim)
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=~group.pad_mask, scale=self.scale)
        return out.transpose(0, 1).reshape(b, self.num_heads, self.head_dim)


class CpuPagedAttentionBackend(TorchAttentionBackend):
    """CPU: decode attention by the compiled kernel of ``engine.cpu_ops``, reading each sequence's
    K/V rows in place through its block table, so nothing is gathered and nothing is padded (one
    group for every decode, whatever the lengths). Writes of new K/V go slot by slot in one call.
    Prefill attention by the kernel's causal ``prefill_attention`` (K/V packed per call for the
    dot-product units), or the torch backend's SDPA for dtypes and head sizes it does not serve.
    """

    name = "cpu"
    groups_by_length = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, ops: ModuleType) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, block_size)
        self.ops = ops

    def write(self, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor) -> None:
        self.ops.write_kv_(kv, k, v, slots)

    def decode(self, q: torch.Tensor, kv: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
        out = self.ops.paged_decode_attention(q, kv, group.block_table, group.context_lens, self.block_size, self.scale)
        return out.view(q.shape[0], self.num_heads, self.head_dim)

    def prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, span: PrefillSpan
    ) -> torch.Tensor:
        """The compiled kernel where it serves the dtype and head size (3.3 ms against SDPA's 10.7 for a
        1,024-token prompt of the default model, per layer), SDPA otherwise."""
        if not self.ops.prefill_attention_supported(q):
            return super().prefill(q, k, v, kv, span)
        if span.context_blocks is not None:  # earlier positions are cached: read them (the new ones too) back
            k = self.gather(kv[0], span.context_blocks)[:, : span.context_len].transpose(0, 1)
            v = self.gather(kv[1], span.context_blocks)[:, : span.context_len].transpose(0, 1)
        return self.ops.prefill_attention(q, k, v, self.scale).view(q.shape[0], self.num_heads, self.head_dim)


class TokenMajorBackend(AttentionBackend):
    """The cache the GPU kernels read, ``[2, num_blocks, block_size, Hkv, D]``: one token's heads are
    adjacent, so a kernel reads a block's keys for one KV head as rows of one stride."""

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def write(self, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor) -> None:
        flat = (-1, self.num_kv_heads, self.head_dim)
        kv[0].view(flat).index_copy_(0, slots, k)
        kv[1].view(flat).index_copy_(0, slots, v)

    def read_blocks(self, kv: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        return kv[:, block_ids].transpose(0, 1)

    def write_blocks(self, kv: torch.Tensor, block_ids: torch.Tensor, data: torch.Tensor) -> None:
        kv.index_copy_(1, block_ids, data.transpose(0, 1))


class TritonAttentionBackend(TokenMajorBackend):
    """CUDA: decode by the Triton paged kernel of ``engine.triton_attention`` at any power-of-two block size
    (the prefix cache's 16 tokens by default), reading K/V in place through each block table, one group for
    every decode whatever the lengths; its grid depends only on the table's width, so CUDA graphs replay it.
    Prefill gathers the request's cached context and runs SDPA (flash or memory-efficient kernels on CUDA):
    it is compute-bound, and a gather of its context is a small share of it.
    """

    name = "triton"
    groups_by_length = False
    static_decode = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, block_size)
        from engine.triton_attention import paged_decode

        self._kernel = paged_decode

    def decode(self, q: torch.Tensor, kv: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
        return self._kernel(q, kv[0], kv[1], group.block_table, group.context_lens, self.scale)

    def prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, span: PrefillSpan
    ) -> torch.Tensor:
        if span.context_blocks is not None:
            k = kv[0].index_select(0, span.context_blocks).flatten(0, 1)[: span.context_len]
            v = kv[1].index_select(0, span.context_blocks).flatten(0, 1)[: span.context_len]
        return sdpa_prefill(q, k.transpose(0, 1), v.transpose(0, 1), span.mask, self.scale)


class FlashAttnBackend(TokenMajorBackend):
    """CUDA only: flash-attn's paged KV kernel.

    flash-attn 2's paged cache needs pages of a multiple of 256 tokens and fp16/bf16 (``backend_choice``
    checks them when the engine is built); otherwise ``auto`` picks the Triton kernel or SDPA.
    """

    name = "flash_attn"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, block_size)
        from flash_attn import flash_attn_with_kvcache

        self._kernel = flash_attn_with_kvcache

    def _attend(self, q: torch.Tensor, kv: torch.Tensor, lens: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return self._kernel(q, kv[0], kv[1], cache_seqlens=lens, block_table=table,
                            softmax_scale=self.scale, causal=True)

    def decode(self, q: torch.Tensor, kv: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
        return self._attend(q.unsqueeze(1), kv, group.context_lens, group.block_table).squeeze(1)

    def prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, span: PrefillSpan
    ) -> torch.Tensor:
        # causal=True aligns the queries to the end of the cached context, as chunked prefill needs.
        table = span.block_table.to(torch.int32).unsqueeze(0)
        lens = torch.tensor([span.context_len], dtype=torch.int32, device=q.device)
        return self._attend(q.unsqueeze(0), kv, lens, table).squeeze(0)


def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


FLASH_ATTN_PAGE = 256  # flash-attn 2's paged KV cache needs pages of a multiple of this many tokens
FLASH_ATTN_DTYPES = (torch.float16, torch.bfloat16)


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def backend_choice(
    name: str, device: str, dtype: torch.dtype, block_size: int, head_dim: int, has_cpu_ops: bool,
    has_flash_attn: bool, has_triton: bool = False,
) -> str:
    """Which backend ``name`` means on this device, dtype and block size; raises ValueError naming the flag
    to change when an explicit choice cannot run (rather than building and failing every step).

    ``auto``: on CPU the compiled kernel when there is one, else torch; on CUDA flash-attn's paged kernel
    when it is installed and can run this cache (fp16/bf16, pages of a multiple of 256 tokens, head_dim
    <= 256 and a multiple of 8), else the Triton paged kernel (power-of-two block size and head_dim; Triton
    comes with CUDA builds of torch), else SDPA.
    """
    flash_ok, why = _flash_attn_fits(device, dtype, block_size, head_dim, has_flash_attn)
    triton_ok, triton_why = _triton_fits(device, block_size, head_dim, has_triton)
    if name == "auto":
        if device == "cpu":
            return "cpu" if has_cpu_ops else "torch"
        if device != "cuda":
            return "torch"
        return "flash_attn" if flash_ok else "triton" if triton_ok else "sdpa"
    if name == "flash_attn" and not flash_ok:
        raise ValueError(f"--attention-backend flash_attn cannot run here: {why}; use --attention-backend auto")
    if name == "triton" and not triton_ok:
        raise ValueError(f"--attention-backend triton cannot run here: {triton_why}; use --attention-backend auto")
    if name == "cpu":
        if device != "cpu":
            raise ValueError("--attention-backend cpu needs --device cpu")
        if not has_cpu_ops:
            raise ValueError("--attention-backend cpu needs the CPU kernels, which are turned off "
                             "(--no-cpu-kernels) or could not be built here")
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return name


BACKENDS = ("auto", "cpu", "torch", "sdpa", "triton", "flash_attn")


def _triton_fits(device: str, block_size: int, head_dim: int, has_triton: bool) -> tuple[bool, str]:
    if device != "cuda":
        return False, "it needs --device cuda"
    if not has_triton:
        return False, "the triton package is not installed (CUDA builds of torch bring it)"
    if block_size & (block_size - 1):  # the kernel's tiles are powers of two
        return False, f"it needs --block-size a power of two, not {block_size}"
    if head_dim & (head_dim - 1) or not 16 <= head_dim <= 256:
        return False, f"it needs a head_dim that is a power of two from 16 to 256, and this model's is {head_dim}"
    return True, ""


def _flash_attn_fits(device: str, dtype: torch.dtype, block_size: int, head_dim: int,
                     has_flash_attn: bool) -> tuple[bool, str]:
    if device != "cuda":
        return False, "it needs --device cuda"
    if not has_flash_attn:
        return False, "the flash-attn package is not installed (the `flash` extra)"
    if dtype not in FLASH_ATTN_DTYPES:
        return False, f"it takes float16 or bfloat16, not {str(dtype).removeprefix('torch.')} (--dtype)"
    if block_size % FLASH_ATTN_PAGE:
        return False, f"its paged cache needs --block-size a multiple of {FLASH_ATTN_PAGE}, not {block_size}"
    if head_dim > 256 or head_dim % 8:
        return False, f"it needs a head_dim of at most 256 and a multiple of 8, and this model's is {head_dim}"
    return True, ""


def select_backend(
    name: str, device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
    cpu_ops: ModuleType | None = None, dtype: torch.dtype = torch.float32,
) -> AttentionBackend:
    """The backend ``backend_choice`` picks, built."""
    kind = device.type if device.type in ("cpu", "cuda") else "other"
    flash = kind == "cuda" and flash_attn_available()
    has_triton = kind == "cuda" and triton_available()
    choice = backend_choice(name, kind, dtype, block_size, head_dim, cpu_ops is not None, flash, has_triton)
    if choice == "cpu":
        return CpuPagedAttentionBackend(num_heads, num_kv_heads, head_dim, block_size, cpu_ops)
    if choice == "triton":
        return TritonAttentionBackend(num_heads, num_kv_heads, head_dim, block_size)
    if choice == "flash_attn":
        return FlashAttnBackend(num_heads, num_kv_heads, head_dim, block_size)
    if choice == "sdpa":
        return SdpaAttentionBackend(num_heads, num_kv_heads, head_dim, block_size)
    return TorchAttentionBackend(num_heads, num_kv_heads, head_dim, block_size)
