"""A step's token masks for its constrained rows, filled by llguidance and applied to the logits.

Only the rows of constrained requests are touched: an unconstrained request in the same batch samples
from exactly the logits it would have had alone. The masks are filled in parallel by llguidance's own
thread pool (``LLExecutor``), outside the GIL.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.structured.compiler import GrammarState

WORD_BITS = 32


@dataclass(slots=True)
class MaskResult:
    """Which constrained rows can go on; ``dead`` maps a row to why its grammar allows no token."""

    rows: list[int]
    dead: dict[int, str]


class GrammarBitmask:
    """Reusable mask storage for one vocabulary (int32 words, one bit per token, as llguidance writes)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + WORD_BITS - 1) // WORD_BITS
        self._masks = torch.zeros((0, self.words), dtype=torch.int32)
        self._shifts = torch.arange(WORD_BITS, dtype=torch.int32)
        self._executor = None

    @torch.inference_mode()  # the model's logits are inference tensors
    def apply(self, logits: torch.Tensor, states: list[tuple[int, GrammarState]]) -> MaskResult:
        """Mask ``logits`` [rows, vocab] in place: each ``(row, state)`` keeps only the tokens its grammar
        allows next (``-inf`` elsewhere)."""
        if not states:
            return MaskResult([], {})
        masks = self._fill(states)
        dead = {row: state.error or "no token allowed" for row, state in states if state.error is not None}
        allowed = self._unpack(masks, logits.shape[1])
        rows = torch.tensor([row for row, _ in states], dtype=torch.long)
        constrained = logits.index_select(0, rows.to(logits.device))
        constrained.masked_fill_(~allowed.to(logits.device), float("-inf"))
        logits.index_copy_(0, rows.to(logits.device), constrained)
        return MaskResult([row for row, _ in states], dead)

    def _fill(self, states: list[tuple[int, GrammarState]]) -> torch.Tensor:
        n = len(states)
        if self._masks.shape[0] < n:
            self._masks = torch.zeros((max(n, 2 * self._masks.shape[0]), self.words), dtype=torch.int32)
        masks = self._masks[:n]
        row_bytes = self.words * 4
        if n == 1:
            states[0][1].fill_mask(masks.data_ptr(), row_bytes)
        else:
            pairs = [(state.matcher, i) for i, (_, state) in enumerate(states)]
            self._executor_or_new().unsafe_compute_mask_ptr(pairs, masks.data_ptr(), row_bytes, n)
        return masks

    def _unpack(self, masks: torch.Tensor, width: int) -> torch.Tensor:
        """[n, words] int32 -> [n, width] bool; tokens past the mask's words (a wider lm_head) are banned."""
        bits = (masks.unsqueeze(-1) >> self._shifts) & 1
        allowed = bits.view(masks.shape[0], -1).bool()
        if width <= allowed.shape[1]:
            return allowed[:, :width]
        pad = torch.zeros((masks.shape[0], width - allowed.shape[1]), dtype=torch.bool)
        return torch.cat([allowed, pad], dim=1)

    def _executor_or_new(self):
        if self._executor is None:
            from llguidance import LLExecutor

            self._executor = LLExecutor()
        return self._executor
