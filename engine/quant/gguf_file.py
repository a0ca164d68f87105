"""Weights of a GGUF file (llama.cpp's format) as tandem's tensors, without dequantizing.

Q4_0, Q4_1 and Q8_0 tensors become ``QuantizedWeight`` with their float16 scales and mins kept as they
are; F32 / F16 / BF16 tensors are plain tensors. Tensors in other formats (the
K-quants, ...) are dequantized with the ``gguf`` package (``pip install gguf``) into the model dtype, with
a warning: they serve correctly but read as many bytes as an unquantized model.

llama.cpp's converter permutes the rows of Q and K for its interleaved RoPE; they are permuted back
(rows only, so a quantized tensor's blocks are untouched), as transformers' GGUF loader does.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from engine.quant.gguf_reader import GGUFFile, GGUFTensor
from engine.quant.weight import QuantizedWeight

log = logging.getLogger(__name__)

# tandem's (Hugging Face's) name of each llama tensor -> GGUF's.
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}


def gguf_name(name: str) -> str:
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    parts = name.split(".", 3)  # model.layers.{i}.rest
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _LAYER_NAMES:
        return f"blk.{parts[2]}.{_LAYER_NAMES[parts[3]]}"
    raise KeyError(name)


Blocks = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int, int]  # u, scale, offset, zero, bits


def _f16(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16).copy())


def _q8_0(raw: np.ndarray) -> Blocks:
    """34-byte blocks: float16 d, 32 int8 q; w = d q = d ((q + 128) - 128)."""
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, 34)
    d = _f16(blocks[..., :2]).view(n, -1)
    q = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:]).view(np.int8).astype(np.int16))
    return (q + 128).to(torch.uint8).view(n, -1), d, None, 128, 8


def _nibbles(qs: np.ndarray, n: int) -> torch.Tensor:
    """16 bytes per block: element i in the low nibble of byte i, element i + 16 in its high nibble."""
    q = torch.from_numpy(np.ascontiguousarray(qs))
    return torch.cat([q & 0x0F, q >> 4], dim=-1).view(n, -1)


def _q4_0(raw: np.ndarray) -> Blocks:
    """18-byte blocks: float16 d, 16 bytes of nibbles; w = d (q - 8)."""
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, 18)
    d = _f16(blocks[..., :2]).view(n, -1)
    return _nibbles(blocks[..., 2:], n), d, None, 8, 4


def _q4_1(raw: np.ndarray) -> Blocks:
    """20-byte blocks: float16 d, float16 m, 16 bytes of nibbles; w = d q + m."""
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, 20)
    d = _f16(blocks[..., :2]).view(n, -1)
    m = _f16(blocks[..., 2:4]).view(n, -1)
    return _nibbles(blocks[..., 4:], n), d, m, 0, 4


_BLOCK_FORMATS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1}


class GGUFWeights:
    """Tensors of one GGUF file by their Hugging Face names, read lazily (the file is memory-mapped)."""

    def __init__(self, path: str | Path, num_heads: int, num_kv_heads: int) -> None:
        self.path = Path(path)
        self.file = GGUFFile(self.path)
        self.tensors = self.file.tensors
        self.heads = {"attn_q.weight": num_heads, "attn_k.weight": num_kv_heads,
                      "attn_q.bias": num_heads, "attn_k.bias": num_kv_heads}
        self.formats: dict[str, int] = {}  # GGUF type name -> tensors read in it

    def check(self, expected: dict[str, int]) -> None:
        """Refuse a GGUF whose metadata disagrees with config.json (``expected``: GGUF key suffix -> value), so a
        mismatched pair fails at load with the field named rather than as a shape error deep in a step."""
        arch = self.file.fields.get("general.architecture", "llama")
        for key, want in expected.items():
            got = self.file.fields.get(f"{arch}.{key}")
            if got is not None and int(got) != want:
                raise ValueError(f"{self.path.name}: {arch}.{key} is {got}, config.json says {want}; "
                                 "the GGUF file and config.json describe different models")

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor | QuantizedWeight | None:
        try:
            t = self.tensors.get(gguf_name(name))
        except KeyError:
            return None
        if t is None:
            return None
        kind = t.type_name
        self.formats[kind] = self.formats.get(kind, 0) + 1
        rows = self._row_order(t.name, t.shape[0])
        if kind in _BLOCK_FORMATS:
            u, scale, offset, zero, bits = _BLOCK_FORMATS[kind](np.asarray(t.data))
            if rows is not None:
                u, scale, offset = u[rows], scale[rows], None if offset is None else offset[rows]
            return QuantizedWeight.from_values(u, scale, offset, zero, bits, kind.lower())
        dense = self._dense(t, kind)
        return (dense[rows] if rows is not None else dense).to(dtype)

    def _dense(self, t: GGUFTensor, kind: str) -> torch.Tensor:
        raw = np.ascontiguousarray(t.data)
        if kind == "BF16":
            return torch.from_numpy(raw.view(np.int16).copy()).view(torch.bfloat16).reshape(t.shape)
        if kind in ("F32", "F16"):
            return torch.from_numpy(raw.view(np.float32 if kind == "F32" else np.float16).astype(np.float32)).reshape(
                t.shape)
        try:
            from gguf import GGMLQuantizationType
            from gguf.quants import dequantize
        except ImportError as exc:
            raise ValueError(f"GGUF tensor {t.name} is {kind}: tandem reads Q4_0, Q4_1, Q8_0, F32, F16 and BF16 "
                             f"directly; other formats need the gguf package (pip install gguf)") from exc
        log.warning("GGUF tensor %s is %s: dequantized (tandem reads Q4_0, Q4_1 and Q8_0 directly)", t.name, kind)
        values = dequantize(raw, GGMLQuantizationType(t.type_id)).astype(np.float32)
        return torch.from_numpy(values).reshape(t.shape)

    def _row_order(self, gguf_tensor: str, rows: int) -> torch.Tensor | None:
        """The rows of Q and K in Hugging Face's order (llama.cpp interleaves each head's two halves)."""
        suffix = gguf_tensor.split(".", 2)[-1]
        heads = self.heads.get(suffix)
        if heads is None:
            return None
        half = rows // heads // 2
        return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(-1)
