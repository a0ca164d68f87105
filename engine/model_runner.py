"""Owns the model weights and the paged KV cache tensors; runs one scheduled step."""

from __future__ import annotations

import torch

from engine.attention import build_metadata, select_backend
from engine.config import EngineConfig
from engine.kernels import load_cpu_ops, select_kernels
from engine.kv_blocks import wire_block_bytes, wire_block_shape
from engine.loader import load_model
from engine.scheduler import SchedulerOutput


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        mc = config.model_config
        assert mc is not None
        self.config = config
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        ops = load_cpu_ops(self.device, config.cpu_kernels, config.kernel_cache_dir)
        self.model = load_model(
            config.model,
            mc,
            config.torch_dtype,
            self.device,
            config.max_model_len,
            config.load_format,
            config.seed,
            select_kernels(self.device, ops),
            config.quantization,
            config.gguf_file,
        )
        self.attn = select_backend(
            config.attention_backend, self.device, mc.num_heads, mc.num_kv_heads, mc.head_dim, self.block_size, ops
        )
        self.num_blocks = config.num_kv_blocks or self._blocks_for(config.kv_cache_gb)
        shape = self.attn.cache_shape(self.num_blocks)
        self.kv_caches = [
            torch.zeros(shape, dtype=config.torch_dtype, device=self.device) for _ in range(mc.num_layers)
        ]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers: the wire size of a block."""
        itemsize = torch.empty((), dtype=self.config.torch_dtype).element_size()
        return wire_block_bytes(self.config.model_config, self.block_size, itemsize)

    def export_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of blocks in the wire layout ``[n, *wire_block_shape]``, on the CPU."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        data = torch.stack([self.attn.read_blocks(cache, ids) for cache in self.kv_caches], dim=1)
        return data.to("cpu").contiguous()

    def import_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Write blocks given in the wire layout into the cache (the inverse of ``export_blocks``)."""
        expected = (len(block_ids), *wire_block_shape(self.config.model_config, self.block_size))
        if tuple(data.shape) != expected:
            raise ValueError(f"KV blocks have shape {tuple(data.shape)}, this engine needs {expected}")
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        data = data.to(device=self.device, dtype=self.config.torch_dtype)
        for layer, cache in enumerate(self.kv_caches):
            self.attn.write_blocks(cache, ids, data[:, layer])

    def _blocks_for(self, gigabytes: float) -> int:
        return max(1, int(gigabytes * 2**30) // self.block_bytes)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> torch.Tensor:
        """Logits for the requests whose step ends in a sample, in order: one row each, or ``1 + len(draft)``
        rows for a request with a speculative draft (the target's distribution after each drafted token)."""
        ids, positions, spans, sample_rows = [], [], [], []
        offset = 0
        for s in sched.scheduled:
            r, start = s.request, s.request.num_computed_tokens
            ids.extend(r.token_ids(start, start + s.num_tokens - len(s.draft)))
            ids.extend(s.draft)
            positions.extend(range(start, start + s.num_tokens))
            if s.draft:  # each verified token attends like a decode of its own length: one batched kernel call
                spans.extend((start + i, 1, r.block_ids) for i in range(s.num_tokens))
            else:
                spans.append((start, s.num_tokens, r.block_ids))
            offset += s.num_tokens
            if s.samples:
                sample_rows.extend(range(offset - 1 - len(s.draft), offset))
        meta = build_metadata(spans, self.block_size, self.device, self.attn.groups_by_length)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden = self.model.forward(input_ids, pos, self.kv_caches, meta, self.attn)
        if not sample_rows:
            return hidden.new_empty(0, self.model.lm_head.shape[0], dtype=torch.float32)
        return self.model.logits(hidden[torch.tensor(sample_rows, device=self.device)])
