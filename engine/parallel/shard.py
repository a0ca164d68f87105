"""Which part of a model one tensor-parallel rank holds (Megatron-style sharding, as vLLM does it).

- Column-parallel: the rows of q/k/v and gate/up (each rank computes its heads and its slice of the MLP).
- Row-parallel: the columns of o_proj and down; their outputs are partial sums, all-reduced.
- KV heads split across ranks; when the degree exceeds the KV-head count, each KV head is replicated
  on ``size / num_kv_heads`` ranks, which then all serve query heads of its group.
- The embedding is replicated (a lookup of a few rows costs nothing to repeat) and only rank 0 holds
  lm_head (see ``engine.parallel`` for why).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import ModelConfig, check_degree


@dataclass(frozen=True, slots=True)
class TPShard:
    rank: int
    size: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank
    first_head: int
    first_kv_head: int
    intermediate: int  # MLP width on this rank
    head_dim: int
    kv_replicas: int = 1  # ranks holding each KV head (> 1 when the degree exceeds the KV heads)

    @classmethod
    def of(cls, config: ModelConfig, rank: int = 0, size: int = 1) -> TPShard:
        check_degree(config, size)
        heads, kv = config.num_heads // size, max(1, config.num_kv_heads // size)
        first_kv = rank * config.num_kv_heads // size  # a replicated head: ranks size/KV apart share it
        inter = config.intermediate_size // size
        replicas = max(1, size // config.num_kv_heads)
        return cls(rank, size, heads, kv, rank * heads, first_kv, inter, config.head_dim, replicas)

    @property
    def owns_kv(self) -> bool:
        """Whether this rank writes its KV heads out: with replication, only the first rank of each
        head's replicas does, so every byte of a block is written once."""
        return self.rank % self.kv_replicas == 0

    def slice(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of checkpoint tensor ``name`` (a copy, so the whole tensor can be freed)."""
        if self.size == 1:
            return t
        d = self.head_dim
        q = slice(self.first_head * d, (self.first_head + self.num_heads) * d)
        kv = slice(self.first_kv_head * d, (self.first_kv_head + self.num_kv_heads) * d)
        mlp = slice(self.rank * self.intermediate, (self.rank + 1) * self.intermediate)
        if ".q_proj." in name:
            part = t[q]
        elif ".k_proj." in name or ".v_proj." in name:
            part = t[kv]
        elif "o_proj.weight" in name:
            part = t[:, q]
        elif "gate_proj.weight" in name or "up_proj.weight" in name:
            part = t[mlp]
        elif "down_proj.weight" in name:
            part = t[:, mlp]
        else:
            return t  # norms, the embedding, lm_head: whole
        return part.contiguous().clone()
