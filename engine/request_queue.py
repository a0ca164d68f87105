"""The waiting queue under a scheduling policy: who is admitted next, who is preempted first.

``fcfs``: arrival order; a preempted request goes back to the front.
``priority``: lower ``priority`` value first, ties by arrival; a preempted request
goes back in at its own place, and the victim of a preemption is the running
request that would be admitted last.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from engine.config import SCHEDULING_POLICIES
from engine.request import Request


class RequestQueue:
    policy: str

    def push(self, request: Request) -> None:
        raise NotImplementedError

    def push_preempted(self, request: Request) -> None:
        raise NotImplementedError

    def peek(self) -> Request:
        raise NotImplementedError

    def pop(self) -> Request:
        raise NotImplementedError

    def remove(self, request: Request) -> bool:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def __iter__(self) -> Iterator[Request]:
        raise NotImplementedError

    def victim(self, running: list[Request]) -> Request:
        """The running request to preempt when blocks run out."""
        raise NotImplementedError


class FCFSQueue(RequestQueue):
    policy = "fcfs"

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def push(self, request: Request) -> None:
        self._q.append(request)

    def push_preempted(self, request: Request) -> None:
        self._q.appendleft(request)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, request: Request) -> bool:
        try:
            self._q.remove(request)
        except ValueError:
            return False
        return True

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)

    def victim(self, running: list[Request]) -> Request:
        return running[-1]  # the newest admitted


def _key(request: Request) -> tuple[int, int]:
    return (request.priority, request.arrival_seq)


class PriorityQueue(RequestQueue):
    policy = "priority"

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Request]] = []

    def push(self, request: Request) -> None:
        heapq.heappush(self._heap, (*_key(request), request))

    push_preempted = push

    def peek(self) -> Request:
        return self._heap[0][2]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[2]

    def remove(self, request: Request) -> bool:
        for i, entry in enumerate(self._heap):
            if entry[2] is request:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return True
        return False

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[2] for entry in sorted(self._heap, key=lambda e: e[:2]))

    def victim(self, running: list[Request]) -> Request:
        return max(running, key=_key)


def make_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {policy!r}")
