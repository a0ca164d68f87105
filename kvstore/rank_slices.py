"""Rank 0's side of a tensor-parallel worker's transfers: every rank that owns KV heads moves its own
byte range of each block, in parallel, over its own endpoint, or out of the store's pool in place when it
is mapped on this host (rank 0 in process, the others through their agents, ``kvstore.rank_agent``); this
combines their answers.

A pull lands each rank's heads in the same staging rows, so the engine's import then finds whole blocks
there (every rank copies its heads out in place, ``engine.parallel.executor``); a push sends the rows an
export filled the same way. With replicated KV heads only the first replica of each head transfers it, so
every byte crosses once. ``bytes_by_rank`` counts what each rank moved: the bench and the tests compare
it with the whole blocks.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import torch

from engine.kv_staging import StagingPool
from engine.kv_transfer import RankSlice
from kvstore.client import PoolDescriptor
from kvstore.data_plane import DataPlaneClient
from kvstore.pool_mappings import PoolMappings
from kvstore.rank_agent import LINE_LIMIT, SliceMover, answer_request, pool_json


class RankAgentError(ConnectionError):
    """A rank's agent could not do its part (its transfer failed, or the rank is gone)."""


class RankSlices:
    """``kvstore.client.SliceTransfers`` over a worker's ranks."""

    def __init__(self, data: DataPlaneClient, pool: StagingPool, slices: list[RankSlice], total_kv_heads: int,
                 mappings: PoolMappings | None = None) -> None:
        """``mappings``: rank 0's client's, so that rank 0 reads a mapped pool through the same mapping."""
        rows = pool.buffer.view(pool.capacity, -1).view(torch.uint8).numpy()
        self.block_bytes = rows.shape[1]
        self.total = total_kv_heads
        self.owners = [s for s in slices if s.owns_kv]
        first = slices[0]
        self.local = SliceMover(data, rows, first.first_kv_head, first.num_kv_heads, total_kv_heads, mappings)
        self.bytes_by_rank: dict[int, dict[str, int]] = {s.rank: {"read": 0, "write": 0} for s in self.owners}
        self.in_place_by_rank: dict[int, int] = {s.rank: 0 for s in self.owners}  # blocks read out of a mapped pool

    async def connect(self, address: str) -> None:
        """Open every agent's endpoint to the store now, not on the first request's time to first token."""
        await asyncio.gather(*(self._ask(s, {"op": "connect", "address": address}) for s in self.owners if s.agent))

    async def read(self, address: str, token: bytes, slots: list[int], rows: list[int],
                   expected: list[list[int]], pool: PoolDescriptor | None = None) -> list[bool]:
        request = {"op": "read", "address": address, "token": token.hex(), "slots": slots, "rows": rows,
                   "expected": expected}
        if pool is not None:  # on this host: every rank maps it once and copies its heads out in place
            request["pool"] = pool_json(pool)
        answers = await asyncio.gather(*(self._each(s, request) for s in self.owners))
        return [all(oks) for oks in zip(*(a["ok"] for a in answers), strict=True)]

    async def write(self, address: str, token: bytes, slots: list[int], rows: list[int]) -> list[list[int]]:
        request = {"op": "write", "address": address, "token": token.hex(), "slots": slots, "rows": rows}
        answers = await asyncio.gather(*(self._each(s, request) for s in self.owners))
        heads = [[0] * self.total for _ in slots]
        for s, answer in zip(self.owners, answers, strict=True):
            for block, sums in zip(heads, answer["checksums"], strict=True):
                block[s.first_kv_head : s.first_kv_head + s.num_kv_heads] = sums
        return heads

    async def _each(self, s: RankSlice, request: dict[str, Any]) -> dict[str, Any]:
        """One rank's part: in process for rank 0, else through its agent."""
        answer = await (self._ask(s, request) if s.agent else answer_request(self.local, request))
        self.bytes_by_rank[s.rank][request["op"]] = answer["bytes"]
        if "in_place" in answer:
            self.in_place_by_rank[s.rank] = answer["in_place"]
        return answer

    async def _ask(self, s: RankSlice, request: dict[str, Any]) -> dict[str, Any]:
        try:
            reader, writer = await asyncio.open_unix_connection(s.agent, limit=LINE_LIMIT)
        except OSError as exc:
            raise RankAgentError(f"the KV transfer agent of rank {s.rank} cannot be reached: {exc}") from exc
        try:
            writer.write(json.dumps(request).encode() + b"\n")
            await writer.drain()
            line = await reader.readline()
        finally:
            writer.close()
        if not line:
            raise RankAgentError(f"the KV transfer agent of rank {s.rank} hung up (the rank died?)")
        answer = json.loads(line)
        if "error" in answer:
            raise RankAgentError(f"rank {s.rank}'s part of a KV transfer failed: {answer['error']}")
        return answer
