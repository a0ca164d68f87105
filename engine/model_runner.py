"""Owns the model weights and the paged KV cache tensors (of one tensor-parallel rank); runs one step."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.attention import build_metadata, select_backend
from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs
from engine.kernels import load_cpu_ops, select_kernels
from engine.kv_blocks import wire_block_bytes, wire_block_shape
from engine.loader import load_model
from engine.parallel.group import RankGroup
from engine.parallel.shard import TPShard
from engine.scheduler import SchedulerOutput
from engine.step_inputs import StepInputs


class ModelRunner:
    def __init__(self, config: EngineConfig, shard: TPShard | None = None, group: RankGroup | None = None) -> None:
        mc = config.model_config
        assert mc is not None
        self.config = config
        self.shard = shard or TPShard.of(mc)
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
            self.shard,
        )
        if group is not None and group.size > 1:
            self.model.reduce = group.all_reduce
        self.attn = select_backend(
            config.attention_backend, self.device, self.shard.num_heads, self.shard.num_kv_heads, mc.head_dim,
            self.block_size, ops, config.torch_dtype,
        )
        self.num_blocks = config.num_kv_blocks or self._blocks_for(config.kv_cache_gb)
        self._copy_stream: torch.cuda.Stream | None = None  # KV exports and imports on a GPU (_side_stream)
        graphs = self._graphs_wanted(group)
        # with CUDA graphs, one block more than the scheduler hands out: where padding rows write
        shape = self.attn.cache_shape(self.num_blocks + int(graphs))
        self.kv_caches = [
            self.model.kernels.zeros(shape, config.torch_dtype, self.device) for _ in range(mc.num_layers)
        ]
        self.graphs = DecodeGraphs(self.model, self.kv_caches, self.attn, self.block_size, config.max_model_len,
                                   config.max_num_seqs, scratch_block=self.num_blocks) if graphs else None

    def _graphs_wanted(self, group: RankGroup | None) -> bool:
        """CUDA graphs for decode: on CUDA with a backend whose decode a fixed table width fixes (the Triton
        kernel), and one rank (a tensor-parallel step's all-reduces stay eager)."""
        return (self.config.cuda_graphs and self.device.type == "cuda" and self.attn.static_decode
                and (group is None or group.size == 1))

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers in this rank's cache: its KV heads only."""
        itemsize = torch.empty((), dtype=self.config.torch_dtype).element_size()
        return wire_block_bytes(self.config.model_config, self.block_size, itemsize) * self.shard.num_kv_heads \
            // self.config.model_config.num_kv_heads

    def export_blocks(self, block_ids: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's heads of blocks, in the wire layout ``[n, *wire_block_shape(heads)]`` on the CPU,
        written into ``out`` when given (lent staging rows, or this rank's head range of whole blocks).

        On CPU: one copy per layer straight into ``out``. On a GPU the layers are laid out in wire order on
        the device first, so that the bytes cross the bus in one copy (into pinned staging, at link speed)
        rather than in a strided copy per layer, each a round trip (5 GB/s on an H200, 39 GB/s as one copy).
        """
        out, ready = self.export_blocks_async(block_ids, out)
        if ready is not None:
            ready()
        return out

    def export_blocks_async(self, block_ids: list[int], out: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, Callable[[], None] | None]:
        """``export_blocks`` that leaves the engine thread at once on a GPU: the layers are gathered and
        copied to the host on a side stream, and the second value waits for that copy (a connector calls it
        on its own thread before reading ``out``; None: ``out`` is ready). The step's stream waits only for
        the gather, so no later step can overwrite a block before it is read, and none waits for the bus."""
        mc = self.config.model_config
        shape = (len(block_ids), *wire_block_shape(mc, self.block_size, self.shard.num_kv_heads))
        if out is None:
            out = torch.empty(shape, dtype=self.config.torch_dtype, pin_memory=self.device.type == "cuda")
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        if self.device.type != "cuda":
            self._gather_wire(ids, out)
            return out, None
        side = self._side_stream()
        ids.record_stream(side)  # the steps' stream must not reuse its memory before the side stream read it
        with torch.cuda.stream(side):
            wire = torch.empty(shape, dtype=out.dtype, device=self.device)  # this stream's: freed in its order
            self._gather_wire(ids, wire)
            gathered = torch.cuda.Event()
            gathered.record(side)
            out.copy_(wire, non_blocking=out.is_pinned())
            copied = torch.cuda.Event()
            copied.record(side)
        torch.cuda.current_stream().wait_event(gathered)
        return out, copied.synchronize

    def _side_stream(self) -> torch.cuda.Stream:
        """The stream KV copies run on, beside the steps', after everything the steps' stream queued so far."""
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        self._copy_stream.wait_stream(torch.cuda.current_stream())
        return self._copy_stream

    def _gather_wire(self, ids: torch.Tensor, wire: torch.Tensor) -> None:
        for layer, cache in enumerate(self.kv_caches):
            # [n, 2, bs, Hkv, D] -> [n, Hkv, 2, bs, D], this layer's column of the wire layout
            wire[:, :, layer].copy_(self.attn.read_blocks(cache, ids).permute(0, 3, 1, 2, 4))

    def import_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Write blocks given in the wire layout into the cache (the inverse of ``export_blocks``):
        whole blocks, of which this rank takes its heads, or this rank's heads only. Done when it returns."""
        read = self.import_blocks_async(block_ids, data)
        if read is not None:
            torch.cuda.current_stream().synchronize()

    def import_blocks_async(self, block_ids: list[int], data: torch.Tensor) -> Callable[[], None] | None:
        """``import_blocks`` that leaves the engine thread at once on a GPU: the copy to the device and the
        writes into the cache run on a side stream, which the steps' stream waits for (the next step reads
        the blocks after them; the thread does not wait). Returns what waits until ``data`` has been read
        (the caller keeps its staging rows until then); None: it has been."""
        mc, shard = self.config.model_config, self.shard
        whole = (len(block_ids), *wire_block_shape(mc, self.block_size))
        mine = (len(block_ids), *wire_block_shape(mc, self.block_size, shard.num_kv_heads))
        if tuple(data.shape) == whole and whole != mine:
            data = data[:, shard.first_kv_head : shard.first_kv_head + shard.num_kv_heads]
        elif tuple(data.shape) != mine:
            raise ValueError(f"KV blocks have shape {tuple(data.shape)}, this engine needs {whole}")
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        if self.device.type != "cuda":
            self._scatter_wire(ids, data.to(dtype=self.config.torch_dtype))
            return None
        side = self._side_stream()
        ids.record_stream(side)
        with torch.cuda.stream(side):
            wire = data.to(device=self.device, dtype=self.config.torch_dtype, non_blocking=data.is_pinned())
            read = torch.cuda.Event()
            read.record(side)
            self._scatter_wire(ids, wire)
            written = torch.cuda.Event()
            written.record(side)
        torch.cuda.current_stream().wait_event(written)
        return read.synchronize

    def _scatter_wire(self, ids: torch.Tensor, wire: torch.Tensor) -> None:
        for layer, cache in enumerate(self.kv_caches):
            self.attn.write_blocks(cache, ids, wire[:, :, layer].permute(0, 2, 3, 1, 4))

    def on_dead(self, callback: Callable[[str], None]) -> None:
        """One process cannot lose a rank: nothing to report (``TPExecutor`` can)."""

    def shutdown(self) -> None:
        """Nothing runs beside this process (``TPExecutor`` stops its ranks)."""

    def _blocks_for(self, gigabytes: float) -> int:
        return max(1, int(gigabytes * 2**30) // self.block_bytes)

    def execute(self, sched: SchedulerOutput) -> torch.Tensor:
        """Logits for the requests whose step ends in a sample, in order: one row each, or ``1 + len(draft)``
        rows for a request with a speculative draft (the target's distribution after each drafted token)."""
        return self.run(StepInputs.of(sched))

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> torch.Tensor:
        """The forward pass; logits of ``inputs.sample_rows`` (none on a rank without lm_head)."""
        if self.graphs is not None and self.graphs.fits(inputs.spans):
            hidden = self.graphs.run(inputs.ids, inputs.positions, inputs.spans)
        else:
            meta = build_metadata(inputs.spans, self.block_size, self.device, self.attn.groups_by_length)
            input_ids = torch.tensor(inputs.ids, dtype=torch.long, device=self.device)
            pos = torch.tensor(inputs.positions, dtype=torch.long, device=self.device)
            hidden = self.model.forward(input_ids, pos, self.kv_caches, meta, self.attn)
        head = self.model.lm_head
        if not inputs.sample_rows or head is None:
            vocab = self.config.model_config.vocab_size if head is None else head.shape[0]
            return hidden.new_empty(0, vocab, dtype=torch.float32)
        rows = inputs.sample_rows
        if rows[-1] - rows[0] == len(rows) - 1:  # rows ascend: consecutive (every decode step) is a view, no copy
            return self.model.logits(hidden[rows[0] : rows[-1] + 1])
        return self.model.logits(hidden[torch.tensor(rows, device=self.device)])
