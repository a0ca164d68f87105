"""What one forward pass needs from the scheduler, flattened: the token stream, its positions, the
attention spans and the rows that are sampled.

Flat lists of ints on purpose: tensor-parallel rank 0 broadcasts them as one int64 message per step
(``pack``) and the other ranks rebuild the same inputs (``unpack``); sampling rows stay on rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.scheduler import SchedulerOutput

Span = tuple[int, int, list[int]]  # (first position, tokens, the request's block table)


@dataclass(slots=True)
class StepInputs:
    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, sched: SchedulerOutput) -> StepInputs:
        """The step's inputs: a request with a speculative draft gets one span per verified token (each
        attends like a decode of its own length, so one batched kernel call serves them) and samples
        ``1 + len(draft)`` rows; any other sampling request samples its last row."""
        inputs = cls()
        offset = 0
        for s in sched.scheduled:
            r, start = s.request, s.request.num_computed_tokens
            inputs.ids.extend(r.token_ids(start, start + s.num_tokens - len(s.draft)))
            inputs.ids.extend(s.draft)
            inputs.positions.extend(range(start, start + s.num_tokens))
            if s.draft:
                inputs.spans.extend((start + i, 1, r.block_ids) for i in range(s.num_tokens))
            else:
                inputs.spans.append((start, s.num_tokens, r.block_ids))
            offset += s.num_tokens
            if s.samples:
                inputs.sample_rows.extend(range(offset - 1 - len(s.draft), offset))
        return inputs

    def pack(self) -> list[int]:
        """``[T, ids.., positions.., S, (start, n, num_blocks, blocks..) * S]``: no sample rows."""
        words = [len(self.ids), *self.ids, *self.positions, len(self.spans)]
        for start, n, blocks in self.spans:
            words += (start, n, len(blocks), *blocks)
        return words

    @classmethod
    def unpack(cls, words: list[int]) -> StepInputs:
        t = words[0]
        ids, positions = words[1 : 1 + t], words[1 + t : 1 + 2 * t]
        at = 1 + 2 * t
        spans: list[Span] = []
        for _ in range(words[at]):
            start, n, nb = words[at + 1 : at + 4]
            spans.append((start, n, words[at + 4 : at + 4 + nb]))
            at += 3 + nb
        return cls(ids, positions, spans)
