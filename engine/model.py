"""The Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) over a paged KV cache.

Tokens of every scheduled request are concatenated into one flat stream; the
attention backend uses the step's metadata to keep requests apart. Q/K/V and
gate/up projections are fused into single matmuls to cut per-op overhead.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from engine.attention import AttentionBackend, AttentionMetadata
from engine.config import ModelConfig


class LayerWeights:
    """One decoder layer's tensors, fused the way the forward pass reads them."""

    __slots__ = ("input_norm", "qkv", "qkv_bias", "o_proj", "post_norm", "gate_up", "down")

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
        lm_head: torch.Tensor,
        max_len: int,
    ) -> None:
        self.config = config
        self.embed = embed
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.cos, self.sin = rope_cache(config, max_len, embed.dtype, embed.device)

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
        cfg = self.config
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        x = F.embedding(input_ids, self.embed)
        n = x.shape[0]
        eps = cfg.rms_norm_eps
        hidden = (cfg.hidden_size,)
        qk_heads = cfg.num_heads + cfg.num_kv_heads
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            h = F.rms_norm(x, hidden, layer.input_norm, eps)
            qkv = F.linear(h, layer.qkv, layer.qkv_bias)
            qk = apply_rope(qkv[:, : self.q_size + self.kv_size].view(n, qk_heads, cfg.head_dim), cos, sin)
            q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]
            v = qkv[:, self.q_size + self.kv_size :].view(n, cfg.num_kv_heads, cfg.head_dim)
            x = x + F.linear(attn.forward(q, k, v, kv, meta), layer.o_proj)
            h = F.rms_norm(x, hidden, layer.post_norm, eps)
            gate, up = F.linear(h, layer.gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.down)
        return F.rms_norm(x, hidden, self.norm, eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE, as in Hugging Face's Llama (not the interleaved variant)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


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
