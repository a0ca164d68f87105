"""An engine's KV connector backed by a kvstore node: pushes and pulls run beside the step loop.

The engine calls the connector from its own thread between steps (see
``engine.kv_transfer``); transfers run on a private asyncio loop in a background
thread, so a push of one chunk's blocks overlaps the next chunk's compute, and a
pull completes while the engine keeps stepping the other requests.

Each transfer is a ``kv.push`` or ``kv.pull`` span in the trace of its request
(the context the worker registered with ``trace``), with the blocks, bytes and
GB/s of the UCX hop as attributes; the store's own spans hang under it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from common import telemetry
from common.metrics import transfer_metrics
from engine.config import EngineConfig
from engine.kv_blocks import BlockRef, PartialRef, wire_block_shape
from engine.kv_staging import Staged, StagingPool
from engine.kv_transfer import KVConnector, LoadResult, RankSlice, block_ref
from engine.request import Request
from kvstore.client import KVStoreClient
from kvstore.rank_slices import RankSlices

log = logging.getLogger("tandem.kvstore.connector")


class KVStoreConnector(KVConnector):
    """Both sides of the seam: ``KVConnector`` for the engine, ``KVConnectorWorkerSide`` for the worker.

    At tensor-parallel degree > 1 every rank moves its own heads of each block (``use_ranks``).
    """

    rank_agent = "kvstore.rank_agent:start"

    def __init__(self, address: str, config: EngineConfig) -> None:
        self.block_shape = wire_block_shape(config.model_config, config.block_size)
        self.heads = config.model_config.num_kv_heads  # every block is committed with a checksum per head
        self.ranks: RankSlices | None = None
        self.dtype = config.torch_dtype
        self._in_flight: set[Future] = set()  # every task run on the loop, held until done (see ``_call``)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kv-connector", daemon=True)
        self._thread.start()
        self.client: KVStoreClient = self._call(self._make_client(address)).result()
        try:
            self._call(self.client.connect()).result(timeout=15)
        except Exception as exc:  # the store is not up yet: the first transfer connects instead
            log.warning("could not open the data plane to %s yet: %s", address, exc)
        self._lock = threading.Lock()
        self._done: list[LoadResult] = []
        self._saves: dict[Future, tuple[str, int]] = {}  # push -> (request id, blocks)
        self._releases: dict[Future, Callable[[], None]] = {}  # push -> gives its staging rows back
        self.staging: StagingPool | None = None
        self._failed_blocks: dict[str, int] = {}  # per request not yet collected by ``wait_saved``
        self._pulls = 0
        self._pull_numbers = itertools.count()
        self._pulling: dict[int, str] = {}  # pulls in flight: number -> request id
        self._gone: set[int] = set()  # pulls in flight whose request has ended
        self._traces: dict[str, Any] = {}  # request id -> the trace context of its transfers
        self._touched: set[str] = set()  # requests whose partial blocks this side pulled
        self.failed_saves = 0
        self.metrics = transfer_metrics()

    async def _make_client(self, address: str) -> KVStoreClient:
        return KVStoreClient(address)  # its gRPC channel belongs to this loop

    def _call(self, coro) -> Future:
        """Run ``coro`` on the connector's loop. The future is kept until done: a loop holds its tasks only
        weakly, and a task awaiting something only weakly held itself (a Unix-socket read, whose reader its
        protocol keeps by weak reference) is a garbage cycle, collected mid-await unless someone holds it."""
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        self._in_flight.add(fut)
        fut.add_done_callback(self._in_flight.discard)
        return fut

    def trace(self, request_id: str, ctx: Any | None) -> None:
        """The trace context of a request's transfers (None: forget it)."""
        with self._lock:
            if ctx is None:
                self._traces.pop(request_id, None)
            else:
                self._traces[request_id] = ctx

    def _trace_of(self, request_id: str) -> Any:
        with self._lock:
            return self._traces.get(request_id)

    def use_staging(self, pool: StagingPool) -> None:
        self.staging = pool

    def use_ranks(self, slices: list[RankSlice]) -> None:
        """Pushes from and pulls into the staging pool go rank by rank from now on (each its own heads,
        over its own endpoint); a transfer that does not fit the pool still moves whole blocks here."""
        if self.staging is None or len(slices) < 2:
            return
        self.ranks = RankSlices(self.client.data, self.staging, slices, self.heads, self.client.mappings)
        if self.client.last_data_address:
            try:
                self._call(self.ranks.connect(self.client.last_data_address)).result(15)
            except Exception as exc:  # the first transfer connects instead
                log.warning("the ranks could not open the data plane to the store yet: %s", exc)

    def save_blocks(self, request: Request, first_block: int, refs: list[BlockRef], data: torch.Tensor,
                    release: Callable[[], None] | None = None, ready: Callable[[], None] | None = None) -> None:
        row = self.staging.row_of(data) if self.ranks is not None and release is not None else None
        ctx = self._trace_of(request.request_id)
        if row is not None:  # the ranks wrote their heads into these rows: each sends its own
            fut = self._call(self._push_slices(refs, list(range(row, row + len(refs))), first_block, ctx))
        else:
            blocks = [(ref, _as_bytes(data[i])) for i, ref in enumerate(refs)]
            fut = self._call(self._push(blocks, first_block, ctx, ready))
        with self._lock:
            self._saves[fut] = (request.request_id, len(refs))
            if release is not None:
                self._releases[fut] = release
        fut.add_done_callback(self._saved)

    async def _push(self, blocks: list[tuple[BlockRef, np.ndarray]], first_block: int, ctx: Any,
                    ready: Callable[[], None] | None = None) -> int:
        if ready is not None:  # the GPU's copy into these rows, waited for off both the engine and this loop
            await asyncio.to_thread(ready)
        nbytes = sum(b.nbytes for _, b in blocks)
        return await self._traced_push(len(blocks), nbytes, first_block, ctx, "ucx", {},
                                       lambda md: self.client.push(blocks, metadata=md, heads=self.heads))

    async def _push_slices(self, refs: list, rows: list[int], first_block: int, ctx: Any) -> int:
        return await self._traced_push(len(rows), len(rows) * self.ranks.block_bytes, first_block, ctx, "ucx-ranks",
                                       {"tandem.kv.ranks": len(self.ranks.owners)},
                                       lambda md: self.client.push_slices(refs, rows, self.ranks, metadata=md))

    async def _traced_push(self, n: int, nbytes: int, first_block: int, ctx: Any, transport: str,
                           attributes: dict[str, Any], send: Callable[[Any], Awaitable[int]]) -> int:
        """``send(metadata)`` as a ``kv.push`` span of its request's trace (blocks, bytes, GB/s), and in the
        transfer metrics; how many blocks were new to the store."""
        with telemetry.span("kv.push", ctx, attributes={"tandem.kv.blocks": n, "tandem.kv.bytes": nbytes,
                                                         "tandem.kv.first_block": first_block, **attributes}) as span:
            start = time.perf_counter()
            committed = await send(telemetry.outgoing(telemetry.context_of(span)))
            seconds = time.perf_counter() - start
            span.set_attributes(_transfer_attributes(nbytes, seconds, self.client.last_data_address, transport))
            span.set_attribute("tandem.kv.committed", committed)
        self.metrics.observe("push", n, nbytes, seconds)
        return committed

    def _saved(self, fut: Future) -> None:
        with self._lock:
            release = self._releases.pop(fut, None)
            request_id, n = self._saves.pop(fut)
            if fut.exception() is not None:  # the decode side will miss these blocks and recompute
                self.failed_saves += 1
                self._failed_blocks[request_id] = self._failed_blocks.get(request_id, 0) + n
        if release is not None:  # the bytes have left (or never will): the rows are free again
            release()
        if fut.exception() is not None:
            log.warning("KV push failed: %s", fut.exception())

    @property
    def num_pending_saves(self) -> int:
        with self._lock:
            return len(self._saves)

    @property
    def num_pending_loads(self) -> int:
        with self._lock:
            return self._pulls

    async def wait_saved(self, request_id: str, timeout: float = 30.0) -> int:
        """Wait (on the caller's loop) until the request's pushes so far are done; how many blocks failed.

        A producer hands a request to decode only after this: its blocks are committed in the store.
        """
        with self._lock:
            pending = [asyncio.wrap_future(f) for f, (rid, _) in self._saves.items() if rid == request_id]
        if pending:
            await asyncio.wait(pending, timeout=timeout)
        with self._lock:
            failed = self._failed_blocks.pop(request_id, 0)
        return failed + sum(n for f, (rid, n) in list(self._saves.items()) if rid == request_id)

    def discard_request(self, request_id: str) -> None:
        """Nobody will pull this request's partial blocks (it ended at its first token, or was
        cancelled): drop them once its pushes have landed, instead of leaving them to the TTL."""
        with self._lock:
            pending = [f for f, (rid, _) in self._saves.items() if rid == request_id]
            self._failed_blocks.pop(request_id, None)
        self._call(self._discard(request_id, pending))

    async def _discard(self, request_id: str, pending: list[Future]) -> None:
        if pending:
            await asyncio.wait([asyncio.wrap_future(f) for f in pending], timeout=30)
        with self._lock:
            self._failed_blocks.pop(request_id, None)
        try:
            await self.client.drop_partials(request_id)
        except Exception as exc:  # the store is gone: its partials went with it, or expire by TTL
            log.warning("dropping the partial blocks of %s failed: %s", request_id, exc)

    def request_finished(self, request: Request) -> None:
        """A request that ends here leaves no partial block behind: the prompt's tail a consumer
        pulled (kept until now, so that a request moved to another worker can pull it again), or
        what a producer pushed for a request that ended at its first token or was aborted. Called
        from the engine thread after the request's last save, so its pushes are all known here."""
        self._forget_loads(request.request_id)
        if request.status.finish_reason == "prefilled":
            return  # a decode worker pulls them next
        with self._lock:
            touched = request.request_id in self._touched
            self._touched.discard(request.request_id)
        if touched or request.num_saved_blocks:
            self.discard_request(request.request_id)

    def _forget_loads(self, request_id: str) -> None:
        """The request ended (aborted while its KV was on the way): the engine will not poll its loads,
        so their staging rows go back now, or as soon as a pull in flight lands."""
        with self._lock:
            for number, rid in self._pulling.items():
                if rid == request_id:
                    self._gone.add(number)
            stale = [r for r in self._done if r.request_id == request_id]
            self._done = [r for r in self._done if r.request_id != request_id]
        for r in stale:
            if r.release is not None:
                r.release()

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until every push so far is committed."""
        with self._lock:
            pending = list(self._saves)
        for fut in pending:
            try:
                fut.result(timeout)
            except Exception:  # counted in _saved
                pass

    def start_load(self, request: Request, first_block: int, num_blocks: int) -> None:
        refs = [block_ref(request, i) for i in range(first_block, first_block + num_blocks)]
        keys = [r for r in refs if isinstance(r, bytes)]
        partials = [r for r in refs if isinstance(r, PartialRef)]
        with self._lock:
            self._pulls += 1
            number = next(self._pull_numbers)
            self._pulling[number] = request.request_id
            if partials:
                self._touched.add(request.request_id)
        self._call(self._load(number, request.request_id, keys, partials, num_blocks,
                              self._trace_of(request.request_id)))

    async def _load(self, number: int, request_id: str, keys: list[bytes], partials: list[PartialRef], n: int,
                    ctx: Any) -> None:
        with telemetry.span("kv.pull", ctx, attributes={"tandem.kv.blocks": n}) as span:
            try:
                result = await self._pull(request_id, keys, partials, n, span)
            except Exception as exc:  # the store is down or died mid-pull: a miss, recomputed by the engine
                result = LoadResult(request_id, None, f"KV pull failed: {exc}")
            if result.error is not None:
                telemetry.fail(span, "MISS", result.error)
        with self._lock:
            del self._pulling[number]
            gone = number in self._gone
            self._gone.discard(number)
            if not gone:
                self._done.append(result)
            self._pulls -= 1
        if gone and result.release is not None:  # its request ended meanwhile: nobody imports it
            result.release()

    async def _pull(self, request_id: str, keys: list[bytes], partials: list[PartialRef], n: int,
                    span: Any) -> LoadResult:
        staged = self.staging.take(n) if self.staging is not None else None  # None: a fresh buffer
        try:
            result = await self._pull_into(request_id, keys, partials, n, span, staged)
        except BaseException:
            if staged is not None:
                staged.release()
            raise
        if staged is not None:
            if result.data is None:
                staged.release()
            else:
                result.release = staged.release  # the engine gives the rows back once they are in its cache
        return result

    async def _pull_into(self, request_id: str, keys: list[bytes], partials: list[PartialRef], n: int,
                         span: Any, staged: Staged | None) -> LoadResult:
        # The blocks land here, once: lent rows of the engine's staging pool, or a fresh buffer.
        staging = staged.tensor if staged is not None else torch.empty((n, *self.block_shape), dtype=self.dtype)
        rows = list(staging.view(n, -1).view(torch.uint8).numpy())
        by_rank = self.ranks if staged is not None else None  # each rank reads its heads into the rows
        start = time.perf_counter()
        pulled = await self.client.pull(keys, partials, metadata=telemetry.outgoing(telemetry.context_of(span)),
                                        out=rows, slices=by_rank,
                                        rows=None if staged is None else list(range(staged.start, staged.start + n)))
        seconds = time.perf_counter() - start
        nbytes = sum(b.nbytes for b in pulled.blocks)
        transport = "ucx-ranks" if by_rank is not None else "ucx-shm" if pulled.in_place else "ucx"
        span.set_attributes(_transfer_attributes(nbytes, seconds, "", transport))
        self.metrics.observe("pull", len(pulled.blocks), nbytes, seconds)
        if len(pulled.blocks) < n:
            return LoadResult(request_id, None, f"{n - len(pulled.blocks)} of {n} blocks are not in the store")
        return LoadResult(request_id, staging)

    def poll_loads(self) -> list[LoadResult]:
        with self._lock:
            done, self._done = self._done, []
        return done

    def close(self) -> None:
        self.flush()
        self.ranks = None  # lets go of the staging pool's shared memory
        self._call(self.client.close()).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


def _transfer_attributes(nbytes: int, seconds: float, data_address: str, transport: str = "ucx") -> dict[str, Any]:
    """``transport``: "ucx" (transfers over the data plane), "ucx-shm" (read in place from a pool
    mapped through UCX shared memory) or "ucx-ranks" (each tensor-parallel rank moved its own heads)."""
    attrs = {"tandem.kv.bytes": nbytes, "tandem.kv.seconds": seconds,
             "tandem.kv.gbps": nbytes / seconds / 1e9 if seconds > 0 else 0.0, "tandem.kv.transport": transport}
    if data_address:
        attrs["tandem.kv.data_address"] = data_address
    return attrs


def _as_bytes(block: torch.Tensor) -> np.ndarray:
    return block.contiguous().view(torch.uint8).reshape(-1).numpy()
