"""Iteration-level scheduling (Orca) in tokens, decode first, with chunked prefill.

Every step the scheduler hands each running request the tokens it still has to
compute (1 for a decode, a chunk of the prompt for a prefill) within the step's
token budget, then admits waiting requests, in the order of the policy, while
budget, sequence slots and KV blocks last. An admitted request starts after the
longest prefix the cache holds. When blocks run out, the running request the
policy ranks last is preempted (blocks freed, recomputed later); no request is
ever dropped.

A request whose leading KV comes from outside (consumer role) is admitted into
``loading`` with blocks for that KV; it joins ``running`` once the engine has
loaded them (``finish_load``).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from engine.kv_cache_manager import KVCacheManager, cdiv
from engine.request import Request, RequestStatus
from engine.request_queue import make_queue


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens computed for it this step (its draft included)
    samples: bool  # the step reaches the end of its known tokens, so it samples the next one
    draft: list[int] = field(default_factory=list)  # speculative decoding: proposed tokens after its last one


@dataclass(slots=True)
class KVLoad:
    """Blocks ``first_block ...`` of ``request.block_ids`` to fill from outside, ``num_blocks`` of them."""

    request: Request
    first_block: int
    num_blocks: int


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    loads: list[KVLoad] = field(default_factory=list)
    num_tokens: int = 0

    def add(self, request: Request, num_tokens: int) -> None:
        samples = request.num_computed_tokens + num_tokens == request.num_tokens
        self.scheduled.append(ScheduledRequest(request, num_tokens, samples))
        self.num_tokens += num_tokens

    def drop(self, request: Request) -> None:
        kept = [s for s in self.scheduled if s.request is not request]
        if len(kept) != len(self.scheduled):
            self.scheduled = kept
            self.num_tokens = sum(s.num_tokens for s in kept)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        policy: str = "fcfs",
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting = make_queue(policy)
        self.running: list[Request] = []
        self.loading: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._seq = itertools.count()

    @property
    def policy(self) -> str:
        return self.waiting.policy

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        request.arrival_seq = next(self._seq)
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._schedule_running(out)
        self._schedule_waiting(out)
        return out

    def _schedule_running(self, out: SchedulerOutput) -> None:
        # The hot loop of every step: with hundreds of decodes it must stay well under a millisecond,
        # so a decode whose next token fits in its last block skips the block manager altogether.
        decoding, prefilling = [], []
        for r in self.running:
            (decoding if r.num_computed_tokens >= len(r.prompt_token_ids) else prefilling).append(r)
        if self.policy == "priority":
            decoding.sort(key=lambda r: (r.priority, r.arrival_seq))
            prefilling.sort(key=lambda r: (r.priority, r.arrival_seq))
        bs, limit, running = self.kv.block_size, self.max_num_batched_tokens, RequestStatus.RUNNING
        for request in decoding:
            if out.num_tokens == limit:
                return
            if request.status is not running:
                continue  # preempted earlier in this loop
            computed = request.num_computed_tokens
            n = len(request.prompt_token_ids) + len(request.output_token_ids) - computed  # 1 but after a handoff
            if n == 1 and computed < len(request.block_ids) * bs:
                out.scheduled.append(ScheduledRequest(request, 1, True))
                out.num_tokens += 1
                continue
            n = min(n, limit - out.num_tokens)
            if self._allocate_or_preempt(request, n, out):
                out.add(request, n)
        for request in prefilling:
            budget = limit - out.num_tokens  # a preemption gives budget back
            if budget == 0:
                return
            if request.status is not RequestStatus.RUNNING:
                continue
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if self._allocate_or_preempt(request, n, out):
                out.add(request, n)

    def _allocate_or_preempt(self, request: Request, n: int, out: SchedulerOutput) -> bool:
        """Allocate for ``request``, preempting others as the policy ranks them; False if it preempted itself."""
        while not self.kv.allocate_slots(request, n):
            victim = self.waiting.victim(self.running)
            self._preempt(victim, out)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        out.drop(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_external_tokens = 0  # resumed by recomputation
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_preempted(request)
        out.preempted.append(request)

    def _schedule_waiting(self, out: SchedulerOutput) -> None:
        while self.waiting and len(self.running) + len(self.loading) < self.max_num_seqs:
            request = self.waiting.peek()
            if any(request is p for p in out.preempted):
                break  # do not re-admit what this step just evicted
            if request.num_external_tokens:
                if not self._admit_load(request, out):
                    break
                continue
            n = self._admit_compute(request, out)
            if n == 0:
                break
            out.add(request, n)

    def _admit_compute(self, request: Request, out: SchedulerOutput) -> int:
        """Admit into ``running`` after the cached prefix; the tokens scheduled, 0 if it must wait.

        Under the priority policy a request that does not fit preempts running
        requests of lower priority (higher value) until it does.
        """
        reusable = request.num_tokens - 1  # at least one token is computed, to sample from
        while True:
            budget = self.max_num_batched_tokens - out.num_tokens
            remaining = request.num_tokens - self.kv.cached_prefix_tokens(request, reusable)
            n = min(remaining, budget)
            if n == 0 or (n < remaining and not self.enable_chunked_prefill):
                return 0
            if self.kv.admit(request, n, reusable):
                break
            if not self._preempt_lower_priority(request, out):
                return 0
        self.waiting.pop()
        request.status = RequestStatus.RUNNING
        if request.scheduled_time is None:
            request.scheduled_time = time.monotonic()
        self.running.append(request)
        return n

    def _preempt_lower_priority(self, request: Request, out: SchedulerOutput) -> bool:
        if self.policy != "priority" or not self.running:
            return False
        victim = self.waiting.victim(self.running)
        if (victim.priority, victim.arrival_seq) <= (request.priority, request.arrival_seq):
            return False
        self._preempt(victim, out)
        return True

    def _admit_load(self, request: Request, out: SchedulerOutput) -> bool:
        """Admit into ``loading``: blocks for the external KV, minus what the local cache holds."""
        external = request.num_external_tokens
        cached = self.kv.cached_prefix_tokens(request, external)
        if not self.kv.admit(request, external - cached, external):
            return False
        self.waiting.pop()
        if request.scheduled_time is None:
            request.scheduled_time = time.monotonic()
        first = request.num_computed_tokens // self.kv.block_size
        num_blocks = cdiv(external, self.kv.block_size) - first
        if num_blocks == 0:
            self.finish_load(request)  # all of it was cached here already
            return True
        request.status = RequestStatus.WAITING_FOR_KV
        self.loading.append(request)
        out.loads.append(KVLoad(request, first, num_blocks))
        return True

    def finish_load(self, request: Request) -> None:
        """The request's external KV is in its blocks: it computes from there on."""
        if request.status is RequestStatus.WAITING_FOR_KV:
            self.loading.remove(request)
        if request.loaded_time is None:
            request.loaded_time = time.monotonic()
        request.num_computed_tokens = request.num_external_tokens
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def requeue_for_recompute(self, request: Request) -> None:
        """Its KV could not be loaded: it gives its blocks back and computes everything itself."""
        self.loading.remove(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_external_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.push_preempted(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Take a request out of every queue and give its blocks back."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING_FOR_KV:
            self.loading.remove(request)
        elif not request.status.finished:
            self.waiting.remove(request)
        request.status = status
        self.kv.free(request)
        self.requests.pop(request.request_id, None)

    def abort(self, request_id: str) -> bool:
        request = self.requests.get(request_id)
        if request is None:
            return False
        self.finish(request, RequestStatus.FINISHED_ABORTED)
        return True
