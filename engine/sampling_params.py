"""Per-request sampling parameters, validated where they enter the engine."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.structured.spec import StructuredOutput


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token of one request (the vLLM parameter set)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1  # -1: all tokens
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the chosen token only; n: chosen + top-n
    structured: StructuredOutput | None = None  # sample only what this schema / regex / choice / grammar allows
    speculative: bool = True  # False: never speculate for this request (whatever the engine's setting)

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0 <= self.temperature < math.inf:  # NaN fails every comparison
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1 or self.top_k == 0:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative token ids")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError("structured must be a StructuredOutput")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def needs_filtering(self) -> bool:
        return self.top_k != -1 or self.top_p < 1 or self.min_p > 0
