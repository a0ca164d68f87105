"""Content addresses of KV blocks: the one definition the engine, the kvstore and the gateway share.

A full block's key is a chained SHA-256 (ARCHITECTURE.md, "KV blocks and their keys")::

    h0  = sha256(b"tandem-kv-v2" | model_fingerprint | cache_salt)
    h_i = sha256(h_{i-1} | token ids of block i as little-endian int32)

so a key names the whole prefix up to and including its block, for one model,
dtype, block size and KV layout, inside one tenant's salt. The fingerprint is a
fixed 32 bytes and the salt comes last, so the concatenation is unambiguous.

This module imports nothing heavy (no torch): the gateway hashes prompts with it.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from engine.kv_blocks import KV_LAYOUT

HASH_DOMAIN = b"tandem-kv-v2"  # v2: the head-major block layout (engine.kv_blocks.KV_LAYOUT)
HASH_BYTES = 32

_SAMPLES_PER_FILE = 16
_SAMPLE_BYTES = 4096


def model_fingerprint(
    model_config: dict[str, Any], dtype: str, block_size: int, weights_id: str, layout: str = KV_LAYOUT
) -> bytes:
    """32 bytes that differ whenever a block's bytes for the same tokens could differ.

    ``weights_id`` (``weights_digest``) tells apart checkpoints with the same
    config, e.g. two fine-tunes of one base model.
    """
    doc = {"model": model_config, "dtype": dtype, "block_size": block_size, "layout": layout, "weights": weights_id}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=list).encode()).digest()


def root_hash(fingerprint: bytes, cache_salt: str | bytes | None = None) -> bytes:
    if len(fingerprint) != HASH_BYTES:
        raise ValueError(f"a model fingerprint is {HASH_BYTES} bytes, got {len(fingerprint)}")
    salt = cache_salt.encode() if isinstance(cache_salt, str) else (cache_salt or b"")
    return hashlib.sha256(HASH_DOMAIN + fingerprint + salt).digest()


def block_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """Raises ValueError for ids a key cannot hold (outside int32): callers may hash before they validate."""
    try:
        packed = struct.pack(f"<{len(token_ids)}i", *token_ids)
    except struct.error as exc:
        raise ValueError(f"token ids must be 32-bit integers to be hashed: {exc}") from exc
    return hashlib.sha256(parent + packed).digest()


def chain_hashes(parent: bytes, token_ids: Sequence[int], block_size: int, start_block: int = 0) -> list[bytes]:
    """Keys of the full blocks of ``token_ids`` from ``start_block`` on; ``parent`` is the key before it."""
    out = []
    for b in range(start_block, len(token_ids) // block_size):
        parent = block_hash(parent, token_ids[b * block_size : (b + 1) * block_size])
        out.append(parent)
    return out


def prompt_block_hashes(
    fingerprint: bytes, token_ids: Sequence[int], block_size: int, cache_salt: str | bytes | None = None
) -> list[bytes]:
    """Keys of every full block of a prompt; the trailing partial block has none (it is never shared)."""
    return chain_hashes(root_hash(fingerprint, cache_salt), token_ids, block_size)


def weights_digest(files: Iterable[Path]) -> str:
    """A cheap, deterministic identity of checkpoint files, equal on every node that holds them.

    Hashing every byte of an 8B checkpoint takes tens of seconds; the safetensors
    header (names, shapes, offsets) plus evenly spaced samples of the data tell
    checkpoints apart just as well in practice. File times are left out on purpose:
    they differ between nodes.
    """
    h = hashlib.sha256()
    for path in sorted(Path(f) for f in files):
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            header_len = struct.unpack("<Q", f.read(8))[0] if size >= 8 else 0
            h.update(f.read(min(header_len, size - 8)))
            offsets = [size * i // _SAMPLES_PER_FILE for i in range(_SAMPLES_PER_FILE)]
            for offset in [*offsets, max(0, size - _SAMPLE_BYTES)]:  # the tail too: often the last layer
                f.seek(offset)
                h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()
