"""The model's non-attention building blocks, in two implementations with the same results.

``TorchKernels`` is portable eager PyTorch (any device). ``CpuKernels`` runs the decode-heavy
pieces through the compiled kernels of ``engine.cpu_ops``: matrix-vector products that stream
each weight once, and fused norm / activation / RoPE passes; eager mode spends 4-6 ops and as
many passes over memory on each, which at batch size 1 costs about as much as the weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from engine import cpu_ops
from engine.dense_linear import dense_linear
from engine.quant import Fp8Weight, QuantizedWeight, fp8_linear
from engine.quant.reference import qlinear_dequantized


@dataclass(frozen=True)
class PackedWeight:
    """An [rows, cols] float weight in the column panels of ``cpu_ops.packed_linear``, packed once at load.

    Decode's 1-256 rows of x and prefill's thousands all run on one register-blocked kernel that beats both
    the row-streaming kernel and oneDNN on CPUs with AVX-512 (measured on a 2-core EPYC over the default
    model's layers, bfloat16: 409 / 436 / 430 GFLOP/s at 16 / 64 / 256 rows against oneDNN's 224 / 334 / 380
    and the streaming kernel's 272 / 289 / 293; on par with oneDNN at 1,024), so the matrix is kept in that
    layout only, at the same size. With AMX, bfloat16 runs on the tiles over the same panels (see
    ``packed_dtypes``). With AVX2 and FMA but no AVX-512, an 8-lane kernel reads the same panels (a 2-core Zen 1
    EPYC, same matrices: float32 51 / 70 / 80 GFLOP/s at 16 / 64 / 1,024 rows against 16 / 54 / 78 for the
    streaming kernel and oneDNN; bfloat16, widened, 72-76 against the streaming kernel's 23-24). One kernel for
    every row count also makes a row's result independent of the batch it decodes in.
    """

    data: torch.Tensor
    rows: int
    cols: int
    # The packed weight the forward pass multiplies by next, whose first panels the kernel fetches while it
    # finishes this one (see ``TorchKernels.chain``).
    next_data: torch.Tensor | None = None
    next_rows: int = 0
    # > 0: a gate_up weight laid out for ``packed_linear_silu`` (``CpuKernels.prepare_gate_up``); its product is
    # silu(gate) * up, this many columns, and ``linear`` refuses it.
    silu_cols: int = 0

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.cols

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


Weight = torch.Tensor | QuantizedWeight | Fp8Weight | PackedWeight


class TorchKernels:
    name = "torch"

    def linear(self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(weight, QuantizedWeight):
            return qlinear_dequantized(x, weight, bias)
        if isinstance(weight, Fp8Weight):
            return fp8_linear(x, weight, bias)
        return dense_linear(x, weight, bias)

    def logits(self, x: torch.Tensor, weight: Weight) -> torch.Tensor:
        """``linear(x, weight)`` in x's dtype, returned as float32 (what sampling reads)."""
        return self.linear(x, weight).float()

    def prepare_weight(self, weight: Weight) -> Weight:
        """A linear layer's weight in the layout ``linear`` reads fastest (done once, at load)."""
        return weight

    def chain(self, weights: list[Weight]) -> list[Weight]:
        """``weights`` in the order the forward pass reads them (the last leads back to the first), each told
        which comes next where the layout can use it; the same weights otherwise."""
        return weights

    def place(self, weights: list[Weight]) -> list[Weight]:
        """``weights`` (in the forward pass's order) moved to the memory the kernels read fastest; as they are
        here."""
        return weights

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zeroed buffer that the kernels read in scattered runs (the KV cache), in the memory that suits it."""
        return torch.zeros(shape, dtype=dtype, device=device)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's first largest index (greedy sampling's token), as ``torch.argmax(x, -1)``."""
        return x.argmax(dim=-1)

    def decode_stack(self, layers: list[Any], final_norm: torch.Tensor, eps: float, num_heads: int,
                     num_kv_heads: int, head_dim: int) -> Any | None:
        """The decoder ``layers`` (``engine.model.LayerWeights``, as laid out) as one compiled call for steps where
        every request decodes a token, where these kernels have one; None here: the model's Python forward runs
        every step."""
        return None

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def add_rms_norm_(
        self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``residual += delta`` in place, then the norm of the new residual."""
        residual.add_(delta)
        return self.rms_norm(residual, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def prepare_gate_up(self, weight: Weight) -> Weight:
        """The MLP's fused [gate; up] weight in the layout ``gate_up_silu`` reads fastest (once, at load)."""
        return self.prepare_weight(weight)

    def gate_up_silu(self, x: torch.Tensor, weight: Weight) -> torch.Tensor:
        """silu(x gate^T) * (x up^T): the MLP up to its down projection."""
        return self.silu_mul(self.linear(x, weight))

    def rope_tables(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> Any:
        """Per-step RoPE inputs, computed once and shared by every layer."""
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)

    def rope_(self, qkv: torch.Tensor, tables: Any, num_heads: int, head_dim: int) -> None:
        """Rotate the first ``num_heads`` heads (queries, then keys) of every row in place."""
        qk = qkv[:, : num_heads * head_dim].view(qkv.shape[0], num_heads, head_dim)
        qk.copy_(apply_rope(qk, *tables))


# Rows of x up to which the project's row-streaming linear kernel beats oneDNN's GEMM, per dtype and CPU (see
# small_m_table), for weights in the plain layout: where the packed kernel runs (packed_dtypes), it serves them all.
# float32: 16 everywhere measured (a 2-core AVX-512 EPYC and Xeon). bfloat16 with AVX512_BF16 dot products
# (vdpbf16ps) and no AMX: 128, measured on the EPYC over the default model's layer shapes (bench step-profile):
# the kernel ran 194 / 263 / 276 GFLOP/s at 16 / 64 / 128 rows, oneDNN 64-131 / 223 / 275, and oneDNN pulls
# ahead at 256 (342 against 285). With AMX: 16, oneDNN's tile GEMM (bfloat16 weights are packed there anyway, for
# the packed kernel's own tiles). Without native bfloat16, oneDNN's bfloat16 GEMM is slower than the streaming
# kernel at every size (and there the packed kernel, widening bfloat16 in registers, serves every row count).
SMALL_M = 16
SMALL_M_DOT_BF16 = 128
# Rows of x above which dequantizing a quantized weight and running oneDNN's GEMM would beat ops.qlinear: none
# measured. On a 2-core AVX-512 VNNI EPYC (no AMX) the integer kernel ran 280-440 GOP/s at 512-2048 rows, the
# bfloat16 GEMM (dequantizing with torch ops included) 100-330 GFLOP/s, float32 75-175. On a 2-core Xeon with AMX,
# where qlinear runs bfloat16 x from 24 rows on the tiles, over the default model's matrices: 1,024 rows 137 ms
# (Q4_1) against oneDNN's 379, 64 rows 16.7 against 271.
QUANT_GEMM_M = {torch.bfloat16: 1 << 30, torch.float32: 1 << 30}
# AVX2 CPUs (no VNNI: the integer kernel multiplies in int16) cross over at about 256 rows:
# over the default model's four matrices in Q4_0 / Q8_0, bfloat16 x, x86-64-v3 build on a 2-core Zen 4, integer
# kernel against dequantizing and float32 GEMM: 16 rows 1.2 / 1.1 ms against 11.3 / 10.9, 64 rows 3.8 / 3.8 against
# 13.3 / 10.4, 128 rows 7.3 / 7.1 against 13.9 / 11.2, 256 rows 14.1 / 14.7 against 13.9 / 13.8. With the weights
# widened once for two rows (qgroup_rows), same machine type: 256 rows 10.2 / 10.4 against 14.9 / 9.8, 384 rows
# 16.2 / 15.4 against 17.1 / 12.0, 512 rows 22.0 / 22.0 against 19.7 / 15.0: still about 256.
QUANT_GEMM_M_AVX2 = 256


class CpuKernels(TorchKernels):
    name = "cpu"

    def __init__(self, ops: ModuleType) -> None:
        self.ops = ops
        amx = "amx_bf16" in cpu_ops.cpu_flags()
        self.quant_gemm_rows = dict(QUANT_GEMM_M)
        if ops.SIMD == "avx2":
            self.quant_gemm_rows = dict.fromkeys(QUANT_GEMM_M, QUANT_GEMM_M_AVX2)
        self.small_m = small_m_table(ops, amx)
        self.packed = packed_dtypes(ops)

    def linear(self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(weight, QuantizedWeight):
            return self.qlinear(x, weight, bias)
        if isinstance(weight, PackedWeight):
            if weight.silu_cols:
                raise ValueError("this gate_up weight is packed for gate_up_silu, not for linear")
            return self.ops.packed_linear(x, weight.data, weight.rows, bias, weight.next_data, weight.next_rows)
        if x.dtype != weight.dtype or x.shape[0] > self.small_m.get(x.dtype, 0):
            return F.linear(x, weight, bias)  # a GEMM's register blocking wins once there are many rows
        return self.ops.linear(x, weight, bias)

    def logits(self, x: torch.Tensor, weight: Weight) -> torch.Tensor:
        """The packed kernel writes float32 itself (rounded to x's dtype first, so the values are the same): at
        a vocabulary of 49,152 and 16 rows, ``.float()`` was another 3 MB pass, 0.2 ms of a 12 ms step."""
        if isinstance(weight, PackedWeight):
            return self.ops.packed_linear(x, weight.data, weight.rows, None, weight.next_data, weight.next_rows,
                                          float_out=True)
        return super().logits(x, weight)

    def prepare_weight(self, weight: Weight) -> Weight:
        """Float weights packed for ``packed_linear`` where it serves every row count (see ``self.packed``)."""
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.dtype not in self.packed:
            return weight
        return PackedWeight(self.ops.pack_linear_weight(weight), weight.shape[0], weight.shape[1])

    def prepare_gate_up(self, weight: Weight) -> Weight:
        """Gate and up rows interleaved by half-panels (zero rows past I), so that one panel's accumulators
        hold matching gate and up columns and the kernel applies the activation before it stores: the [T, 2I]
        projection is never written nor read back, and the separate silu_mul call is gone."""
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.dtype not in self.packed \
                or weight.shape[0] % 2:
            return self.prepare_weight(weight)
        half, k = weight.shape[0] // 2, weight.shape[1]
        h = self.ops.packed_silu_half_panel()
        panels = -(-half // h)
        halves = [F.pad(part, (0, 0, 0, panels * h - half)).view(panels, h, k) for part in weight.split(half)]
        rows = torch.stack(halves, dim=1).reshape(2 * panels * h, k)
        return PackedWeight(self.ops.pack_linear_weight(rows), rows.shape[0], k, silu_cols=half)

    def gate_up_silu(self, x: torch.Tensor, weight: Weight) -> torch.Tensor:
        if isinstance(weight, PackedWeight) and weight.silu_cols:
            return self.ops.packed_linear_silu(x, weight.data, weight.silu_cols, weight.next_data, weight.next_rows)
        return super().gate_up_silu(x, weight)

    def chain(self, weights: list[Weight]) -> list[Weight]:
        """A call starts on a cold panel with nothing to overlap its fetch with (a tenth to a third of each of
        the default model's matrices per thread); told the next packed weight, the kernel fetches that panel
        during its last one (16 rows: 8.7 -> 8.3 ms per pass over the default model's matrices, bfloat16)."""
        out = list(weights)
        for i, w in enumerate(weights):
            nxt = weights[(i + 1) % len(weights)]
            if isinstance(w, PackedWeight) and isinstance(nxt, PackedWeight):
                out[i] = replace(w, next_data=nxt.data, next_rows=nxt.rows)
        return out

    def place(self, weights: list[Weight]) -> list[Weight]:
        """The packed and quantized weights' tensors copied, in the forward pass's order, into one buffer on 2 MiB
        pages (``ops.huge_page_buffer``, which says what they save); the rest as they are. Each copy frees its
        source once the caller lets go of it."""
        fields = [{name: getattr(w, name) for name in _streamed(w)} for w in weights]
        tensors = [t for f in fields for t in f.values()]
        if not tensors or any(t.device.type != "cpu" for t in tensors):
            return weights
        arena = self.ops.huge_page_buffer(sum(_page_aligned(t.nbytes) for t in tensors))
        offset = 0
        for f in fields:
            for name, src in f.items():
                f[name] = arena[offset : offset + src.nbytes].view(src.dtype).view(src.shape).copy_(src)
                offset += _page_aligned(src.nbytes)
        return [replace(w, **f) if f else w for w, f in zip(weights, fields, strict=True)]

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """On 2 MiB pages from 1 MiB up (smaller buffers as torch allocates them: a page would be mostly empty)."""
        nbytes = math.prod(shape) * dtype.itemsize
        if device.type != "cpu" or nbytes < HUGE_PAGE_MIN_BYTES:
            return super().zeros(shape, dtype, device)
        return self.ops.huge_page_buffer(nbytes)[:nbytes].view(dtype).view(shape).zero_()

    def decode_stack(self, layers: list[Any], final_norm: torch.Tensor, eps: float, num_heads: int,
                     num_kv_heads: int, head_dim: int) -> Any | None:
        """``cpu_ops.DecodeStack`` (decode_stack.h says what it saves) where every matrix is packed; None where
        one is not (quantized, or a dtype without a packed kernel here)."""
        mats = [getattr(layer, name) for layer in layers for name in ("qkv", "o_proj", "gate_up", "down")]
        if not layers or not all(isinstance(w, PackedWeight) for w in mats) \
                or not all(layer.gate_up.silu_cols for layer in layers):
            return None

        def packed(w: PackedWeight, bias: torch.Tensor | None = None) -> Any:
            return self.ops.StackLinear(w.data, w.silu_cols or w.rows, bias, w.next_data, w.next_rows)

        stack = [self.ops.StackLayer(layer.input_norm, packed(layer.qkv, layer.qkv_bias), packed(layer.o_proj),
                                     layer.post_norm, packed(layer.gate_up), packed(layer.down)) for layer in layers]
        return self.ops.DecodeStack(stack, final_norm, eps, num_heads, num_kv_heads, head_dim)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """torch's CPU argmax reads ~5 GB/s, 20x slower than its amax: a vectorised kernel for float32 rows."""
        if x.dim() == 2 and x.dtype == torch.float32 and x.shape[1] > 0:
            return self.ops.argmax_rows(x)
        return x.argmax(dim=-1)

    def qlinear(self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        if x.shape[0] > self.quant_gemm_rows.get(x.dtype, 0) or not self.ops.QUANT_INT_DOT and x.shape[0] > 1:
            return qlinear_dequantized(x, weight, bias)
        return self.ops.qlinear(x, weight.data, weight.scale, weight.offset, weight.zero, weight.bits, weight.rows,
                                bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.ops.rms_norm(x, weight, eps)

    def add_rms_norm_(
        self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        return self.ops.add_rms_norm_(residual, delta, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_mul(gate_up)

    def rope_tables(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> Any:
        return positions, cos, sin

    def rope_(self, qkv: torch.Tensor, tables: Any, num_heads: int, head_dim: int) -> None:
        self.ops.rope_(qkv, *tables, num_heads, head_dim)


HUGE_PAGE_MIN_BYTES = 1 << 20


def _streamed(weight: Weight) -> tuple[str, ...]:
    """The fields of ``weight`` that a matmul streams from memory (``CpuKernels.place`` moves them)."""
    if isinstance(weight, PackedWeight):
        return ("data",)
    if isinstance(weight, QuantizedWeight):
        return ("data", "scale") if weight.offset is None else ("data", "scale", "offset")
    return ()


def _page_aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a 4 KiB page: each weight in the arena starts on its own page."""
    return -(-nbytes // 4096) * 4096


def small_m_table(ops: ModuleType, amx: bool) -> dict[torch.dtype, int]:
    """Rows of x up to which ``ops.linear`` serves a matmul, per dtype (above: oneDNN through F.linear)."""
    if not ops.NATIVE_BF16:
        bf16 = 1 << 30
    elif amx or not ops.DOT_BF16:
        bf16 = SMALL_M
    else:
        bf16 = SMALL_M_DOT_BF16
    return {torch.float32: SMALL_M, torch.bfloat16: bf16}


def packed_dtypes(ops: ModuleType) -> set[torch.dtype]:
    """The dtypes whose weights ``CpuKernels`` packs: those the packed kernel runs here. With AMX, bfloat16 runs
    on its tiles over the same panels, ahead of oneDNN's tile GEMM at every row count measured (a 2-core Xeon,
    the default model's matrices: 10.8 / 20.0 / 53.8 / 221 ms at 16 / 64 / 256 / 1,024 rows against oneDNN's
    22.4 / 30.1 / 57.5 / 242, and level with the streaming kernel at 1 row)."""
    dtypes = {torch.float32, torch.bfloat16}
    return {d for d in dtypes if ops.packed_linear_supported(torch.empty(0, 0, dtype=d))}


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE, as in Hugging Face's Llama (not the interleaved variant)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def select_kernels(device: torch.device, ops: ModuleType | None) -> TorchKernels:
    """The compiled CPU kernels ``ops`` on CPU when the engine has them (``load_cpu_ops``), else eager torch."""
    return CpuKernels(ops) if device.type == "cpu" and ops is not None else TorchKernels()


def load_cpu_ops(device: torch.device, enabled: bool, cache_dir: str | None) -> ModuleType | None:
    """The compiled CPU kernels when on CPU and ``enabled`` and they build here; else None."""
    if device.type != "cpu" or not enabled:
        return None
    return cpu_ops.load(cache_dir)
