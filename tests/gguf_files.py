"""GGUF files of the tiny test checkpoints, written with the ``gguf`` package (llama.cpp's own writer and
quantizers): the Q/K rows permuted the way llama.cpp's converter permutes them, every projection in a
chosen block format. Also the same model dequantized back into safetensors: the float model the
GGUF-direct one must equal."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from engine.quant.gguf_file import gguf_name


def _llama_cpp_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's permutation of Q/K rows (each head's halves interleaved)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_dir: Path, out_dir: Path, qtypes: dict[str, str], default: str = "Q4_1") -> Path:
    """``out_dir`` with config.json, the tokenizer files (if any) and ``model.gguf``; no safetensors.

    ``qtypes`` maps a substring of a tensor's name (e.g. "down_proj") to its GGML type; other 2-D
    tensors take ``default``; 1-D tensors stay F32."""
    import gguf
    from gguf import quants

    cfg = json.loads((hf_dir / "config.json").read_text())
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in hf_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out_dir / f.name)
    writer = gguf.GGUFWriter(str(out_dir / "model.gguf"), "llama")
    writer.add_block_count(cfg["num_hidden_layers"])
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for name, t in sorted(load_file(str(hf_dir / "model.safetensors")).items()):
        w = t.float().numpy()
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            w = _llama_cpp_rows(w, heads if "q_proj" in name else kv_heads)
        if w.ndim == 1:
            writer.add_tensor(gguf_name(name), w)
            continue
        kind = next((k for part, k in qtypes.items() if part in name), default)
        qtype = getattr(gguf.GGMLQuantizationType, kind)
        writer.add_tensor(gguf_name(name), quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_dir / "model.gguf"


def dequantized_copy(gguf_dir: Path, out_dir: Path, num_heads: int, num_kv_heads: int) -> Path:
    """A Hugging Face folder with the GGUF's weights dequantized to float32 (read with the gguf package)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    out_dir.mkdir(parents=True, exist_ok=True)
    for f in gguf_dir.iterdir():
        if f.suffix != ".gguf":
            shutil.copy(f, out_dir / f.name)
    names = {}
    cfg = json.loads((gguf_dir / "config.json").read_text())
    for i in range(cfg["num_hidden_layers"]):
        for hf in ("input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                   "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
                   "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"):
            names[gguf_name(f"model.layers.{i}.{hf}")] = f"model.layers.{i}.{hf}"
    for hf in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        names[gguf_name(hf)] = hf
    state = {}
    for t in GGUFReader(str(gguf_dir / "model.gguf")).tensors:
        w = dequantize(t.data, t.tensor_type).reshape(tuple(reversed([int(s) for s in t.shape])))
        hf = names[t.name]
        if hf.endswith(("q_proj.weight", "k_proj.weight")):  # the inverse of _llama_cpp_rows
            heads = num_heads if "q_proj" in hf else num_kv_heads
            w = w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        state[hf] = torch.from_numpy(np.array(w, dtype=np.float32))
    save_file(state, str(out_dir / "model.safetensors"))
    return out_dir
