"""An engine's KV connector backed by a kvstore node: pushes and pulls run beside the step loop.

The engine calls the connector from its own thread between steps (see
``engine.kv_transfer``); transfers run on a private asyncio loop in a background
thread, so a push of one chunk's blocks overlaps the next chunk's compute, and a
pull completes while the engine keeps stepping the other requests.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import Future

import numpy as np
import torch

from engine.config import EngineConfig
from engine.kv_transfer import KVConnector, LoadResult, block_ref
from engine.request import Request
from kvstore.client import KVStoreClient
from kvstore.pool import BlockKey

log = logging.getLogger("tandem.kvstore.connector")


class KVStoreConnector(KVConnector):
    def __init__(self, address: str, config: EngineConfig) -> None:
        mc = config.model_config
        self.block_shape = (mc.num_layers, 2, config.block_size, mc.num_kv_heads, mc.head_dim)
        self.dtype = config.torch_dtype
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
        self._failed_blocks: dict[str, int] = {}  # per request not yet collected by ``wait_saved``
        self._pulls = 0
        self.failed_saves = 0

    async def _make_client(self, address: str) -> KVStoreClient:
        return KVStoreClient(address)  # its gRPC channel belongs to this loop

    def _call(self, coro) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def save_blocks(self, request: Request, first_block: int, keys: list[bytes | None], data: torch.Tensor) -> None:
        blocks: list[tuple[BlockKey, np.ndarray]] = [
            (key if key is not None else (request.request_id, first_block + i), _as_bytes(data[i]))
            for i, key in enumerate(keys)
        ]
        fut = self._call(self.client.push(blocks))
        with self._lock:
            self._saves[fut] = (request.request_id, len(blocks))
        fut.add_done_callback(self._saved)

    def _saved(self, fut: Future) -> None:
        with self._lock:
            request_id, n = self._saves.pop(fut)
            if fut.exception() is not None:  # the decode side will miss these blocks and recompute
                self.failed_saves += 1
                self._failed_blocks[request_id] = self._failed_blocks.get(request_id, 0) + n
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
        """A request that pushed blocks and will not be decoded elsewhere (it ended at its first token,
        or was aborted) leaves no partial block behind. Called from the engine thread after the
        request's last save, so its pushes are all known here."""
        if request.num_saved_blocks and request.status.finish_reason != "prefilled":
            self.discard_request(request.request_id)

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
        partials = [r for r in refs if not isinstance(r, bytes)]
        with self._lock:
            self._pulls += 1
        self._call(self._load(request.request_id, keys, partials, num_blocks))

    async def _load(self, request_id: str, keys: list[bytes], partials: list[tuple[str, int]], n: int) -> None:
        try:
            pulled = await self.client.pull(keys, partials)
            if len(pulled.blocks) < n:
                result = LoadResult(request_id, None, f"{n - len(pulled.blocks)} of {n} blocks are not in the store")
            else:
                raw = torch.from_numpy(np.stack(pulled.blocks))
                result = LoadResult(request_id, raw.view(self.dtype).reshape(n, *self.block_shape))
            if partials:
                await self.client.drop_partials(request_id)
        except Exception as exc:  # the store is down or died mid-pull: a miss, recomputed by the engine
            result = LoadResult(request_id, None, f"KV pull failed: {exc}")
        with self._lock:
            self._done.append(result)
            self._pulls -= 1

    def poll_loads(self) -> list[LoadResult]:
        with self._lock:
            done, self._done = self._done, []
        return done

    def close(self) -> None:
        self.flush()
        self._call(self.client.close()).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


def _as_bytes(block: torch.Tensor) -> np.ndarray:
    return block.contiguous().view(torch.uint8).reshape(-1).numpy()
