"""Iteration-level scheduling (Orca) in tokens, decode first, with chunked prefill.

Every step the scheduler hands each running request the tokens it still has to
compute (1 for a decode, a chunk of the prompt for a prefill) within the step's
token budget, then admits waiting requests while budget, sequence slots and KV
blocks last. When blocks run out, the newest running request is preempted
(blocks freed, recomputed later); no request is ever dropped.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.block_pool import KVCacheManager
from engine.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens computed for it this step

    @property
    def samples(self) -> bool:
        """A request samples when this step reaches the end of its known tokens."""
        return self.request.num_computed_tokens + self.num_tokens == self.request.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out)
        self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput) -> int:
        decoding = [r for r in self.running if r.num_computed_tokens >= r.num_prompt_tokens]
        prefilling = [r for r in self.running if r.num_computed_tokens < r.num_prompt_tokens]
        for request in decoding + prefilling:
            budget = self.max_num_batched_tokens - out.num_tokens  # a preemption gives budget back
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._allocate_or_preempt(request, n, out):
                continue
            out.scheduled.append(ScheduledRequest(request, n))
        return self.max_num_batched_tokens - out.num_tokens

    def _allocate_or_preempt(self, request: Request, n: int, out: SchedulerOutput) -> bool:
        """Allocate for ``request``, preempting the newest others; False if it preempted itself."""
        while not self.kv.allocate_slots(request, n):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        out.scheduled = [s for s in out.scheduled if s.request is not request]
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted.append(request)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        preempted_now = {id(r) for r in out.preempted}
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if id(request) in preempted_now:
                break  # do not re-admit what this step just evicted
            remaining = request.num_tokens - request.num_computed_tokens
            n = min(remaining, budget)
            if n < remaining and not self.enable_chunked_prefill:
                break
            if not self.kv.allocate_slots(request, n):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, n))
            budget -= n

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Take a request out of every queue and give its blocks back."""
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
        self.requests.pop(request.request_id, None)

    def abort(self, request_id: str) -> bool:
        request = self.requests.get(request_id)
        if request is None:
            return False
        self.finish(request, RequestStatus.FINISHED_ABORTED)
        return True
