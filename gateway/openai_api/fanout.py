"""The choices of one HTTP request as ``Gateway.Generate`` calls, their messages merged in arrival order.

Choices of one prompt share its KV: the first choice goes ahead alone, and the others start once it has
its first token, when its prompt is in the prefill worker's prefix cache and on its way into the kvstore
(or in the aggregated worker's cache), so they prefill only what is not cached yet.

A slow reader never holds up anyone else: each request buffers at most ``buffer`` messages its client
has not taken yet, and past that its calls are cancelled (freeing their blocks, like a cancelled gRPC
call) and the client gets an error.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from gateway.openai_api.context import HttpCallContext
from gateway.openai_api.convert import Choice
from gateway.openai_api.core import GatewayCore
from protos import gateway_pb2 as gpb


class SlowReader(Exception):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, buffer: int) -> None:
        self.message = (f"the client fell {buffer} messages behind the stream; the request is cancelled "
                        "(read faster, or ask for fewer tokens per request)")
        super().__init__(self.message)


@dataclass(slots=True)
class Event:
    index: int
    message: gpb.GenerateResponse | None = None  # None with no error: the choice's stream ended
    error: BaseException | None = None
    retry_after: float | None = None  # the refusal's hint (gateway admission), with ``error``


class Fanout:
    def __init__(self, gateway: GatewayCore, choices: Sequence[Choice], headers: Sequence[tuple[str, str]],
                 buffer: int) -> None:
        self._gateway = gateway
        self._headers = list(headers)
        self._buffer = buffer
        self._events: collections.deque[Event] = collections.deque()
        self._ready = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._followers: dict[int, list[Choice]] = collections.defaultdict(list)
        self._choices = list(choices)
        self.pending = len(choices)  # choices whose stream has not ended

    def start(self) -> None:
        """Start each prompt's first choice; the others follow it (``close`` cancels them all)."""
        leaders = set()
        for c in self._choices:
            if c.prompt_index in leaders:
                self._followers[c.prompt_index].append(c)
            else:
                leaders.add(c.prompt_index)
                self._spawn(c)

    async def next(self, timeout: float | None = None) -> Event | None:
        """The next event; None when ``timeout`` passes without one."""
        while not self._events:
            self._ready.clear()
            try:
                await asyncio.wait_for(self._ready.wait(), timeout)
            except asyncio.TimeoutError:  # noqa: UP041 (not the builtin before Python 3.11)
                return None
        event = self._events.popleft()
        if event.error is not None or event.message is None:
            self.pending -= 1
        return event

    async def close(self) -> None:
        """Cancel what still runs and wait for it to clean up (each Generate frees its blocks and leases)."""
        for task in self._tasks:
            task.cancel()
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def _spawn(self, choice: Choice) -> None:
        task = asyncio.create_task(self._run(choice), name=f"http-choice-{choice.request.request_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, choice: Choice) -> None:
        context = HttpCallContext(self._headers)
        try:
            async with contextlib.aclosing(self._gateway.Generate(choice.request, context)) as stream:
                async for msg in stream:
                    self._put(Event(choice.index, msg))
                    if choice.prompt_index in self._followers:  # the first message of a prompt's first choice
                        self._release_followers(choice.prompt_index)
            self._put(Event(choice.index))
        except Exception as exc:  # the client gets it as its error; Generate has recorded and counted it
            self._put(Event(choice.index, error=exc, retry_after=context.retry_after), urgent=True)
            self._followers.pop(choice.prompt_index, None)  # the request has failed: they never start

    def _release_followers(self, prompt_index: int) -> None:
        for c in self._followers.pop(prompt_index, ()):
            self._spawn(c)

    def _put(self, event: Event, urgent: bool = False) -> None:
        if urgent:
            self._events.appendleft(event)
        elif len(self._events) >= self._buffer:
            raise SlowReader(self._buffer)
        else:
            self._events.append(event)
        self._ready.set()
