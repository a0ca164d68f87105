"""The integers a CUDA-graph decode step reads (engine.cuda_graphs.fill_step_words), checked without a GPU
against the eager path's metadata: the same cache slots and context lengths, the block tables, and padding
rows that touch only the scratch block."""

from __future__ import annotations

import numpy as np
import torch

from engine.attention import build_metadata
from engine.cuda_graphs import fill_step_words

N, WIDTH, BS, SCRATCH = 8, 6, 16, 99


def _step(lengths: list[int], first_block: int = 0):
    spans, ids, positions, block = [], [], [], first_block
    for i, n in enumerate(lengths):
        blocks = list(range(block, block + -(-n // BS)))
        block += len(blocks)
        spans.append((n - 1, 1, blocks[::-1]))  # tables need not be in order
        ids.append(1000 + i)
        positions.append(n - 1)
    return ids, positions, spans


def test_a_padded_step_reads_what_the_eager_step_reads():
    ids, positions, spans = _step([1, 17, 40, 96])
    words = np.full(4 * N + N * WIDTH, -7, dtype=np.int64)  # stale values from an earlier step
    used = fill_step_words(words, N, WIDTH, BS, SCRATCH, 8, ids, positions, spans)
    assert used == 4 * N + 8 * WIDTH
    eager = build_metadata(spans, BS, torch.device("cpu"), group_by_len=False)
    b = len(spans)
    assert words[:b].tolist() == ids and words[N : N + b].tolist() == positions
    assert words[2 * N : 2 * N + b].tolist() == eager.slot_mapping.tolist()
    assert words[3 * N : 3 * N + b].tolist() == eager.decodes[0].context_lens.tolist()
    table = words[4 * N : used].reshape(8, WIDTH)
    for row, (_, _, blocks) in enumerate(spans):
        assert table[row, : len(blocks)].tolist() == blocks
    # padding rows: token 0 at position 0, slot 0 of the scratch block, one token of context, scratch tables
    assert words[b:8].tolist() == [0] * 4 and words[N + b : N + 8].tolist() == [0] * 4
    assert words[2 * N + b : 2 * N + 8].tolist() == [SCRATCH * BS] * 4
    assert words[3 * N + b : 3 * N + 8].tolist() == [1] * 4
    assert (table[b:] == SCRATCH).all()


def test_a_shorter_step_after_a_longer_one_leaves_no_stale_row_in_use():
    words = np.zeros(4 * N + N * WIDTH, dtype=np.int64)
    fill_step_words(words, N, WIDTH, BS, SCRATCH, 8, *_step([90, 90, 90, 90, 90, 90, 90, 90]))
    ids, positions, spans = _step([3, 33], first_block=50)
    used = fill_step_words(words, N, WIDTH, BS, SCRATCH, 2, ids, positions, spans)
    table = words[4 * N : used].reshape(2, WIDTH)
    assert table[0, :1].tolist() == [50] and table[1, :3].tolist() == [53, 52, 51]
    assert words[2 * N : 2 * N + 2].tolist() == [50 * BS + 2, 51 * BS]  # position 32: the table's third block
