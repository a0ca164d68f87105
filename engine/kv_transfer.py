"""The seam through which KV blocks leave and enter an engine: what the kvstore client plugs into.

An engine calls its connector from the engine thread only, between steps:

- ``save_blocks`` (producer side): blocks of a request that are final, i.e. full
  blocks of its prompt as soon as their chunk is computed, and the trailing
  partial block once the prompt is done, each with its ``BlockRef``: a full
  block's key (``engine.block_hash``), or the request-scoped ``PartialRef`` of
  the partial one.
- ``start_load`` / ``poll_loads`` (consumer side): fill blocks of a request from
  outside. Loads may run in the background; the engine writes what ``poll_loads``
  returns into its cache, so a connector never touches the cache tensors.
- ``request_finished``: the request left the engine (done, aborted, failed);
  release whatever the connector holds for it.

Blocks travel in the wire layout of ``engine.kv_blocks`` (``[n, *wire_block_shape]``)
in the model dtype.

A worker holds the same connector from the other side (``KVConnectorWorkerSide``):
it ties transfers to a request's trace, waits for a request's pushes before
handing the request on, and closes the connector when the process stops.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from engine.kv_blocks import BlockRef, PartialRef
from engine.kv_staging import StagingPool
from engine.request import Request


def block_ref(request: Request, index: int) -> BlockRef:
    """Where block ``index`` of a request is kept outside: by its key when it is full (shared),
    by (request id, index) when it is the trailing partial block (request-scoped)."""
    if index < len(request.block_hashes):
        return request.block_hashes[index]
    return PartialRef(request.request_id, index)


@dataclass(slots=True)
class LoadResult:
    request_id: str
    data: torch.Tensor | None  # [num_blocks, *wire_block_shape], None on error
    error: str | None = None
    release: Callable[[], None] | None = None  # gives ``data``'s staging rows back, once it is in the cache


@dataclass(frozen=True, slots=True)
class RankSlice:
    """One tensor-parallel rank's part of every block in the wire layout: its KV heads, one contiguous
    byte range (``engine.kv_blocks``), and where its transfer agent listens."""

    rank: int
    first_kv_head: int
    num_kv_heads: int
    owns_kv: bool  # writes its heads out (with replicated KV heads, one replica of each does)
    agent: str  # the agent's Unix socket; "" for rank 0, whose transfers run in the connector's process


class KVConnector:
    """The engine's side of the seam, called from the engine thread between steps."""

    # A connector whose transfers each tensor-parallel rank runs itself names the module its ranks load
    # as their transfer agent (``module:function``, see ``use_ranks``); None: rank 0 moves whole blocks.
    rank_agent: str | None = None

    def use_ranks(self, slices: list[RankSlice]) -> None:
        """The engine's ranks, once each runs the ``rank_agent`` beside its shard: from then on a push or a
        pull through the staging pool moves each rank's heads over that rank's own endpoint."""

    def save_blocks(self, request: Request, first_block: int, refs: list[BlockRef], data: torch.Tensor,
                    release: Callable[[], None] | None = None, ready: Callable[[], None] | None = None) -> None:
        """``refs[i]`` names block ``first_block + i``, whose bytes are ``data[i]``; ``release`` (when given)
        must be called once the connector no longer reads ``data`` (its staging rows are lent). ``ready``
        (when given) blocks until ``data`` holds the bytes (a GPU's copy to the host may still be running):
        call it before reading them, off the engine thread where possible."""
        raise NotImplementedError

    def use_staging(self, pool: StagingPool) -> None:
        """The engine's staging pool, for pulls to land in (a connector may ignore it)."""

    def start_load(self, request: Request, first_block: int, num_blocks: int) -> None:
        raise NotImplementedError

    def poll_loads(self) -> list[LoadResult]:
        raise NotImplementedError

    def request_finished(self, request: Request) -> None:
        """Default: nothing to release."""

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until every push so far is done (the engine closes after, and its ranks may send them)."""


@runtime_checkable
class KVConnectorWorkerSide(Protocol):
    """What a worker calls on its connector, from its asyncio loop rather than the engine thread.

    A Protocol, not a base class: ``LocalKVTransfer`` needs none of it, and the worker shell
    (``common.worker``) must not depend on the kvstore's connector, which implements it.
    """

    def trace(self, request_id: str, ctx: Any | None) -> None:
        """So that the request's transfers show up in its trace (None: the request is over, forget it)."""

    async def wait_saved(self, request_id: str, timeout: float = 30.0) -> int:
        """How many of the request's blocks failed to save, once its pushes so far are done: a producer
        hands a request on only after this, so the next worker finds its blocks."""

    def discard_request(self, request_id: str) -> None:
        """Nobody will load the request's partial blocks (it ended, or was cancelled): drop them now
        rather than leave them to expire."""

    @property
    def num_pending_saves(self) -> int:
        """Pushes in flight: the worker reports them as load."""

    @property
    def num_pending_loads(self) -> int:
        """Pulls in flight: the worker reports them as load."""

    def close(self) -> None:
        """Before the process exits: pushes in flight finish, so no block a peer was promised is lost."""


class LocalKVTransfer(KVConnector):
    """An in-process block store shared by engines in one process (tests, single-process runs).

    Full blocks are kept by key, as the kvstore keeps them; a partial block by
    (request id, block index) until a consumer has loaded it.
    """

    def __init__(self) -> None:
        self.full: dict[bytes, torch.Tensor] = {}
        self.partial: dict[PartialRef, torch.Tensor] = {}
        self._done: list[LoadResult] = []

    def save_blocks(self, request: Request, first_block: int, refs: list[BlockRef], data: torch.Tensor,
                    release: Callable[[], None] | None = None, ready: Callable[[], None] | None = None) -> None:
        if ready is not None:
            ready()
        for i, ref in enumerate(refs):
            if isinstance(ref, bytes):
                self.full[ref] = data[i].clone()
            else:
                self.partial[ref] = data[i].clone()
        if release is not None:
            release()

    def start_load(self, request: Request, first_block: int, num_blocks: int) -> None:
        blocks = []
        for index in range(first_block, first_block + num_blocks):
            ref = block_ref(request, index)
            block = (self.full if isinstance(ref, bytes) else self.partial).get(ref)
            if block is None:
                self._done.append(LoadResult(request.request_id, None, f"block {index} is not stored"))
                return
            blocks.append(block)
        for index in range(first_block, first_block + num_blocks):
            self.partial.pop(PartialRef(request.request_id, index), None)
        self._done.append(LoadResult(request.request_id, torch.stack(blocks)))

    def poll_loads(self) -> list[LoadResult]:
        done, self._done = self._done, []
        return done
