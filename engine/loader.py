"""Builds a ``LlamaModel`` from a local Hugging Face checkpoint, a GGUF file, or random weights.

Weights are read tensor by tensor from safetensors (no transformers import) or from the GGUF file
(its Q4_0 / Q4_1 / Q8_0 tensors stay quantized), cast to the engine dtype, quantized to int8 when
asked, and fused (q|k|v, gate|up) once at load time.
"""

from __future__ import annotations

import ctypes
import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from engine.block_hash import weights_digest
from engine.config import ModelConfig
from engine.kernels import TorchKernels, Weight
from engine.model import LayerWeights, LlamaModel
from engine.parallel.shard import TPShard
from engine.quant import Fp8Weight, QuantizedWeight, concat_rows, dequantize, quantize_fp8, quantize_int8

QUANTIZERS = {"int8": quantize_int8, "fp8": quantize_fp8}  # quantized at load, from the float checkpoint
Getter = Callable[[str], Weight | None]
# The matrices that are read once per token and so quantized (norms, biases and the embedding lookup are not).
QUANTIZED_LINEARS = ("_proj.weight", "lm_head.weight")


def load_model(
    model_dir: str | Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_len: int,
    load_format: str = "auto",
    seed: int = 0,
    kernels: TorchKernels | None = None,
    quantization: str = "none",
    gguf_file: str | Path | None = None,
    shard: TPShard | None = None,
) -> LlamaModel:
    """``quantization``: "none", "int8" / "fp8" (per-channel, from the float checkpoint) or "gguf" (``gguf_file``).

    ``shard``: the part of the model one tensor-parallel rank holds (whole by default); weights are cut
    before they are quantized, so per-channel scales stay per channel.
    """
    shard = shard or TPShard.of(config)
    if shard.size > 1 and quantization == "gguf":
        raise ValueError("--tensor-parallel-size > 1 needs float weights (or --quantization int8 / fp8, "
                         "quantized after the cut): a GGUF file's blocks are not cut across ranks yet")
    if quantization == "gguf":
        get = _gguf_getter(Path(gguf_file or ""), config, dtype)
    elif load_format == "dummy":
        get = _dummy_getter(config, dtype, seed, device)
    else:
        get = _safetensors_getter(Path(model_dir))
    source = gguf_file if quantization == "gguf" else model_dir

    def tensor(name: str, required: bool = True) -> Weight | None:
        t = get(name)
        if t is None:
            if required:
                raise ValueError(f"checkpoint at {source} has no tensor {name!r}")
            return None
        if isinstance(t, QuantizedWeight):
            return t.to(device)
        t = shard.slice(name, t).to(dtype=dtype, device=device)
        quantize = QUANTIZERS.get(quantization)
        return quantize(t).to(device) if quantize and name.endswith(QUANTIZED_LINEARS) else t

    layers = [_layer(tensor, i, config) for i in range(config.num_layers)]
    embed = tensor("model.embed_tokens.weight")
    lm_head = None
    if shard.rank == 0:  # the other ranks sample nothing (engine.parallel)
        lm_head = None if config.tie_word_embeddings else tensor("lm_head.weight", required=False)
        if lm_head is None:  # tied (checkpoints saved with tied weights sometimes omit the flag)
            lm_head = QUANTIZERS[quantization](embed).to(device) if quantization in QUANTIZERS else embed
    if isinstance(embed, QuantizedWeight):
        embed = dequantize(embed, dtype).to(device)  # the lookup reads a few rows: only lm_head streams it
    model = LlamaModel(config, embed, layers, tensor("model.norm.weight"), lm_head, max_len, kernels, shard)
    if device.type == "cpu":
        _release_free_heap()
    return model


def _release_free_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc's ``malloc_trim``). Loading leaves hundreds of MB free
    but mapped: the checkpoint's tensors, and the packed weights that ``CpuKernels.place`` copied to 2 MiB pages
    (the default model in bfloat16: RSS 1,180 -> 898 MB). Elsewhere than glibc, nothing."""
    try:
        trim = getattr(ctypes.CDLL("libc.so.6"), "malloc_trim", None)
    except OSError:
        return
    if trim is not None:
        trim(0)


def _fuse(parts: list[Weight]) -> Weight:
    """Row-stacked projections; quantized ones in one format (a mix with dense ones is dequantized)."""
    if all(isinstance(p, QuantizedWeight) for p in parts):
        return concat_rows(parts)
    if all(isinstance(p, Fp8Weight) for p in parts):
        return Fp8Weight(q_t=torch.cat([p.q_t.t() for p in parts]).t(), scale=torch.cat([p.scale for p in parts]))
    dtype = next(p.dtype for p in parts if isinstance(p, torch.Tensor))
    return torch.cat([dequantize(p, dtype).to(p.device) if isinstance(p, QuantizedWeight) else p for p in parts])


def _layer(tensor: Callable[..., Weight | None], i: int, config: ModelConfig) -> LayerWeights:
    p = f"model.layers.{i}."
    qkv = [tensor(p + f"self_attn.{n}_proj.weight") for n in "qkv"]
    bias = None
    if config.qkv_bias:
        bias = torch.cat([tensor(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
    return LayerWeights(
        input_norm=tensor(p + "input_layernorm.weight"),
        qkv=_fuse(qkv),
        qkv_bias=bias,
        o_proj=tensor(p + "self_attn.o_proj.weight"),
        post_norm=tensor(p + "post_attention_layernorm.weight"),
        gate_up=_fuse([tensor(p + "mlp.gate_proj.weight"), tensor(p + "mlp.up_proj.weight")]),
        down=tensor(p + "mlp.down_proj.weight"),
    )


def _gguf_getter(path: Path, config: ModelConfig, dtype: torch.dtype) -> Getter:
    from engine.quant.gguf_file import GGUFWeights

    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    weights = GGUFWeights(path, config.num_heads, config.num_kv_heads)
    weights.check({"block_count": config.num_layers, "embedding_length": config.hidden_size,
                   "feed_forward_length": config.intermediate_size, "attention.head_count": config.num_heads,
                   "attention.head_count_kv": config.num_kv_heads})
    return lambda name: weights.get(name, dtype)


def _safetensors_getter(model_dir: Path) -> Getter:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    where: dict[str, Path] = {}
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        where = {k: model_dir / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    else:
        for f in files:
            with safe_open(f, framework="pt") as handle:
                where.update(dict.fromkeys(handle.keys(), f))

    def get(name: str) -> torch.Tensor | None:
        if name not in where:
            return None
        with safe_open(where[name], framework="pt") as handle:
            return handle.get_tensor(name)

    return get


def _dummy_getter(config: ModelConfig, dtype: torch.dtype, seed: int, device: torch.device) -> Getter:
    """Random weights of the right shapes: for benchmarks of shapes we have no weights for. Drawn on the
    engine's device (16 GB of Llama-3-8B in seconds on a GPU, minutes on its host's CPU); a device draws
    other numbers than the CPU, so ``weights_id`` tells them apart."""
    gen = torch.Generator(device=device).manual_seed(seed)
    h, d = config.hidden_size, config.head_dim
    shapes = {
        "q_proj.weight": (config.num_heads * d, h),
        "k_proj.weight": (config.num_kv_heads * d, h),
        "v_proj.weight": (config.num_kv_heads * d, h),
        "q_proj.bias": (config.num_heads * d,),
        "k_proj.bias": (config.num_kv_heads * d,),
        "v_proj.bias": (config.num_kv_heads * d,),
        "o_proj.weight": (h, config.num_heads * d),
        "gate_proj.weight": (config.intermediate_size, h),
        "up_proj.weight": (config.intermediate_size, h),
        "down_proj.weight": (h, config.intermediate_size),
        "embed_tokens.weight": (config.vocab_size, h),
        "lm_head.weight": (config.vocab_size, h),
    }

    def get(name: str) -> torch.Tensor | None:
        if name.endswith("norm.weight"):
            return torch.ones(h, dtype=dtype)
        key = ".".join(name.split(".")[-2:])
        t = torch.empty(shapes[key], dtype=torch.float32, device=device)
        return t.normal_(0.0, 0.02, generator=gen).to(dtype)

    return get


def weights_id(model_dir: str | Path, load_format: str = "auto", seed: int = 0, quantization: str = "none",
               gguf_file: str | Path | None = None, device: str = "cpu") -> str:
    """What tells these weights apart from others of the same shape: part of the model fingerprint (so a
    quantized worker never shares KV blocks with an unquantized one)."""
    if quantization == "gguf":
        return "gguf:" + weights_digest([Path(gguf_file or "")])
    if load_format == "dummy":
        kind = torch.device(device).type
        base = f"dummy:{seed}" if kind == "cpu" else f"dummy:{seed}:{kind}"  # drawn by that device's generator
    else:
        base = weights_digest(sorted(Path(model_dir).glob("*.safetensors")))
    return f"{base}:{quantization}" if quantization in QUANTIZERS else base
