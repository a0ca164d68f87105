"""Who speculates this step, and how far: speculation must never make a workload much slower.

A verification pass costs about one decode step when decode is bound by reading the weights; it stops
paying when the batch is large enough to be bound by compute, or when a request's guesses keep being
wrong. So: no speculation above ``max_batch`` running decodes, and each request keeps a running rate of
accepted guesses, which sets how far it guesses; below ``min_acceptance`` it pauses for a while (doubling
while it keeps failing) and then probes with one token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

EMA = 0.5  # weight of the newest verification in a request's acceptance rate
FIRST_PAUSE = 8  # steps a request sits out after its rate falls too low; doubles each time, up to MAX_PAUSE
MAX_PAUSE = 256
RECOVERED = 0.5  # a rate back above this ends the doubling of pauses, and drafts are full length again


@dataclass(slots=True)
class SpecState:
    """One request's speculation so far.

    The draft length follows the acceptance rate (full at ``RECOVERED`` and above, shorter below), so that
    a guess that is likely wrong costs little. Below ``min_acceptance`` the request pauses; after the
    pause a single-token probe decides: accepted, it speculates again; rejected, it pauses twice as long.
    """

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verifications: int = 0
    rate: float = 1.0  # running fraction of its guesses the target accepted
    pause: int = 0  # steps left to sit out
    next_pause: int = FIRST_PAUSE
    probing: bool = False  # the next draft is a single-token probe after a pause

    def record(self, drafted: int, accepted: int, min_acceptance: float) -> None:
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        self.num_verifications += 1
        self.probing = False
        self.rate = (1 - EMA) * self.rate + EMA * (accepted / drafted)
        if self.rate < min_acceptance:
            self.pause, self.next_pause = self.next_pause, min(2 * self.next_pause, MAX_PAUSE)
            self.rate, self.probing = min_acceptance, True
        elif self.rate >= RECOVERED:
            self.next_pause = FIRST_PAUSE

    def ready(self) -> bool:
        """Whether it may speculate this step (a paused request counts its pause down)."""
        if self.pause:
            self.pause -= 1
            return False
        return True

    def draft_len(self, most: int) -> int:
        """How many tokens to propose: ``most`` while guesses are mostly right, fewer as they go wrong."""
        if self.probing:
            return 1
        if self.rate >= RECOVERED:
            return most
        return max(1, min(most, round(2 * most * self.rate)))


@dataclass(slots=True)
class SpecStats:
    """What an engine's speculation did, for metrics (vLLM's names: num_draft_tokens, num_accepted_tokens, and
    the acceptances per position)."""

    num_drafts: int = 0  # verifications with at least one proposed token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_position) < drafted:
            self.accepted_per_position.extend([0] * (drafted - len(self.accepted_per_position)))
        for i in range(accepted):
            self.accepted_per_position[i] += 1
