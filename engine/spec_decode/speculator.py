"""The engine's side of speculative decoding: drafts for the step's decodes, and what their verification did.

After the scheduler has planned a step, ``expand`` asks the proposer for a draft for each decode that may
speculate and gives it room: its KV slots, its tokens in the step. The target then computes the last token
and the draft in one pass (several query tokens per sequence, as a chunk of prefill), and ``Sampler.verify``
keeps the agreed prefix. Rejected tokens' slots are given back (``KVCacheManager.trim``); their KV was
written past the request's computed tokens, so nothing reads or registers it.
"""

from __future__ import annotations

from typing import Protocol

from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.scheduler import ScheduledRequest, SchedulerOutput
from engine.spec_decode.control import SpecState, SpecStats


class Proposer(Protocol):
    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[list[int]]:
        """Up to ``num_tokens[i]`` guesses of what follows ``requests[i]``'s tokens (fewer, or none, is fine)."""

    def release(self, request: Request) -> None:
        """The request is gone (finished, aborted, preempted): drop what is kept for it."""


class Speculator:
    def __init__(self, proposer: Proposer, num_tokens: int, max_batch: int, min_acceptance: float) -> None:
        self.proposer = proposer
        self.num_tokens = num_tokens
        self.max_batch = max_batch
        self.min_acceptance = min_acceptance
        self.stats = SpecStats()

    def expand(self, sched: SchedulerOutput, kv: KVCacheManager, token_budget: int, max_model_len: int) -> None:
        """Give the step's eligible decodes a draft each, where the token budget and free blocks allow."""
        decodes = [s for s in sched.scheduled if s.samples and s.num_tokens == 1]
        if not decodes or len(decodes) > self.max_batch:
            return
        chosen = [(s, k) for s in decodes if (k := self._draft_len(s.request, max_model_len)) > 0]
        if not chosen:
            return
        drafts = self.proposer.propose([s.request for s, _ in chosen], [k for _, k in chosen])
        for (s, _), draft in zip(chosen, drafts, strict=True):
            if not draft or sched.num_tokens + len(draft) > token_budget:
                continue
            if not kv.allocate_slots(s.request, 1 + len(draft)):
                continue  # no room: this step decodes one token, as without speculation
            s.draft = list(draft)
            s.num_tokens += len(draft)
            sched.num_tokens += len(draft)

    def _draft_len(self, r: Request, max_model_len: int) -> int:
        """How many tokens to propose for ``r`` now: 0 when it may not speculate or is pausing."""
        p = r.params
        if not p.speculative or p.has_penalties or r.grammar is not None:
            return 0
        if r.num_computed_tokens != r.num_tokens - 1:
            return 0
        if r.spec is None:
            r.spec = SpecState()
        if not r.spec.ready():
            return 0
        room = min(p.max_tokens - len(r.output_token_ids), max_model_len - r.num_tokens) - 1
        return max(0, min(r.spec.draft_len(self.num_tokens), room))

    def record(self, s: ScheduledRequest, emitted: int) -> None:
        """``emitted`` tokens came out of ``s``'s verification: all but the last were drafted and accepted."""
        drafted, accepted = len(s.draft), emitted - 1
        s.request.spec.record(drafted, accepted, self.min_acceptance)
        self.stats.record(drafted, accepted)

    def release(self, request: Request) -> None:
        self.proposer.release(request)
