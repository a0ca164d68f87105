"""Paged decode attention for the GPU, in Triton: each sequence's K/V read in place through its block table,
at any block size (16 by default, the prefix cache's block), so nothing is gathered or padded.

Why Triton: flash-attn 2's paged kernel needs 256-token pages, FlashAttention-3 and FlashInfer are wheels
built per CUDA/torch pair (or minutes of JIT on first use), while Triton ships with every CUDA build of
torch. vLLM serves with the same kind of kernel (its Triton backend). Decode attention is bound by
reading K/V, which this kernel does once per KV head for all the query heads that share it.

Split-K ("flash decoding"): a sequence's context is cut into at most ``MAX_SPLITS`` partitions, each
attended by its own program, then combined, so that a batch of one still keeps the GPU's
multiprocessors busy. The grid depends only on the block table's width, so a CUDA graph captured at
a fixed width replays for any lengths up to it.

Where no GPU is, Triton's interpreter (``TRITON_INTERPRET=1``, set before triton is first imported) runs
the same kernels on CPU tensors: the tests do (tests/conftest.py sets it).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
MAX_SPLITS = 32  # partitions of one sequence's context, at most
MIN_PARTITION = 256  # tokens per partition, at least: below this the combine step costs more than it saves


@triton.jit
def _decode_partitions(
    q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, acc_ptr, max_ptr, sum_ptr, scale,
    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_tb,
    HQ: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    TILE: tl.constexpr, PART: tl.constexpr, S: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
):
    """One (sequence, KV head, partition): the G query heads of that KV head against the partition's tokens,
    with an online softmax; writes the unnormalised output, the running max and sum (base 2)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    length = tl.load(lens_ptr + b)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    heads = h * G + g
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=(g < G)[:, None], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    total = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    end = tl.minimum(s * PART + PART, length)
    t = tl.arange(0, TILE)
    for i in range(PART // TILE):  # a fixed trip count (the interpreter takes no loaded loop bounds);
        if s * PART + i * TILE < end:  # tiles past the end cost nothing but this test
            tok = s * PART + i * TILE + t
            valid = tok < end
            block = tl.load(table_ptr + b * stride_tb + tok // BS, mask=valid, other=0).to(tl.int64)
            row = block * stride_kb + (tok % BS) * stride_kt + h * stride_kh
            k = tl.load(k_ptr + row[:, None] + d[None, :], mask=valid[:, None], other=0.0)
            if DOT_F32:
                k = k.to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            scores = tl.where(valid[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))  # finite: a tile this far holds a valid token
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(scores - m_new[:, None])
            total = total * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + row[:, None] + d[None, :], mask=valid[:, None], other=0.0)
            if DOT_F32:
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
    at = (b * HQ + heads) * S + s
    tl.store(acc_ptr + at[:, None] * D + d[None, :], acc, mask=(g < G)[:, None])
    tl.store(max_ptr + at, m, mask=g < G)
    tl.store(sum_ptr + at, total, mask=g < G)


@triton.jit
def _combine_partitions(
    acc_ptr, max_ptr, sum_ptr, out_ptr, stride_ob, stride_oh,
    HQ: tl.constexpr, D: tl.constexpr, S: tl.constexpr, S_PAD: tl.constexpr,
):
    """One (sequence, query head): the partitions' outputs weighed by their softmax mass. An empty
    partition (past the sequence's end) has max -inf and weighs nothing."""
    b = tl.program_id(0)
    hq = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D)
    at = (b * HQ + hq) * S + s
    m = tl.load(max_ptr + at, mask=s < S, other=float("-inf"))
    total = tl.load(sum_ptr + at, mask=s < S, other=0.0)
    top = tl.max(tl.where(total > 0, m, float("-inf")), 0)
    weight = tl.where(total > 0, tl.exp2(m - top), 0.0)
    acc = tl.load(acc_ptr + at[:, None] * D + d[None, :], mask=(s < S)[:, None], other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(total * weight, 0)
    tl.store(out_ptr + b * stride_ob + hq * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def paged_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    context_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Decode attention of one token per sequence.

    q: ``[B, Hq, D]``; k_cache/v_cache: ``[num_blocks, block_size, Hkv, D]``; block_table: ``[B, width]``
    block ids (any integer dtype); context_lens: ``[B]``, each at least 1. Returns ``[B, Hq, D]`` in q's dtype.
    """
    b, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    g = hq // hkv
    tile = max(64, bs)
    width = block_table.shape[1] * bs
    part = max(MIN_PARTITION, triton.cdiv(triton.cdiv(width, MAX_SPLITS), tile) * tile)
    splits = triton.cdiv(width, part)
    acc = torch.empty(b, hq, splits, d, dtype=torch.float32, device=q.device)
    mx = torch.empty(b, hq, splits, dtype=torch.float32, device=q.device)
    total = torch.empty_like(mx)
    # float32: no TF32 rounding of the products. Half precision multiplies in its own type on a GPU, in
    # float32 under the interpreter (whose bfloat16 products are wrong).
    precision = "ieee" if q.dtype == torch.float32 or INTERPRETED else None
    _decode_partitions[(b, hkv, splits)](
        q, k_cache, v_cache, block_table, context_lens, acc, mx, total, scale * 1.4426950408889634,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
        HQ=hq, G=g, G_PAD=max(16, triton.next_power_of_2(g)), D=d, BS=bs, TILE=tile, PART=part, S=splits,
        PRECISION=precision, DOT_F32=INTERPRETED,
    )
    out = torch.empty_like(q)
    _combine_partitions[(b, hq)](acc, mx, total, out, out.stride(0), out.stride(1), HQ=hq, D=d, S=splits,
                                 S_PAD=max(2, triton.next_power_of_2(splits)))
    return out

