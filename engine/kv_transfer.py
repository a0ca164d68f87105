"""The seam through which KV blocks leave and enter an engine: what the kvstore client plugs into.

An engine calls its connector from the engine thread only, between steps:

- ``save_blocks`` (producer side): blocks of a request that are final, i.e. full
  blocks of its prompt as soon as their chunk is computed, and the trailing
  partial block once the prompt is done. Full blocks come with their key
  (``engine.block_hash``); the partial one has none and is request-scoped.
- ``start_load`` / ``poll_loads`` (consumer side): fill blocks of a request from
  outside. Loads may run in the background; the engine writes what ``poll_loads``
  returns into its cache, so a connector never touches the cache tensors.
- ``request_finished``: the request left the engine (done, aborted, failed);
  release whatever the connector holds for it.

Blocks travel in the wire layout of ARCHITECTURE.md, ``[n, num_layers, 2,
block_size, num_kv_heads, head_dim]`` in the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.request import Request


def block_ref(request: Request, index: int) -> bytes | tuple[str, int]:
    """Where block ``index`` of a request is kept outside: by its key when it is full (shared),
    by (request id, index) when it is the trailing partial block (request-scoped)."""
    if index < len(request.block_hashes):
        return request.block_hashes[index]
    return (request.request_id, index)


@dataclass(slots=True)
class LoadResult:
    request_id: str
    data: torch.Tensor | None  # [num_blocks, layers, 2, block_size, Hkv, D], None on error
    error: str | None = None


class KVConnector:
    def save_blocks(self, request: Request, first_block: int, keys: list[bytes | None], data: torch.Tensor) -> None:
        raise NotImplementedError

    def start_load(self, request: Request, first_block: int, num_blocks: int) -> None:
        raise NotImplementedError

    def poll_loads(self) -> list[LoadResult]:
        raise NotImplementedError

    def request_finished(self, request: Request) -> None:
        """Default: nothing to release."""


class LocalKVTransfer(KVConnector):
    """An in-process block store shared by engines in one process (tests, single-process runs).

    Full blocks are kept by key, as the kvstore keeps them; a partial block by
    (request id, block index) until a consumer has loaded it.
    """

    def __init__(self) -> None:
        self.full: dict[bytes, torch.Tensor] = {}
        self.partial: dict[tuple[str, int], torch.Tensor] = {}
        self._done: list[LoadResult] = []

    def save_blocks(self, request: Request, first_block: int, keys: list[bytes | None], data: torch.Tensor) -> None:
        for i, key in enumerate(keys):
            block = data[i].clone()
            if key is None:
                self.partial[(request.request_id, first_block + i)] = block
            else:
                self.full[key] = block

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
            self.partial.pop((request.request_id, index), None)
        self._done.append(LoadResult(request.request_id, torch.stack(blocks)))

    def poll_loads(self) -> list[LoadResult]:
        done, self._done = self._done, []
        return done
