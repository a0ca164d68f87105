"""An asyncio front for the engine: the step loop runs in its own thread and never
blocks the event loop; each request is an async iterator of outputs."""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import dataclass, field

from engine.engine import Engine
from engine.errors import EngineDeadError
from engine.request import RequestHandedBack, RequestOptions, RequestOutput
from engine.sampling_params import SamplingParams
from engine.stats import EngineLoad


@dataclass(slots=True)
class _Add:
    prompt: list[int]
    params: SamplingParams
    request_id: str
    options: RequestOptions | None
    sink: asyncio.Queue
    loop: asyncio.AbstractEventLoop


@dataclass(slots=True)
class _Abort:
    request_id: str
    done: Future = field(default_factory=Future)
    hand_back: bool = False  # tell the caller (RequestHandedBack) instead of going silent


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._inbox: queue.Queue[_Add | _Abort | None] = queue.Queue()
        self._sinks: dict[str, tuple[asyncio.Queue, asyncio.AbstractEventLoop]] = {}
        # Replaced whole by the engine thread after every change, read by anyone: never half-updated.
        self.load: EngineLoad = engine.load_snapshot()
        self.num_compiling = 0  # requests waiting for their structured-output grammar to compile
        self.dead: str | None = None  # why the engine cannot step any more (a tensor-parallel rank died)
        engine.on_dead(self._died)
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def generate(
        self, prompt: list[int], params: SamplingParams, request_id: str, options: RequestOptions | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream outputs; a ValueError from validation (``Engine.add_request``, or a structured-output
        constraint that does not compile) is raised here; cancelling aborts."""
        if params.structured is not None and (options is None or options.grammar is None):
            options = await self._compiled(params, options)
        loop = asyncio.get_running_loop()
        sink: asyncio.Queue = asyncio.Queue()
        self._inbox.put(_Add(prompt, params, request_id, options, sink, loop))
        finished = False
        try:
            while True:
                item = await sink.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    async def _compiled(self, params: SamplingParams, options: RequestOptions | None) -> RequestOptions:
        """``options`` with the request's grammar, compiled on the compiler's pool while the engine thread
        keeps stepping the others: the request enters the engine only once it can be constrained."""
        grammars, spec = self.engine.grammars, params.structured
        self.num_compiling += 1
        try:
            compiled = await asyncio.wait_for(asyncio.wrap_future(grammars.submit(spec)), grammars.compile_timeout_s)
        except asyncio.TimeoutError:
            raise ValueError(grammars.timeout_message(spec)) from None
        finally:
            self.num_compiling -= 1
        return dataclasses.replace(options or RequestOptions(), grammar=compiled)

    def abort(self, request_id: str) -> Future:
        """Queue an abort; the future completes once the engine thread has applied it, i.e. after
        any step that was running (and everything that step did for the request, such as KV saves)."""
        item = _Abort(request_id)
        self._inbox.put(item)
        return item.done

    def hand_back(self, request_id: str) -> Future:
        """Abort a running request and raise ``RequestHandedBack`` in its ``generate`` (after the
        outputs already produced), so that its caller can continue it elsewhere."""
        item = _Abort(request_id, hand_back=True)
        self._inbox.put(item)
        return item.done

    def shutdown(self) -> None:
        self._inbox.put(None)
        self._thread.join(timeout=10)
        self.engine.close()

    def _died(self, why: str) -> None:
        self.dead = why

    def _run(self) -> None:
        while True:
            block = not self.engine.has_unfinished()
            if block:  # idle now: show it before waiting (a busy loop publishes once a step, below)
                self.load = self.engine.load_snapshot()
            if not self._drain_inbox(block):  # requests waiting only for KV loads: the step waits for them
                return
            self.load = self.engine.load_snapshot()  # with what the inbox added or aborted: admission reads it
            if not self.engine.has_unfinished():
                continue
            try:
                outputs = self.engine.step()
            except EngineDeadError as exc:  # UNAVAILABLE: the gateway moves them to another worker
                self._fail_all(exc)
                continue
            except Exception as exc:  # a bug in a step fails its requests instead of hanging them
                self._fail_all(RuntimeError(f"engine step failed: {exc!r}"))
                continue
            for out in outputs:
                self._deliver(out)

    def _fail_all(self, exc: Exception) -> None:
        for request_id in list(self._sinks):
            self.engine.abort(request_id)
            sink, loop = self._sinks.pop(request_id)
            _send(sink, loop, exc)

    def _drain_inbox(self, block: bool) -> bool:
        """Apply queued adds and aborts; False when asked to stop."""
        try:
            item = self._inbox.get(block=block)
        except queue.Empty:
            return True
        while True:
            if item is None:
                return False
            self._apply(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, item: _Add | _Abort) -> None:
        if isinstance(item, _Abort):
            known = self.engine.abort(item.request_id)
            target = self._sinks.pop(item.request_id, None)
            if item.hand_back and known and target is not None:
                _send(*target, RequestHandedBack(item.request_id))
            item.done.set_result(None)
            return
        if self.dead is not None:
            _send(item.sink, item.loop, EngineDeadError(self.dead))
            return
        try:
            self.engine.add_request(item.prompt, item.params, item.request_id, item.options)
        except (ValueError, TypeError) as exc:
            _send(item.sink, item.loop, exc)
            return
        self._sinks[item.request_id] = (item.sink, item.loop)

    def _deliver(self, item: RequestOutput) -> None:
        rid = item.request_id
        target = self._sinks.pop(rid, None) if item.finished else self._sinks.get(rid)
        if target is not None and not _send(*target, item) and not item.finished:
            self._sinks.pop(rid, None)  # the caller's event loop is gone: nobody is listening
            self.engine.abort(rid)


def _send(sink: asyncio.Queue, loop: asyncio.AbstractEventLoop, item: object) -> bool:
    """Hand an item to a caller's event loop; False if that loop has closed."""
    try:
        loop.call_soon_threadsafe(sink.put_nowait, item)
    except RuntimeError:
        return False
    return True
