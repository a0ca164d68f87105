"""A step's token masks for its constrained rows, filled by llguidance and applied to the logits.

Only the rows of constrained requests are touched: an unconstrained request in the same batch samples
from exactly the logits it would have had alone. The masks are filled in parallel by llguidance's own
thread pool (``LLExecutor``), outside the GIL.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.structured.compiler import GrammarState

WORD_BITS = 32
# Per value of a mask byte, its 8 tokens' penalties: 0 where the bit is set (allowed), -inf where not.
_BYTE_PENALTY = torch.tensor([[0.0 if byte >> bit & 1 else float("-inf") for bit in range(8)] for byte in range(256)])
assert sys.byteorder == "little", "the masks are read as little-endian int32 words"


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
        self._executor = None

    @torch.inference_mode()  # the model's logits are inference tensors
    def apply(self, logits: torch.Tensor, states: list[tuple[int, GrammarState]]) -> MaskResult:
        """Mask ``logits`` [rows, vocab] in place: each ``(row, state)`` keeps only the tokens its grammar
        allows next (``-inf`` elsewhere; the allowed logits are left exactly as they were)."""
        if not states:
            return MaskResult([], {})
        masks = self._fill(states)
        dead = {row: state.error or "no token allowed" for row, state in states if state.error is not None}
        rows = torch.tensor([row for row, _ in states], dtype=torch.long, device=logits.device)
        logits.index_add_(0, rows, self._penalty(masks, logits.shape[1]).to(logits.device, logits.dtype))
        return MaskResult([row for row, _ in states], dead)

    def _penalty(self, masks: torch.Tensor, width: int) -> torch.Tensor:
        """[n, words] int32 -> [n, width] float: 0 where allowed, -inf elsewhere (tokens past the mask's words,
        of a wider lm_head, included). One table lookup per mask byte: a little-endian int32 word's byte
        ``t // 8 % 4`` holds token ``t`` at bit ``t % 8``."""
        n = masks.shape[0]
        penalty = F.embedding(masks.view(torch.uint8).long(), _BYTE_PENALTY).view(n, -1)
        if width <= penalty.shape[1]:
            return penalty[:, :width]
        return torch.cat([penalty, penalty.new_full((n, width - penalty.shape[1]), float("-inf"))], dim=1)

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

    def _executor_or_new(self):
        if self._executor is None:
            from llguidance import LLExecutor

            self._executor = LLExecutor()
        return self._executor
