"""N-gram prompt lookup: propose what followed the last time the sequence's recent tokens appeared.

Input-grounded answers (summaries, edits, extraction, code changes) copy spans of their prompt; the
longest suffix of the sequence that occurred before is the best guess of what comes next, and finding
it costs microseconds. No extra model, no extra memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.request import Request


class NgramProposer:
    """vLLM's ``prompt_lookup_min`` / ``prompt_lookup_max``: suffixes of ``max_n`` down to ``min_n`` tokens are
    looked for, longest first; the most recent earlier occurrence wins."""

    def __init__(self, min_n: int = 2, max_n: int = 5) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt lookup needs 1 <= min <= max, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]:
        return [self.lookup(r.all_token_ids(), k) if k > 0 else [] for r, k in zip(requests, num_tokens, strict=True)]

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest matching suffix."""
        length = len(tokens)
        if length <= self.min_n:
            return []
        seq = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = _last_occurrence(seq, n)
            if start >= 0:
                return seq[start + n : start + n + k].tolist()
        return []

    def release(self, request: Request) -> None:
        """Nothing is kept per request."""


def _last_occurrence(seq: np.ndarray, n: int) -> int:
    """Where the last ``n`` tokens occurred before (and not overlapping their own end), latest first; -1 if not."""
    suffix = seq[-n:]
    windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)  # windows ending before the last token
    hits = np.flatnonzero((windows == suffix).all(axis=1))
    return int(hits[-1]) if hits.size else -1
