"""The GPU's Triton paged-attention backend against the portable torch backend, on CPU tensors through
Triton's interpreter: the same kernels and the same index arithmetic a GPU runs (block tables, split
partitions and their combination, the cache's strides), at the prefix cache's 16-token blocks and others. On a
GPU the kernels compile (Triton runs ptxas and a C compiler), which is why these live beside the process tests."""

from __future__ import annotations

import pytest
import torch

from engine.attention import TorchAttentionBackend, TritonAttentionBackend, build_metadata

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # a GPU where there is one


def _caches(backends, num_blocks, dtype):
    return [torch.zeros(b.cache_shape(num_blocks), dtype=dtype, device=DEVICE) for b in backends]


def _step(spans, heads, kv_heads, d, block, dtype, seed=0):
    """One step of ``spans`` through both backends, each with its own cache layout, after both caches were
    filled with the same earlier tokens; the two outputs."""
    torch.manual_seed(seed)
    ref, tri = TorchAttentionBackend(heads, kv_heads, d, block), TritonAttentionBackend(heads, kv_heads, d, block)
    num_blocks = 64
    caches = _caches((ref, tri), num_blocks, dtype)
    earlier = [(0, computed, ids) for computed, _, ids in spans if computed]
    if earlier:
        n = sum(c for _, c, _ in earlier)
        k, v = _randn(n, kv_heads, d, dtype=dtype), _randn(n, kv_heads, d, dtype=dtype)
        for backend, cache in zip((ref, tri), caches, strict=True):
            slots = build_metadata(earlier, block, DEVICE, False).slot_mapping
            backend.write(k, v, cache, slots)
    t = sum(new for _, new, _ in spans)
    q = _randn(t, heads, d, dtype=dtype)
    k, v = _randn(t, kv_heads, d, dtype=dtype), _randn(t, kv_heads, d, dtype=dtype)
    return [backend.forward(q, k, v, cache, build_metadata(spans, block, DEVICE, backend.groups_by_length))
            for backend, cache in zip((ref, tri), caches, strict=True)]


def _randn(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype).to(DEVICE)


def _tables(lengths, block, seed=1):
    """Scattered, disjoint block tables for requests of these lengths."""
    g = torch.Generator().manual_seed(seed)
    free = torch.randperm(64, generator=g).tolist()
    tables = []
    for n in lengths:
        k = -(-n // block)
        tables.append(free[:k])
        free = free[k:]
    return tables


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("block", [16, 32])
def test_decodes_of_mixed_lengths_equal_the_torch_backend(dtype, tol, block):
    lengths = [1, 17, 300, 64]  # one token, a partial block, several partitions, exactly whole blocks
    spans = [(n - 1, 1, ids) for n, ids in zip(lengths, _tables(lengths, block), strict=True)]
    want, got = _step(spans, heads=8, kv_heads=2, d=32, block=block, dtype=dtype)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_query_heads_that_do_not_fill_a_tile_and_odd_group_sizes():
    """9 query heads over 3 KV heads (SmolLM2's shape): groups of 3, padded to the kernel's 16 rows."""
    lengths = [5, 40]
    spans = [(n - 1, 1, ids) for n, ids in zip(lengths, _tables(lengths, 16), strict=True)]
    want, got = _step(spans, heads=9, kv_heads=3, d=64, block=16, dtype=torch.float32)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_step_of_prefills_after_cached_context_and_decodes_equals_the_torch_backend():
    """Chunked prefill over cached context, a fresh prefill and decodes in one step."""
    lengths = [48 + 20, 30, 90]
    tables = _tables(lengths, 16)
    spans = [(48, 20, tables[0]), (0, 30, tables[1]), (89, 1, tables[2])]
    want, got = _step(spans, heads=4, kv_heads=2, d=16, block=16, dtype=torch.float32)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_blocks_read_and_written_in_the_wire_layout_round_trip():
    tri = TritonAttentionBackend(4, 2, 16, 16)
    cache = torch.randn(tri.cache_shape(8)).to(DEVICE)
    ids = torch.tensor([5, 1, 6], device=DEVICE)
    wire = tri.read_blocks(cache, ids).clone()  # [n, 2, bs, Hkv, D]
    assert wire.shape == (3, 2, 16, 2, 16)
    other = torch.zeros_like(cache)
    tri.write_blocks(other, ids, wire)
    assert torch.equal(other[:, ids], cache[:, ids]) and not other[:, [0, 2, 3, 4, 7]].any()
