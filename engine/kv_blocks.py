"""A KV block outside an engine: how its bytes are laid out, and how it is named.

The one definition the engine, the kvstore, the launcher and the model
fingerprint share. It imports nothing heavy (no torch, no protobuf): the
launcher sizes the store's slots with it and the kvstore server keeps blocks by
``BlockRef`` without loading an engine.

Layout (README, "KV blocks"): one block is ``[num_kv_heads, num_layers, 2,
block_size, head_dim]`` (K then V) in the model dtype; a batch of blocks
prepends ``n``. KV heads come first so that the heads one tensor-parallel rank
holds are one contiguous byte range of the block, whatever the degree of the
worker that wrote it: a rank of a TP=2 decode worker reads the first or second
half of a block a TP=1 prefill worker wrote, and the other way round.

Name: a full block is shared under its content key (``engine.block_hash``, 32
bytes); the trailing partial block of a prompt is never shared, so it is named
by its request and index (``PartialRef``) and lives only as long as the request
needs it.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Protocol

# Bump when the bytes of a block change meaning: the layout below, or how K/V are stored. It feeds the
# model fingerprint, so blocks of another layout never share a key.
KV_LAYOUT = "v2:[num_kv_heads,num_layers,2,block_size,head_dim]"


class KVDims(Protocol):
    """What of a model's shape fixes the size of its KV blocks (``engine.config.ModelConfig`` is one)."""

    @property
    def num_layers(self) -> int: ...

    @property
    def num_kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...


def wire_block_shape(model: KVDims, block_size: int, num_kv_heads: int | None = None) -> tuple[int, int, int, int, int]:
    """One block on the wire, the layout ``KV_LAYOUT`` names; with ``num_kv_heads``, a slice of that
    many heads of it (what one tensor-parallel rank holds)."""
    heads = model.num_kv_heads if num_kv_heads is None else num_kv_heads
    return (heads, model.num_layers, 2, block_size, model.head_dim)


def wire_block_bytes(model: KVDims, block_size: int, itemsize: int) -> int:
    """Bytes of one block on the wire: a kvstore slot."""
    return math.prod(wire_block_shape(model, block_size)) * itemsize


class PartialRef(NamedTuple):
    """A request-scoped block (a prompt's trailing partial block), by request id and block index.

    A tuple, so hashing and comparing it is as cheap as the ``(request id, index)`` it replaced.
    """

    request_id: str
    index: int


BlockRef = bytes | PartialRef  # a full block by its 32-byte content key, or a partial block
