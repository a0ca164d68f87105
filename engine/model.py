"""The Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) over a paged KV cache.

Tokens of every scheduled request are concatenated into one flat stream; the
attention backend uses the step's metadata to keep requests apart. Q/K/V and
gate/up projections are fused into single matmuls to cut per-op overhead, and
each residual add is fused with the norm that follows it. The arithmetic goes
through ``engine.kernels`` (compiled CPU kernels, or eager torch).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.attention import AttentionBackend, AttentionMetadata, CpuPagedAttentionBackend
from engine.config import ModelConfig
from engine.kernels import TorchKernels
from engine.parallel.shard import TPShard


class LayerWeights:
    """One decoder layer's tensors, fused the way the forward pass reads them."""

    __slots__ = ("input_norm", "qkv", "qkv_bias", "o_proj", "post_norm", "gate_up", "down")
    LINEARS = ("qkv", "o_proj", "gate_up", "down")  # the matrices, in the kernels' layout (prepare_weight)

    def __init__(self, **tensors: torch.Tensor | None) -> None:
        for name in self.__slots__:
            setattr(self, name, tensors.get(name))


class LlamaModel:
    def __init__(
        self,
        config: ModelConfig,
        embed: torch.Tensor,
        layers: list[LayerWeights],
        norm: torch.Tensor,
        lm_head: torch.Tensor | None,
        max_len: int,
        kernels: TorchKernels | None = None,
        shard: TPShard | None = None,
    ) -> None:
        self.config = config
        self.embed = embed
        self.kernels = kernels or TorchKernels()
        for layer in layers:
            for name in LayerWeights.LINEARS:
                prepare = self.kernels.prepare_gate_up if name == "gate_up" else self.kernels.prepare_weight
                setattr(layer, name, prepare(getattr(layer, name)))
        self.layers = layers
        self.norm = norm
        # None on tensor-parallel ranks other than 0: they sample nothing
        self.lm_head = None if lm_head is None else self.kernels.prepare_weight(lm_head)
        self._lay_out_weights()
        shard = shard or TPShard.of(config)
        self.num_heads, self.num_kv_heads = shard.num_heads, shard.num_kv_heads  # this rank's
        self.cos, self.sin = rope_cache(config, max_len, embed.dtype, embed.device)
        # Tensor parallelism: sums the row-parallel layers' partial outputs over the ranks, in place.
        self.reduce: Callable[[torch.Tensor], None] | None = None
        # All-decode steps in one compiled call where the kernels have one (``forward`` says when it is used).
        self.decode_stack = self.kernels.decode_stack(self.layers, norm, config.rms_norm_eps, self.num_heads,
                                                      self.num_kv_heads, config.head_dim)

    def _lay_out_weights(self) -> None:
        """Lay the matrices out in the memory the kernels want, in the order the forward pass reads them, and
        tell each which one comes after it (kernels that prefetch across calls)."""
        slots = [(layer, name) for layer in self.layers for name in LayerWeights.LINEARS]
        weights = [getattr(layer, name) for layer, name in slots]
        if self.lm_head is not None:
            weights.append(self.lm_head)
        chained = self.kernels.chain(self.kernels.place(weights))
        for (layer, name), w in zip(slots, chained, strict=False):
            setattr(layer, name, w)
        if self.lm_head is not None:
            self.lm_head = chained[-1]

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        """Hidden states after the final norm, [num_tokens, hidden]."""
        cfg, ops = self.config, self.kernels
        x = F.embedding(input_ids, self.embed)  # the residual stream, updated in place
        if self.decode_stack is not None and meta.all_decode and self.reduce is None \
                and attn.name == CpuPagedAttentionBackend.name:
            group = meta.decodes[0]
            return self.decode_stack.forward(x, positions, self.cos, self.sin, kv_caches, meta.slot_mapping,
                                             group.block_table, group.context_lens, attn.block_size, attn.scale)
        rope = ops.rope_tables(self.cos, self.sin, positions)
        n, d = x.shape[0], cfg.head_dim
        heads, kv_heads = self.num_heads, self.num_kv_heads
        split = (heads, kv_heads, kv_heads)
        delta = None  # what the last sub-block adds to the residual stream
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            h = self._norm(x, delta, layer.input_norm)
            qkv = ops.linear(h, layer.qkv, layer.qkv_bias)
            ops.rope_(qkv, rope, heads + kv_heads, d)
            q, k, v = qkv.view(n, heads + 2 * kv_heads, d).split_with_sizes(split, dim=1)  # views, one C++ call
            delta = self._reduced(ops.linear(attn.forward(q, k, v, kv, meta), layer.o_proj))
            h = self._norm(x, delta, layer.post_norm)
            delta = self._reduced(ops.linear(ops.gate_up_silu(h, layer.gate_up), layer.down))
        return self._norm(x, delta, self.norm)

    def _reduced(self, partial: torch.Tensor) -> torch.Tensor:
        if self.reduce is not None:
            self.reduce(partial)
        return partial

    def _norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
        eps = self.config.rms_norm_eps
        if delta is None:
            return self.kernels.rms_norm(x, weight, eps)
        return self.kernels.add_rms_norm_(x, delta, weight, eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.kernels.logits(hidden, self.lm_head)


def rope_cache(
    config: ModelConfig, max_len: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for every position, computed in float32 then cast, as transformers does."""
    inv_freq = rope_inv_freq(config)
    freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype=dtype, device=device), emb.sin().to(dtype=dtype, device=device)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths slowed, short kept, smooth between."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)
