"""A tensor-parallel rank's KV transfer agent: it moves the rank's own heads of each block between the
store and the worker's shared staging rows, over the rank's own UCX endpoint, when rank 0's connector
asks (``kvstore.rank_slices``).

The wire layout puts a rank's KV heads in one contiguous byte range of every block
(``engine.kv_blocks``), so a rank reads and writes that range with the data plane's ranged transfers and
checks it against the store's per-head checksums: no rank ever handles another's bytes, and no rank
gathers whole blocks. The connector keeps the control plane (Lookup and leases, Reserve and Commit); the
agents only hold data-plane tokens it hands them.

Each rank process (``engine.parallel.rank``) loads ``start`` by name, so the engine never imports the
kvstore; it runs on its own thread and event loop beside the rank's step loop. Requests come over a Unix
socket in a directory private to the worker, one JSON request and answer per connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from kvstore.client import PoolDescriptor, head_checksums
from kvstore.data_plane import DataPlaneClient
from kvstore.pool_mappings import PoolMappings

LINE_LIMIT = 64 << 20  # a request names every slot, row and head checksum of a transfer


class SliceMover:
    """One rank's transfers: its byte range of blocks, between store slots and rows of the staging pool."""

    def __init__(self, data: DataPlaneClient, rows: np.ndarray, first_kv_head: int, num_kv_heads: int,
                 total_kv_heads: int, mappings: PoolMappings | None = None) -> None:
        """``rows``: the staging pool as uint8 ``[capacity, block_bytes]``; ``mappings``: of store pools on this
        host, for in-place reads (a fresh set, unless the process already keeps one)."""
        self.data, self.rows = data, rows
        self.mappings = mappings if mappings is not None else PoolMappings()
        head_bytes = rows.shape[1] // total_kv_heads
        self.first, self.num, self.total = first_kv_head, num_kv_heads, total_kv_heads
        self.byte_range = (first_kv_head * head_bytes, num_kv_heads * head_bytes)
        self.bytes_read = 0
        self.bytes_written = 0
        self.in_place = 0  # blocks copied out of a mapped pool rather than transferred

    def _views(self, rows: list[int]) -> list[np.ndarray]:
        offset, length = self.byte_range
        return [self.rows[r, offset : offset + length] for r in rows]

    async def read(self, address: str, token: bytes, slots: list[int], rows: list[int],
                   expected: list[list[int]], pool: PoolDescriptor | None = None) -> list[bool]:
        """Whether each block's heads here matched their checksums in ``expected`` (all heads, per block).

        ``pool``: the store's pool is on this host: the heads are copied out of it in place, as a whole-block
        reader does (``kvstore.client``), rather than transferred; a pool that cannot be mapped after all
        falls back to the data plane.
        """
        views = self._views(rows)
        self.mappings.expire()
        if not await self._copy_mapped(pool, slots, views):
            await self.data.read(address, token, slots, views, byte_range=self.byte_range)
        self.bytes_read += sum(v.nbytes for v in views)
        mine = slice(self.first, self.first + self.num)
        return [len(e) == self.total and head_checksums(v, self.num) == list(e[mine])
                for v, e in zip(views, expected, strict=True)]

    async def _copy_mapped(self, pool: PoolDescriptor | None, slots: list[int], views: list[np.ndarray]) -> bool:
        if pool is None:
            return False
        region = await self.mappings.region_for(pool.address, pool.pool_id, pool.pool_map)
        if region is None:
            return False
        offset, length = self.byte_range

        def copy() -> bool:  # numpy lets go of the GIL: the loop goes on serving other transfers meanwhile
            with region.reading() as usable:
                blocks = [region.block(slot, offset + length) for slot in slots] if usable else [None]
                if any(b is None for b in blocks):
                    return False
                for view, block in zip(views, blocks, strict=True):
                    np.copyto(view, block[offset:])
                return True

        if not await asyncio.to_thread(copy):
            return False
        self.in_place += len(slots)
        return True

    async def write(self, address: str, token: bytes, slots: list[int], rows: list[int]) -> list[list[int]]:
        """The checksums of this rank's heads, per block, as written."""
        views = self._views(rows)
        await self.data.write(address, token, slots, views, byte_range=self.byte_range)
        self.bytes_written += sum(v.nbytes for v in views)
        return [head_checksums(v, self.num) for v in views]


def start(socket_path: str, pool: memoryview, block_bytes: int, first_kv_head: int, num_kv_heads: int,
          total_kv_heads: int) -> Callable[[], None]:
    """Serve this rank's transfers at ``socket_path`` (listening when this returns); the stop function.

    ``pool``: the engine's shared staging pool (whole rows of ``block_bytes``).
    """
    flat = np.frombuffer(pool, dtype=np.uint8)
    rows = flat[: len(flat) // block_bytes * block_bytes].reshape(-1, block_bytes)
    mover = SliceMover(DataPlaneClient(), rows, first_kv_head, num_kv_heads, total_kv_heads)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="kv-rank-agent", daemon=True)
    thread.start()

    async def listen() -> asyncio.AbstractServer:
        return await asyncio.start_unix_server(lambda r, w: _serve(mover, r, w), path=socket_path, limit=LINE_LIMIT)

    server = asyncio.run_coroutine_threadsafe(listen(), loop).result(30)

    async def close() -> None:
        server.close()
        with contextlib.suppress(Exception):
            await mover.data.close()
        mover.mappings.close()

    def stop() -> None:
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        mover.rows = None  # lets go of the pool's shared memory, which the rank then closes

    return stop


async def _serve(mover: SliceMover, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        line = await reader.readline()
        if not line:
            return
        try:
            answer = await answer_request(mover, json.loads(line))
        except Exception as exc:  # a failed transfer: rank 0 counts it as a failed push or a miss
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        writer.write(json.dumps(answer).encode() + b"\n")
        await writer.drain()
    except ConnectionError:  # rank 0 hung up (its process is going): nobody wants the answer
        pass
    finally:
        writer.close()


async def answer_request(mover: SliceMover, req: dict[str, Any]) -> dict[str, Any]:
    """One request, as the agent answers it over its socket (rank 0 calls it in process for its own part)."""
    op = req.get("op")
    if op == "connect":
        await mover.data.connect(req["address"])
        return {}
    token = bytes.fromhex(req["token"])
    if op == "read":
        return {"ok": await mover.read(req["address"], token, req["slots"], req["rows"], req["expected"],
                                       pool_of(req)),
                "bytes": mover.bytes_read, "in_place": mover.in_place}
    if op == "write":
        return {"checksums": await mover.write(req["address"], token, req["slots"], req["rows"]),
                "bytes": mover.bytes_written}
    raise ValueError(f"unknown request {op!r}")


def pool_json(pool: PoolDescriptor) -> dict[str, str]:
    return {"address": pool.address, "id": pool.pool_id.hex(), "map": pool.pool_map.hex()}


def pool_of(request: dict[str, Any]) -> PoolDescriptor | None:
    """The store pool a read request says is on this host, if any."""
    pool = request.get("pool")
    return None if pool is None else PoolDescriptor(pool["address"], bytes.fromhex(pool["id"]),
                                                    bytes.fromhex(pool["map"]))
