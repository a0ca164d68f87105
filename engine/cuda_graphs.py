"""CUDA graphs of the decode step: the whole forward pass (every layer's kernels) replayed as one graph.

A decode step of a large model on a GPU is hundreds of small kernel launches, each a few microseconds of
Python and driver time, so an eager step is bound by the host, not by reading weights (a dummy
Llama-3-8B on an H200 decoded at 13% of HBM bandwidth). A graph replays them with one launch.

What makes the step graphable: every input lives at a fixed address (one device buffer of the step's
integers, filled by one non-blocking copy from one pinned host buffer), the batch is padded up to one of
``CAPTURE_SIZES`` (padding rows write their K/V into a scratch block no request owns and attend over one
token of it), and the attention kernel's grid depends only on the block table's width, which is fixed at
``max_model_len / block_size``. Graphs are captured lazily, the first time a batch size is needed, each in
its own memory pool; steps with prompt tokens, or larger than the largest size, run eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import AttentionBackend, AttentionMetadata, DecodeGroup, fill_decode_table
from engine.model import LlamaModel

CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [size, hidden], rewritten by every replay


class DecodeGraphs:
    """The decode forward pass at each capture size, replayed on a step's inputs."""

    def __init__(self, model: LlamaModel, kv_caches: list[torch.Tensor], attn: AttentionBackend,
                 block_size: int, max_model_len: int, max_batch: int, scratch_block: int) -> None:
        self.model, self.kv_caches, self.attn = model, kv_caches, attn
        self.block_size, self.scratch = block_size, scratch_block
        self.width = -(-max_model_len // block_size)  # blocks per table row
        self.sizes = [s for s in CAPTURE_SIZES if s <= max_batch] or [1]
        self.graphs: dict[int, _Graph] = {}
        n = self.max_batch = self.sizes[-1]
        # ids, positions, slots, context lengths ([n] each), then the block table ([n, width])
        self.host = torch.zeros(4 * n + n * self.width, dtype=torch.int64, pin_memory=True)
        self.words = self.host.numpy()
        self.device_words = torch.zeros(self.host.shape, dtype=torch.int64, device=model.device)
        self.copied = torch.cuda.Event()  # the last step's copy out of ``host``, which the next fill waits for

    def fits(self, spans: list[tuple[int, int, list[int]]]) -> bool:
        """A step this can replay: decodes only (one token each), few enough, none longer than the table."""
        return (0 < len(spans) <= self.max_batch and all(new == 1 for _, new, _ in spans)
                and max(computed for computed, _, _ in spans) < self.width * self.block_size)

    @torch.inference_mode()
    def run(self, ids: list[int], positions: list[int], spans: list[tuple[int, int, list[int]]]) -> torch.Tensor:
        """Hidden states ``[len(spans), hidden]`` of a step that ``fits``; valid until the next replay."""
        b = len(spans)
        size = next(s for s in self.sizes if s >= b)
        used = self._fill(size, ids, positions, spans)
        self.device_words[:used].copy_(self.host[:used], non_blocking=True)
        self.copied.record()
        graph = self.graphs.get(size) or self._capture(size)
        graph.graph.replay()
        return graph.hidden[:b]

    def _fill(self, size: int, ids: list[int], positions: list[int], spans: list[tuple[int, int, list[int]]]) -> int:
        """The step's integers into the pinned buffer (once the last step's copy out of it is done)."""
        self.copied.synchronize()
        return fill_step_words(self.words, self.max_batch, self.width, self.block_size, self.scratch, size, ids,
                               positions, spans)

    def _views(self, size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        n, w, d = self.max_batch, self.width, self.device_words
        empty = d[:0]
        group = DecodeGroup(token_index=empty, blocks=empty, pad_mask=empty.bool(),
                            block_table=d[4 * n : 4 * n + size * w].view(size, w), context_lens=d[3 * n : 3 * n + size])
        meta = AttentionMetadata(slot_mapping=d[2 * n : 2 * n + size], decodes=[group], prefills=[], all_decode=True)
        return d[:size], d[n : n + size], meta

    def _capture(self, size: int) -> _Graph:
        ids, positions, meta = self._views(size)
        forward = lambda: self.model.forward(ids, positions, self.kv_caches, meta, self.attn)  # noqa: E731
        side = torch.cuda.Stream(self.model.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compiles the kernels and settles the allocator before capture
            forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            hidden = forward()
        self.graphs[size] = _Graph(graph, hidden)
        return self.graphs[size]


def fill_step_words(words: np.ndarray, n: int, width: int, block_size: int, scratch: int, size: int,
                    ids: list[int], positions: list[int], spans: list[tuple[int, int, list[int]]]) -> int:
    """Lay a decode step out in ``words`` as the graphs read it: token ids, positions, cache slots and context
    lengths at offsets 0, n, 2n, 3n, then the block table ``[size, width]`` from 4n; rows ``len(spans)..size``
    are padding (token 0 at position 0, written to and attending over slot 0 of the ``scratch`` block).
    Returns how many words the device needs."""
    b, bs = len(spans), block_size
    words[:b] = ids
    words[n : n + b] = positions
    table = words[4 * n : 4 * n + size * width].reshape(size, width)
    lens, slots = fill_decode_table(table, spans, bs)
    words[2 * n : 2 * n + b] = slots
    words[3 * n : 3 * n + b] = lens
    words[b:size] = 0
    words[n + b : n + size] = 0
    words[2 * n + b : 2 * n + size] = scratch * bs
    words[3 * n + b : 3 * n + size] = 1
    table[b:size] = scratch
    return 4 * n + size * width
