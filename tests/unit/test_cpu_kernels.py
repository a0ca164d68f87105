"""The compiled CPU kernels against the eager torch code they replace, op by op and end to end.

float32 results must agree to rounding of the summation order; bfloat16 ones to one rounding
of the output. The engine's own greedy-equals-transformers tests run on these kernels too
(they are the CPU default); here each kernel is also checked on the shapes the model never
produces (remainders, biases, strided rows) and on bad input.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import pytest
import torch

from common.engine_args import add_engine_args, engine_config
from common.paths import kernels_dir
from engine import Engine, SamplingParams, cpu_ops
from engine.attention import (
    CpuPagedAttentionBackend,
    TorchAttentionBackend,
    build_metadata,
    decode_metadata,
    general_metadata,
)
from engine.kernels import CpuKernels, TorchKernels
from engine.quant import quantize_int8
from tests.unit.test_engine_correctness import assert_same_tokens_close_logprobs, batch_logprobs

DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)]


def built_for(flag: str) -> bool:
    """Whether the kernels use this CPU feature: it has it, and they are built for this CPU (not for the older
    target that ``TANDEM_CPU_MARCH`` names, as tests/e2e/test_cpu_kernels_avx2.py builds them)."""
    return not os.environ.get("TANDEM_CPU_MARCH") and flag in cpu_ops.cpu_flags()


@pytest.fixture(scope="module")
def ops():
    module = cpu_ops.load()
    assert module is not None, "the CPU kernels must build on the CI machine (gcc and torch headers)"
    return module


@pytest.fixture(scope="module")
def kernels(ops):
    return CpuKernels(ops), TorchKernels()


def close(a: torch.Tensor, b: torch.Tensor, tol: float) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 40, 64, 130])  # tiles of 4 rows of x, and remainders
@pytest.mark.parametrize("k, n, bias", [(576, 960, False), (64, 13, True), (70, 13, True), (16, 4, False)])
def test_linear(ops, dtype, tol, rows, k, n, bias):
    """k % 32 == 0 takes bfloat16's paired loads (or its dot products, vdpbf16ps, where the CPU has them);
    n % 4 != 0 a padded last block of weights."""
    g = torch.Generator().manual_seed(rows * k + n)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float()).to(dtype)
    close(ops.linear(x, w, b), want, tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 12, 16, 17, 64, 257, 600])  # micro-tiles of 4, blocks of 256
@pytest.mark.parametrize("k, n, bias", [(576, 960, False), (64, 13, True), (71, 97, True), (1536, 200, False)])
def test_packed_linear(ops, dtype, rows, k, n, bias):
    """Against a float64 matmul of the same values: the kernel accumulates in float32 and rounds once, so it is
    within float32 summation error (plus one rounding to bfloat16). n % 96 != 0 leaves a part-filled last panel;
    an odd k a zero-padded last pair."""
    if not ops.packed_linear_supported(torch.empty(0, 0, dtype=dtype)):
        pytest.skip(f"this CPU has no packed kernel for {dtype} (it needs AVX-512, or AVX2 with FMA)")
    g = torch.Generator().manual_seed(rows * k + n)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    want = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    got = ops.packed_linear(x, ops.pack_linear_weight(w), n, b)
    assert got.dtype == dtype and got.shape == (rows, n)
    torch.testing.assert_close(got.double(), want, atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=1e-2)


@pytest.mark.parametrize("rows", [1, 7, 16, 17, 32, 45, 300])  # one tile of rows, two, blocks of 32, a part-filled one
@pytest.mark.parametrize("k, n", [(576, 960), (1536, 200), (64, 13)])
def test_packed_linear_on_amx_tiles_matches_the_dot_product_kernel(ops, rows, k, n):
    """bfloat16 on the AMX tiles (where the CPU has them) reads the same panels as the vdpbf16ps kernel: the two
    agree to one rounding of the output, with the bias and the fused SiLU too."""
    if not ops.packed_linear_supported(torch.empty(0, 0, dtype=torch.bfloat16)):
        pytest.skip("this CPU has no packed bfloat16 kernel")
    g = torch.Generator().manual_seed(rows + k + n)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16)
    packed = ops.pack_linear_weight(w)
    try:
        tiles = ops.set_amx(True)
        on = ops.packed_linear(x, packed, n, b), ops.packed_linear_silu(x, packed, n // 2)
        assert ops.set_amx(False) is False
        off = ops.packed_linear(x, packed, n, b), ops.packed_linear_silu(x, packed, n // 2)
    finally:
        ops.set_amx(True)
    assert tiles == built_for("amx_bf16")
    for a, d in zip(on, off, strict=True):
        torch.testing.assert_close(a.float(), d.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("rows", [1, 3, 16, 45, 300])  # micro-tiles of 1-4 rows, a block of 256 and a part one
@pytest.mark.parametrize("k, n", [(576, 960), (1535, 200), (64, 13)])  # an odd k: the zero-padded last pair
def test_packed_linear_widened_bfloat16(ops, rows, k, n):
    """bfloat16 pairs widened to float32 FMAs, the kernel of CPUs without AVX512_BF16 (switched on here wherever
    the CPU has it): within one rounding of a float64 product of the same values, float32 out the same values as
    the bfloat16 out, and within one rounding of the vdpbf16ps or tile kernel (with the bias and the fused SiLU)."""
    if not ops.packed_linear_supported(torch.empty(0, 0, dtype=torch.bfloat16)):
        pytest.skip("this CPU has no packed bfloat16 kernel (it needs AVX-512, or AVX2 with FMA)")
    g = torch.Generator().manual_seed(rows * k + n)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16)
    packed = ops.pack_linear_weight(w)
    native = not ops.set_widened_bf16(False)
    try:
        assert ops.set_widened_bf16(True) is True
        widened = ops.packed_linear(x, packed, n, b), ops.packed_linear_silu(x, packed, n // 2)
        plain, as_float = (ops.packed_linear(x, packed, n, None, float_out=f) for f in (False, True))
    finally:
        ops.set_widened_bf16(False)
    assert native == built_for("avx512_bf16")
    want = torch.nn.functional.linear(x.double(), w.double(), b.double())
    torch.testing.assert_close(widened[0].double(), want, atol=2e-2, rtol=1e-2)
    assert as_float.dtype == torch.float32 and torch.equal(as_float, plain.float())
    default = ops.packed_linear(x, packed, n, b), ops.packed_linear_silu(x, packed, n // 2)
    for a, d in zip(widened, default, strict=True):
        torch.testing.assert_close(a.float(), d.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_rows_do_not_depend_on_the_batch(ops, dtype):
    """A row's sum runs in one order wherever it falls in a micro-tile or row block, so a sequence decodes the
    same bits alone as in any batch."""
    if not ops.packed_linear_supported(torch.empty(0, 0, dtype=dtype)):
        pytest.skip(f"this CPU has no packed kernel for {dtype}")
    g = torch.Generator().manual_seed(7)
    x = torch.randn(300, 576, generator=g).to(dtype)
    w = ops.pack_linear_weight((torch.randn(200, 576, generator=g) / 24).to(dtype))
    whole = ops.packed_linear(x, w, 200, None)
    for rows in (slice(0, 1), slice(40, 42), slice(5, 8), slice(255, 260), slice(3, 300), slice(20, 36), slice(7, 16),
                 slice(0, 17), slice(1, 33)):
        assert torch.equal(ops.packed_linear(x[rows], w, 200, None), whole[rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_packed_linear_prefetching_the_next_weight_changes_no_bit(ops, dtype, rows):
    """``next`` only fetches: the same result with the next weight named, whatever its shape, with one too
    small to give every thread a panel, or with nonsense (a plain tensor, a negative row count)."""
    if not ops.packed_linear_supported(torch.empty(0, 0, dtype=dtype)):
        pytest.skip(f"this CPU has no packed kernel for {dtype}")
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=g).to(dtype)
    w = ops.pack_linear_weight((torch.randn(960, 576, generator=g) / 24).to(dtype))
    want = ops.packed_linear(x, w, 960, None)
    for nxt, n in [(ops.pack_linear_weight(torch.randn(3072, 576).to(dtype)), 3072),
                   (ops.pack_linear_weight(torch.randn(576, 1536).to(dtype)), 576),
                   (ops.pack_linear_weight(torch.randn(40, 64).to(dtype)), 40),
                   (w, 960), (torch.ones(5, dtype=dtype), 7), (w, -3)]:
        assert torch.equal(ops.packed_linear(x, w, 960, None, nxt, n), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, n", [(1, 49152), (16, 200), (5, 13)])
def test_packed_linear_float_out_is_the_output_read_as_float32(ops, kernels, dtype, rows, n):
    """Logits come out float32 in one pass, holding exactly the values of the dtype's output widened."""
    if not ops.packed_linear_supported(torch.empty(0, 0, dtype=dtype)):
        pytest.skip(f"this CPU has no packed kernel for {dtype}")
    g = torch.Generator().manual_seed(rows + n)
    x = torch.randn(rows, 64, generator=g).to(dtype)
    w = ops.pack_linear_weight((torch.randn(n, 64, generator=g) / 8).to(dtype))
    got = ops.packed_linear(x, w, n, None, float_out=True)
    assert got.dtype == torch.float32 and torch.equal(got, ops.packed_linear(x, w, n, None).float())
    cpu, ref = kernels
    plain = (torch.randn(n, 64, generator=g) / 8).to(dtype)
    assert torch.equal(cpu.logits(x, cpu.prepare_weight(plain)), cpu.linear(x, cpu.prepare_weight(plain)).float())
    assert torch.equal(ref.logits(x, plain), ref.linear(x, plain).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5, 16, 300])
@pytest.mark.parametrize("inter, k", [(1536, 576), (50, 64), (7, 33)])  # whole half-panels, a part-filled one, odd k
def test_gate_up_silu_is_the_projection_then_silu_mul_bit_for_bit(ops, kernels, dtype, rows, inter, k):
    """The activation on the accumulators rounds where the two unfused ops do (projection, SiLU, product)."""
    cpu, ref = kernels
    if dtype not in cpu.packed:
        pytest.skip(f"this CPU has no packed kernel for {dtype}")
    g = torch.Generator().manual_seed(rows * inter + k)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = (torch.randn(2 * inter, k, generator=g) / k**0.5 * 3).to(dtype)
    fused = cpu.prepare_gate_up(w)
    assert fused.silu_cols == inter and fused.cols == k
    got = cpu.gate_up_silu(x, fused)
    want = ops.silu_mul(ops.packed_linear(x, ops.pack_linear_weight(w), 2 * inter, None))
    assert got.dtype == dtype and got.shape == (rows, inter)
    assert torch.equal(got, want)
    close(got, ref.gate_up_silu(x, w), 1e-4 if dtype == torch.float32 else 2e-2)  # eager sums in another order
    with pytest.raises(ValueError, match="gate_up_silu"):
        cpu.linear(x, fused)


def test_gate_up_silu_falls_back_to_the_projection_then_silu_mul(kernels):
    """Weights the fused layout does not take (an odd row count: packed plainly; a dtype without a packed kernel:
    kept as is) give the projection followed by silu_mul."""
    cpu, ref = kernels
    odd, half = torch.randn(7, 32), torch.randn(8, 32, dtype=torch.float16)
    assert cpu.prepare_gate_up(half) is half and ref.prepare_gate_up(odd) is odd
    assert getattr(cpu.prepare_gate_up(odd), "silu_cols", 0) == 0
    x = torch.randn(2, 32)
    w = cpu.prepare_weight(torch.randn(8, 32))
    assert torch.equal(cpu.gate_up_silu(x, w), cpu.silu_mul(cpu.linear(x, w)))


def test_cpu_kernels_chain_tells_each_packed_weight_the_next(kernels):
    """The last leads back to the first (the next step's first layer); weights in other layouts are kept."""
    cpu, ref = kernels
    ws = [cpu.prepare_weight(torch.randn(n, 64)) for n in (96, 200, 7)]
    if torch.float32 not in cpu.packed:
        assert cpu.chain(ws) == ws
        return
    plain = torch.randn(5, 64)
    a, b, c, d = cpu.chain([*ws, plain])
    assert (a.next_data, a.next_rows) == (ws[1].data, 200) and (b.next_data, b.next_rows) == (ws[2].data, 7)
    assert c.next_data is None and d is plain
    x = torch.randn(4, 64)
    close(cpu.linear(x, a), cpu.linear(x, ws[0]), 0)
    assert ref.chain(ws) == ws


def _huge_kb(address: int) -> int:
    """AnonHugePages (kB) of the mapping of this process that holds ``address``."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(part, 16) for part in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    return 0


def _thp_mode() -> str:
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        return f.read().split("[")[1].split("]")[0]


def test_huge_page_buffer_lies_on_2mib_pages(ops):
    """Whole 2 MiB pages, aligned to one; once touched, the kernel backs them with huge pages unless THP is off."""
    buf = ops.huge_page_buffer(3 << 20)
    assert buf.dtype == torch.uint8 and buf.numel() == 4 << 20 and buf.data_ptr() % (2 << 20) == 0
    buf.fill_(7)
    assert int(buf.sum()) == 7 * (4 << 20)
    if _thp_mode() == "never":
        assert _huge_kb(buf.data_ptr()) == 0
    else:
        assert _huge_kb(buf.data_ptr()) >= 2048
    assert ops.huge_page_buffer(0).numel() == 2 << 20
    with pytest.raises(RuntimeError, match="negative"):
        ops.huge_page_buffer(-1)


def test_cpu_kernels_place_packed_weights_in_one_buffer_in_order(kernels):
    """Same bits, each tensor on its own 4 KiB page of one 2 MiB-aligned buffer, in the order given (a quantized
    weight's data, scales and offsets too); the rest kept."""
    cpu, ref = kernels
    ws = [cpu.prepare_weight(torch.randn(n, 64)) for n in (96, 200, 7)]
    plain, q = torch.ones(5), quantize_int8(torch.randn(40, 64))
    placed = cpu.place([*ws, plain, q])
    assert placed[3] is plain and ref.place(ws) == ws
    assert all(torch.equal(getattr(q, f), getattr(placed[4], f)) for f in ("data", "scale"))
    assert placed[4].data.data_ptr() % 4096 == 0 and placed[4].scale.data_ptr() > placed[4].data.data_ptr()
    x = torch.randn(3, 64)
    torch.testing.assert_close(cpu.linear(x, placed[4]), cpu.linear(x, q), rtol=0, atol=0)
    if torch.float32 not in cpu.packed:
        assert placed[:3] == ws
        return
    ptrs = [w.data.data_ptr() for w in placed[:3]]
    assert ptrs[0] % (2 << 20) == 0 and ptrs == sorted(ptrs) and all(p % 4096 == 0 for p in ptrs)
    for old, new in zip(ws, placed, strict=False):
        assert torch.equal(old.data, new.data) and (new.rows, new.cols) == (old.rows, old.cols)


@pytest.mark.parametrize("shape", [(2, 3, 64, 8), (2, 3, 4096, 64)])  # under and over the 1 MiB floor
def test_cpu_kernels_zeros_are_zeros_of_the_shape(kernels, shape):
    cpu, ref = kernels
    z = cpu.zeros(shape, torch.bfloat16, torch.device("cpu"))
    assert z.shape == shape and z.dtype == torch.bfloat16 and z.is_contiguous() and not z.any()
    assert torch.equal(z, ref.zeros(shape, torch.bfloat16, torch.device("cpu")))
    if z.nbytes >= 1 << 20:
        assert z.data_ptr() % (2 << 20) == 0


def test_packed_linear_rejects_a_weight_of_another_shape(ops):
    w = ops.pack_linear_weight(torch.ones(8, 64))
    with pytest.raises(RuntimeError, match="packed weight is not"):
        ops.packed_linear(torch.ones(2, 32), w, 8, None)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        ops.packed_linear(torch.ones(2, 64, dtype=torch.bfloat16), w, 8, None)
    with pytest.raises(RuntimeError, match="must come from pack_linear_weight"):
        ops.packed_linear(torch.ones(2, 64), torch.stack([w, w], 1)[:, 0], 8, None)


def test_cpu_kernels_pack_float_weights_once_and_serve_them(kernels):
    """``prepare_weight`` packs where the kernel serves every row count; quantized and 1-D tensors pass through."""
    cpu, ref = kernels
    w = torch.randn(100, 64) / 8
    packed = cpu.prepare_weight(w)
    if torch.float32 not in cpu.packed:
        assert packed is w
        return
    assert packed.shape == (100, 64) and packed.dtype == torch.float32 and packed.nbytes >= w.nbytes
    x = torch.randn(3, 64)
    close(cpu.linear(x, packed), ref.linear(x, w), 1e-5)
    norm = torch.ones(64)
    assert cpu.prepare_weight(norm) is norm
    assert ref.prepare_weight(w) is w


@pytest.mark.parametrize("rows, vocab", [(1, 49152), (16, 49152), (3, 17), (5, 1), (4, 40)])
def test_argmax_rows_answers_as_torch_argmax(ops, rows, vocab):
    """Ties go to the first index (in other lanes, in the same lane later, in the ragged last vector), NaN wins (its
    first one), -inf-only rows give 0."""
    g = torch.Generator().manual_seed(rows + vocab)
    x = torch.randn(rows, vocab, generator=g)
    if vocab > 16:
        x[0, 5] = x[0, vocab - 1] = x[0].max() + 1  # a tie, the second in the last (ragged) vector
    if rows > 2 and vocab > 16:
        x[1, 9] = x[1, 12] = float("nan")
        x[2] = float("-inf")
    if rows > 3 and vocab > 32:
        x[3, 27] = x[3, 11] = x[3, 19] = x[3, 3] = x[3].max() + 1  # the first, 3, behind three ties
    assert torch.equal(ops.argmax_rows(x), x.argmax(dim=-1))
    with pytest.raises(RuntimeError, match="float32"):
        ops.argmax_rows(x.bfloat16())


def test_cpu_kernels_argmax_serves_the_sampler(kernels):
    cpu, ref = kernels
    x = torch.randn(4, 1000)
    assert torch.equal(cpu.argmax(x), ref.argmax(x))
    assert torch.equal(cpu.argmax(x.bfloat16()), x.bfloat16().argmax(dim=-1))  # other dtypes: torch's


@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 40])
def test_norms_and_activation(kernels, dtype, tol, rows):
    cpu, ref = kernels
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    delta = torch.randn(rows, 96, generator=g).to(dtype)
    w = (1 + torch.randn(96, generator=g) / 4).to(dtype)
    close(cpu.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5), tol)
    r_cpu, r_ref = x.clone(), x.clone()
    close(cpu.add_rms_norm_(r_cpu, delta, w, 1e-5), ref.add_rms_norm_(r_ref, delta, w, 1e-5), tol)
    assert torch.equal(r_cpu, r_ref), "the residual is updated in place, rounded as an eager add"
    gate_up = torch.randn(rows, 2 * 48, generator=g).to(dtype) * 4
    close(cpu.silu_mul(gate_up), ref.silu_mul(gate_up), tol)


@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("inter", [13, 48])  # a part-vector tail; whole vectors of 8 and 16
def test_silu_mul_over_the_exponents_whole_range(ops, kernels, dtype, tol, inter):
    """Gates from -100 to 100: exp(-g) clamps past either end of float32's range (the vector forms scale by 2^n
    in two steps there); the fused matmul epilogue gives the same bits at every gate."""
    cpu, ref = kernels
    gate = torch.linspace(-100, 100, 7 * inter).reshape(7, inter)
    up = torch.randn(7, inter, generator=torch.Generator().manual_seed(inter))
    gate_up = torch.cat([gate, up], dim=1).to(dtype)
    got = cpu.silu_mul(gate_up)
    close(got, ref.silu_mul(gate_up), tol)
    assert torch.isfinite(got).all()
    # The same gates out of packed_linear_silu: x = I (rows = inter) against [gate_up^T; 0] gives sums equal to
    # gate_up's values (one nonzero product each), so its epilogue sees exactly these gates and ups.
    w = gate_up.t().contiguous()  # [2 * inter, 7]: x [7, 7] = identity picks row r's values
    fused = cpu.prepare_gate_up(w)
    if getattr(fused, "silu_cols", 0):
        assert torch.equal(cpu.gate_up_silu(torch.eye(7, dtype=dtype), fused), got)


@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("dim", [32, 40, 64, 6])  # halves of 16 lanes, 16 and a scalar tail, 32, only a tail
def test_rope_in_place_on_strided_rows(kernels, dtype, tol, dim):
    """q and k heads rotated in place inside the fused qkv rows; v untouched. Each product and their sum
    are rounded to the dtype as eager ops round them, so the two agree bit for bit."""
    cpu, ref = kernels
    heads, width = 5, 7 * dim  # 5 rotated heads (q + k), 2 value heads
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(11, width, generator=g).to(dtype)
    pos = torch.tensor([0, 1, 2, 3, 50, 51, 52, 99, 7, 8, 9])
    angles = torch.arange(100)[:, None] * (1e4 ** (-torch.arange(0, dim, 2) / dim))[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    a, b = qkv.clone(), qkv.clone()
    cpu.rope_(a, cpu.rope_tables(cos, sin, pos), heads, dim)
    ref.rope_(b, ref.rope_tables(cos, sin, pos), heads, dim)
    close(a, b, tol)
    assert torch.equal(a, b)
    assert torch.equal(a[:, heads * dim :], qkv[:, heads * dim :])
    with pytest.raises(RuntimeError, match="position out of range"):
        cpu.rope_(a, cpu.rope_tables(cos, sin, torch.full((11,), 100)), heads, dim)


def _paged_case(dtype, lens, num_heads, num_kv_heads, head_dim=32, block_size=4, seed=0):
    """A cache filled with random K/V and, for each sequence, a shuffled set of blocks."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    order = torch.randperm(num_blocks, generator=g).tolist()
    spans, start = [], 0
    for n in lens:
        need = -(-n // block_size)
        spans.append((n - 1, 1, order[start : start + need]))  # one new token after n - 1 cached
        start += need
    cache = torch.randn(2, num_kv_heads, num_blocks * block_size, head_dim, generator=g).to(dtype)
    q = torch.randn(len(lens), num_heads, head_dim, generator=g).to(dtype)
    return cache, q, spans


@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("num_heads, num_kv_heads", [(6, 2), (4, 4), (9, 3), (20, 2)])
@pytest.mark.parametrize("head_dim", [16, 32, 64, 128, 80])
@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_decode_attention(ops, dtype, tol, num_heads, num_kv_heads, head_dim, block_size):
    """Head sizes 16-128 take the vector loops (AVX-512: 16 keys per score pass, values in registers for up to
    16 / (head size / 16) query heads at a time, more in further passes; AVX2: 8 keys, bfloat16 in even/odd order,
    values 32 columns by up to 3 heads a pass); 80 the portable ones. Blocks of 16 give AVX-512's score pass each
    16 keys as one block's run of rows; blocks of 4 take its path of 16 rows looked up one by one."""
    lens = [1, 3, 4, 5, 17, 64, 100, 33]
    cache, q, spans = _paged_case(dtype, lens, num_heads, num_kv_heads, head_dim, block_size)
    args = (num_heads, num_kv_heads, head_dim, block_size)
    cpu, ref = CpuPagedAttentionBackend(*args, ops), TorchAttentionBackend(*args)
    got = cpu.decode(q, cache, build_metadata(spans, block_size, torch.device("cpu"), group_by_len=False).decodes[0])
    want = torch.empty_like(q)
    for group in build_metadata(spans, block_size, torch.device("cpu")).decodes:
        want[group.token_index] = ref.decode(q[group.token_index], cache, group)
    close(got, want, tol)


@pytest.mark.parametrize("rows", [1, 16, 128, 129, 300])
def test_cpu_kernels_linear_on_either_side_of_the_gemm_crossover(kernels, rows):
    """Up to the crossover row count (per dtype and CPU) the project's kernel serves a matmul, above it oneDNN."""
    cpu, ref = kernels
    g = torch.Generator().manual_seed(rows)
    for dtype, tol in DTYPES:
        x = torch.randn(rows, 576, generator=g).to(dtype)
        w = (torch.randn(200, 576, generator=g) / 24).to(dtype)
        close(cpu.linear(x, w), ref.linear(x.float(), w.float()).to(dtype), tol)


@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("lens", [[700], [1000, 3], [130, 640, 5]])
@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_decode_attention_split_over_threads(ops, dtype, tol, lens, block_size):
    """Long sequences: each (sequence, K/V head) is split into parts of 256 keys across the threads and merged."""
    cache, q, spans = _paged_case(dtype, lens, 6, 2, block_size=block_size)
    args = (6, 2, 32, block_size)
    cpu, ref = CpuPagedAttentionBackend(*args, ops), TorchAttentionBackend(*args)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the split needs more than one thread
    try:
        meta = build_metadata(spans, block_size, torch.device("cpu"), group_by_len=False)
        got = cpu.decode(q, cache, meta.decodes[0])
    finally:
        torch.set_num_threads(threads)
    want = torch.empty_like(q)
    for group in build_metadata(spans, block_size, torch.device("cpu")).decodes:
        want[group.token_index] = ref.decode(q[group.token_index], cache, group)
    close(got, want, tol)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("length, context, heads, kv_heads, dim", [
    (1024, 1024, 9, 3, 64),  # the default model's 1,024-token prompt
    (37, 37, 4, 2, 32),      # blocks of 8 positions and 32 keys, part-filled
    (20, 53, 4, 1, 16),      # a chunk after 33 cached positions
    (1, 70, 6, 2, 96),       # one new position
    (5, 5, 8, 8, 128),       # no grouping, the widest head
    (16, 40, 16, 2, 64),     # 8 query heads per KV head: 64 rows per task (two blocks of AMX tiles)
])
def test_prefill_attention(ops, dtype, tol, length, context, heads, kv_heads, dim):
    """Causal (the queries are the last positions), grouped heads, q/k/v read in place from fused qkv rows;
    against SDPA in float64."""
    g = torch.Generator().manual_seed(length + context)
    width = (heads + 2 * kv_heads) * dim
    qkv = torch.randn(context, width + 8, generator=g).to(dtype)  # padded rows: strided views
    q = qkv[context - length :, : heads * dim].view(length, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(context, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim : width].view(context, kv_heads, dim)
    if not ops.prefill_attention_supported(q):
        pytest.skip(f"no prefill kernel on this CPU for {dtype} (it needs AVX2 and FMA)")
    mask = torch.ones(length, context, dtype=torch.bool).tril(context - length)
    as_heads = lambda t: t.double().transpose(0, 1)[None]  # noqa: E731
    want = torch.nn.functional.scaled_dot_product_attention(
        as_heads(q), as_heads(k), as_heads(v), attn_mask=mask, scale=dim**-0.5, enable_gqa=True)
    got = ops.prefill_attention(q, k, v, dim**-0.5)
    assert got.dtype == dtype and got.shape == (length, heads * dim)
    torch.testing.assert_close(got.double(), want[0].transpose(0, 1).reshape(length, -1), atol=tol, rtol=tol)


@pytest.mark.parametrize("length, context, heads, kv_heads, dim", [
    (300, 300, 9, 3, 64), (20, 53, 4, 1, 32), (1, 70, 6, 2, 96), (16, 40, 16, 2, 128)])
def test_prefill_attention_on_amx_tiles_matches_the_dot_product_kernel(ops, length, context, heads, kv_heads, dim):
    """bfloat16 on the AMX tiles (where the CPU has them): the same attention as the vdpbf16ps products, to a
    rounding of P and of the output."""
    q = torch.randn(length, heads, dim).to(torch.bfloat16)
    k, v = (torch.randn(context, kv_heads, dim).to(torch.bfloat16) for _ in range(2))
    if not ops.prefill_attention_supported(q):
        pytest.skip("no bfloat16 prefill kernel on this CPU")
    try:
        tiles = ops.set_amx(True)
        on = ops.prefill_attention(q, k, v, dim**-0.5)
        ops.set_amx(False)
        off = ops.prefill_attention(q, k, v, dim**-0.5)
    finally:
        ops.set_amx(True)
    assert tiles == built_for("amx_bf16")
    torch.testing.assert_close(on.float(), off.float(), atol=2e-2, rtol=2e-2)


def test_the_build_names_its_vector_width_and_serves_prefill_with_it(ops):
    """``SIMD``: the widest vectors the kernels were compiled for (this CPU's, or x86-64-v3's where
    ``TANDEM_CPU_MARCH`` names it). Prefill attention has a kernel wherever there are vector kernels, so its
    tests above skip only on the portable build."""
    if cpu_ops.MARCH not in ("native", "x86-64-v3"):
        pytest.skip(f"kernels built for {cpu_ops.MARCH}, whose vector width this test does not know")
    flags = set(cpu_ops.cpu_flags().split())
    native = "avx512" if "avx512f" in flags else "avx2" if {"avx2", "fma"} <= flags else "portable"
    want = native if cpu_ops.MARCH == "native" else "avx2"
    assert ops.SIMD == want
    assert ops.prefill_attention_supported(torch.empty(1, 1, 64)) == (want != "portable")


def test_prefill_attention_refuses_what_it_does_not_serve(ops):
    """Head sizes that are not 16, 32, 64, 96 or 128 and dtypes other than float32/bfloat16 go to SDPA
    (``prefill_attention_supported``); called anyway, the kernel raises."""
    q48, q64 = torch.zeros(3, 2, 48), torch.zeros(3, 2, 64)
    if not ops.prefill_attention_supported(q64):
        pytest.skip("no prefill kernel on this CPU (it needs AVX2 and FMA)")
    assert not ops.prefill_attention_supported(q48)
    assert not ops.prefill_attention_supported(q64.double())
    with pytest.raises(RuntimeError, match="no kernel here"):
        ops.prefill_attention(q48, torch.zeros(3, 1, 48), torch.zeros(3, 1, 48), 1.0)
    with pytest.raises(RuntimeError, match="C >= L"):
        ops.prefill_attention(q64, torch.zeros(2, 1, 64), torch.zeros(2, 1, 64), 1.0)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        ops.prefill_attention(torch.zeros(3, 3, 64), torch.zeros(3, 2, 64), torch.zeros(3, 2, 64), 1.0)


@pytest.mark.parametrize("lens", [[1], [5, 17, 3, 64, 100], list(range(1, 300, 7))])
def test_decode_only_metadata_equals_the_general_path(lens):
    """The array-built metadata of an all-decode step holds exactly what the per-request path builds."""
    _, _, spans = _paged_case(torch.float32, lens, 4, 2)
    spans = [(c, n, ids + [999]) for c, n, ids in spans]  # a request may hold a block beyond its context
    fast = decode_metadata(spans, 4, torch.device("cpu"))
    slow = general_metadata(spans, 4, torch.device("cpu"), group_by_len=False)
    assert fast.all_decode and slow.all_decode and not fast.prefills
    assert torch.equal(fast.slot_mapping, slow.slot_mapping)
    [f], [s] = fast.decodes, slow.decodes
    for name in ("token_index", "blocks", "pad_mask", "block_table", "context_lens"):
        a, b = getattr(f, name), getattr(s, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_paged_decode_attention_is_batch_invariant(ops):
    """A sequence's output is bit-identical alone and in a batch (its parts depend on its length only)."""
    cache, q, spans = _paged_case(torch.bfloat16, [700, 40, 300], 6, 2)
    backend = CpuPagedAttentionBackend(6, 2, 32, 4, ops)
    batch = backend.decode(q, cache, build_metadata(spans, 4, torch.device("cpu"), group_by_len=False).decodes[0])
    for i, span in enumerate(spans):
        alone = backend.decode(q[i : i + 1], cache, build_metadata([span], 4, torch.device("cpu")).decodes[0])
        assert torch.equal(alone[0], batch[i])


def test_paged_decode_attention_reads_strided_queries(ops):
    """The model passes q as a view into the fused qkv rows."""
    cache, q, spans = _paged_case(torch.float32, [9, 30], 6, 2)
    qkv = torch.cat([q.flatten(1), torch.randn(2, 128)], dim=1)
    view = qkv[:, : 6 * 32].view(2, 6, 32)
    group = build_metadata(spans, 4, torch.device("cpu"), group_by_len=False).decodes[0]
    backend = CpuPagedAttentionBackend(6, 2, 32, 4, ops)
    torch.testing.assert_close(backend.decode(view, cache, group), backend.decode(q.contiguous(), cache, group))


def test_write_kv_matches_torch(ops):
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, 3 * 2 * 16, generator=g)  # q: 2 heads, k: 2, v: 2
    k, v = qkv[:, 32:64].view(5, 2, 16), qkv[:, 64:].view(5, 2, 16)
    slots = torch.tensor([7, 0, 12, 3, 8])
    a, b = torch.zeros(2, 2, 16, 16), torch.zeros(2, 2, 16, 16)
    CpuPagedAttentionBackend(2, 2, 16, 4, ops).write(k, v, a, slots)
    TorchAttentionBackend(2, 2, 16, 4).write(k, v, b, slots)
    assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="slot out of range"):
        ops.write_kv_(a, k, v, torch.tensor([0, 1, 2, 3, 16]))


def _long_call(ops, kernel: str):
    """A call of ``kernel`` of several milliseconds here (a few on a 16-core host), or None where this build does
    not serve it."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(128, 2048, generator=g), torch.randn(4096, 2048, generator=g)
    if kernel == "linear":
        return lambda: ops.linear(x, w, None)
    if kernel == "packed_linear":
        if not ops.packed_linear_supported(w):
            return None
        packed = ops.pack_linear_weight(w)
        return lambda: ops.packed_linear(x, packed, 4096, None)
    if kernel == "prefill_attention":
        q, k, v = (torch.randn(1024, h, 64, generator=g) for h in (9, 3, 3))
        return (lambda: ops.prefill_attention(q, k, v, 0.125)) if ops.prefill_attention_supported(q) else None
    cache, q, spans = _paged_case(torch.float32, [1500] * 64, 9, 3, 64, block_size=16)
    group = build_metadata(spans, 16, torch.device("cpu"), group_by_len=False).decodes[0]
    return lambda: ops.paged_decode_attention(q, cache, group.block_table, group.context_lens, 16, 0.125)


@pytest.mark.parametrize("kernel", ["linear", "packed_linear", "prefill_attention", "paged_decode_attention"])
def test_matmuls_and_attention_let_other_threads_run(ops, kernel):
    """A worker's gRPC loop and KV connector share the process with the engine's thread: while a matmul or an
    attention call runs, they get the GIL. With a switch interval longer than the test, a thread waiting for the GIL
    never asks its holder to let go; a call that kept the GIL would let the other thread tick at most once, as its
    output is handed back, where one that lets go lets it tick all through."""
    call = _long_call(ops, kernel)
    if call is None:
        pytest.skip(f"this build has no {kernel} for float32 here")
    ticks: list[int] = []
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            ticks.append(1)
            time.sleep(0.0001)  # lets go of the GIL, so the caller gets it back after each call

    interval = sys.getswitchinterval()
    sys.setswitchinterval(30.0)
    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        time.sleep(0.01)
        before, start, calls = len(ticks), time.perf_counter(), 0
        while time.perf_counter() - start < 0.2:
            call()
            calls += 1
        during = len(ticks) - before
    finally:
        stop.set()
        ticker.join()
        sys.setswitchinterval(interval)
    assert during > 2 * calls, f"{kernel}: {during} ticks over {calls} calls (it held the GIL while it ran)"


def test_bad_input_is_an_error_not_a_crash(ops):
    cache, q, spans = _paged_case(torch.float32, [5], 4, 2)
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="block id out of range"):
        ops.paged_decode_attention(q, cache, torch.tensor([[0, 999]], dtype=torch.int32),
                                   torch.tensor([5], dtype=torch.int32), 4, 1.0)
    with pytest.raises(RuntimeError, match="context length"):
        ops.paged_decode_attention(q, cache, table, torch.tensor([0], dtype=torch.int32), 4, 1.0)
    with pytest.raises(RuntimeError, match="context length"):
        ops.paged_decode_attention(q, cache, table, torch.tensor([9], dtype=torch.int32), 4, 1.0)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.linear(torch.ones(1, 4, dtype=torch.float64), torch.ones(2, 4, dtype=torch.float64), None)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        ops.linear(torch.ones(1, 4), torch.ones(2, 5), None)
    with pytest.raises(RuntimeError, match="bias"):
        ops.linear(torch.ones(1, 4), torch.ones(2, 4), torch.ones(3))


# bfloat16 logits of magnitude 8-16 are 0.0625 apart: two such steps of rounding is the tolerance.
@pytest.mark.parametrize("dtype, atol, steps", [("float32", 1e-4, 8), ("bfloat16", 0.125, 2)])
def test_engine_on_kernels_agrees_with_eager_torch(tiny_llama, dtype, atol, steps):
    """A whole mixed batch (prefills, then decodes of different lengths) through both paths."""
    import random

    rng = random.Random(7)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (1, 9, 40, 77)]
    results = []
    for backend in ("cpu", "torch"):
        engine = Engine.from_model(str(tiny_llama), num_kv_blocks=64, dtype=dtype, attention_backend=backend,
                                   cpu_kernels=backend == "cpu")
        assert engine.runner.model.kernels.name == backend
        params = SamplingParams(max_tokens=steps, temperature=0, logprobs=2, ignore_eos=True)
        results.append(batch_logprobs(engine, prompts, params))
    assert_same_tokens_close_logprobs(*results, atol)


def test_kernels_are_the_cpu_default_and_can_be_turned_off(tiny_llama):
    engine = Engine.from_model(str(tiny_llama), num_kv_blocks=8)
    assert (engine.runner.attn.name, engine.runner.model.kernels.name) == ("cpu", "cpu")
    off = Engine.from_model(str(tiny_llama), num_kv_blocks=8, cpu_kernels=False)
    assert [off.runner.attn.name, off.runner.model.kernels.name] == ["torch", "torch"]


def test_the_kernel_switch_and_cache_folder_come_from_the_flags(tiny_llama, monkeypatch, tmp_path):
    """``TANDEM_CPU_KERNELS=0`` / ``--no-cpu-kernels`` and ``$TANDEM_HOME`` reach the engine through its
    config: the engine itself reads no tandem setting."""
    monkeypatch.setenv("TANDEM_CPU_KERNELS", "0")
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config(parser.parse_args(["--model", str(tiny_llama)]))
    assert (config.cpu_kernels, config.kernel_cache_dir) == (False, str(tmp_path / "kernels"))
    assert kernels_dir() == tmp_path / "kernels"
    assert parser.parse_args(["--cpu-kernels"]).cpu_kernels is True
