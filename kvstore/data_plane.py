"""The kvstore's UCX data plane: block bytes between a worker's buffers and the store's pool.

One UCX endpoint per (worker, store node), opened once and reused. A transfer is
a 16-byte header ``[op, n]`` and the ``n`` slot numbers, then ``n`` block messages
posted all at once (UCX pipelines them). The store sends from and receives into
its pool rows directly, so the store side copies nothing; the worker side sends
from and receives into whatever contiguous arrays it passes (a staging buffer,
or a view of its cache).

Which slots a worker may write or read is decided on the control plane
(Reserve / Lookup with a lease); the data plane only moves bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable

import numpy as np

OP_WRITE = 1
OP_READ = 2
MAX_BLOCKS_PER_TRANSFER = 1 << 16


def _ucxx():
    # ucxx sets a variable UCX 1.21 no longer knows, and UCX then warns on stdout. Progress runs in
    # ucxx's own thread: the "blocking" mode spins a core at 50-100% on an idle endpoint over TCP
    # (its arm/progress loop never settles), which starves the engines on a small machine.
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    os.environ.setdefault("UCXPY_PROGRESS_MODE", "thread")
    import ucxx

    return ucxx


class DataPlaneServer:
    """Serves one pool over a UCX listener, in the service's event loop."""

    def __init__(self, buffer: np.ndarray, on_bytes: Callable[[int, int], None] | None = None) -> None:
        self.buffer = buffer  # [num_slots, block_bytes] uint8
        self.on_bytes = on_bytes or (lambda received, sent: None)
        self._listener = None

    def start(self, port: int = 0) -> int:
        self._listener = _ucxx().create_listener(self._handle, port, endpoint_error_handling=True)
        return self._listener.port

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    async def _handle(self, ep) -> None:
        header = np.empty(2, dtype=np.int64)
        try:
            while True:
                await ep.recv(header)
                op, n = int(header[0]), int(header[1])
                if op not in (OP_WRITE, OP_READ) or not 0 < n <= MAX_BLOCKS_PER_TRANSFER:
                    return  # a peer that does not speak the protocol: drop the connection
                slots = np.empty(n, dtype=np.int64)
                await ep.recv(slots)
                if (slots < 0).any() or (slots >= self.buffer.shape[0]).any():
                    return
                rows = [self.buffer[int(s)] for s in slots]
                if op == OP_WRITE:
                    # Post every receive first, then let the writer go: blocks land in expected
                    # receives (straight into the pool) instead of UCX's unexpected-message buffers.
                    receives = [asyncio.ensure_future(ep.recv(row)) for row in rows]
                    await ep.send(np.ones(1, dtype=np.int64))
                    await asyncio.gather(*receives)
                    await ep.send(np.ones(1, dtype=np.int64))  # every byte is in the pool
                    self.on_bytes(n * self.buffer.shape[1], 0)
                else:
                    await asyncio.gather(*(ep.send(row) for row in rows))
                    self.on_bytes(0, n * self.buffer.shape[1])
        except Exception:  # the peer closed or died mid-transfer: its reservation or lease expires
            return
        finally:
            await _close(ep)


async def _close(ep) -> None:
    try:
        await ep.close()
    except Exception:
        pass


class DataPlaneClient:
    """A worker's endpoints to store nodes, one per data address, opened on first use."""

    def __init__(self) -> None:
        self._eps: dict[str, object] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def _endpoint(self, address: str):
        ep = self._eps.get(address)
        if ep is None or ep.closed:
            host, port = address.rsplit(":", 1)
            ep = await _ucxx().create_endpoint(host, int(port), endpoint_error_handling=True)
            self._eps[address] = ep
        return ep

    async def connect(self, address: str) -> None:
        async with self._locks.setdefault(address, asyncio.Lock()):
            await self._endpoint(address)

    @contextlib.asynccontextmanager
    async def _transfer(self, address: str, op: int, slots: list[int]) -> AsyncIterator[object]:
        """One transfer on the node's endpoint: the header sent, the endpoint yielded for the body.

        A failure drops the endpoint (the next transfer reconnects) and reads as ConnectionError.
        """
        async with self._locks.setdefault(address, asyncio.Lock()):
            ep = await self._endpoint(address)
            try:
                await ep.send(np.array([op, len(slots)], dtype=np.int64))
                await ep.send(np.asarray(slots, dtype=np.int64))
                yield ep
            except Exception as exc:
                self._eps.pop(address, None)
                raise ConnectionError(f"UCX transfer with {address} failed: {exc}") from exc

    async def write(self, address: str, slots: list[int], blocks: list[np.ndarray]) -> None:
        """Send ``blocks`` into ``slots`` of the node at ``address``; returns once they are in its pool."""
        async with self._transfer(address, OP_WRITE, slots) as ep:
            ack = np.zeros(1, dtype=np.int64)
            await ep.recv(ack)  # the store has posted its receives
            await asyncio.gather(*(ep.send(b) for b in blocks))
            await ep.recv(ack)

    async def read(self, address: str, slots: list[int], out: list[np.ndarray]) -> None:
        """Fill ``out`` (contiguous uint8 arrays of one block each) from ``slots`` of the node."""
        async with self._transfer(address, OP_READ, slots) as ep:
            await asyncio.gather(*(ep.recv(b) for b in out))

    async def close(self) -> None:
        for ep in self._eps.values():
            await _close(ep)
        self._eps.clear()
