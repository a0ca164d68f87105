"""The typed seam between engine, worker and kvstore: one block reference, one block layout, both sides of the
connector. Static checks of the seam that need no store and no model."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from engine.block_hash import KV_LAYOUT as FINGERPRINTED_LAYOUT
from engine.kv_blocks import KV_LAYOUT, PartialRef, wire_block_bytes, wire_block_shape
from engine.kv_transfer import KVConnector, KVConnectorWorkerSide
from kvstore.connector import KVStoreConnector


@dataclass(frozen=True)
class Dims:
    num_layers: int = 2
    num_kv_heads: int = 3
    head_dim: int = 8


def test_the_kvstore_connector_is_both_sides_of_the_seam():
    """The worker calls its connector through ``KVConnectorWorkerSide``, a Protocol that nothing enforces at
    runtime: every member must be on the kvstore's connector, with the same parameters and of the same kind."""
    assert issubclass(KVStoreConnector, KVConnector)
    members = [name for name in vars(KVConnectorWorkerSide) if not name.startswith("_")]
    assert {"trace", "wait_saved", "discard_request", "num_pending_saves", "num_pending_loads", "close"} <= {
        *members
    }
    for name in members:
        want = inspect.getattr_static(KVConnectorWorkerSide, name)
        have = inspect.getattr_static(KVStoreConnector, name)
        if isinstance(want, property):
            assert isinstance(have, property), name
            continue
        assert inspect.iscoroutinefunction(have) == inspect.iscoroutinefunction(want), name
        params = [(p.name, p.kind, p.default) for p in inspect.signature(want).parameters.values()]
        assert [(p.name, p.kind, p.default) for p in inspect.signature(have).parameters.values()] == params, name


def test_one_block_layout_sizes_blocks_and_names_the_fingerprint():
    assert FINGERPRINTED_LAYOUT is KV_LAYOUT == "v2:[num_kv_heads,num_layers,2,block_size,head_dim]"
    assert wire_block_shape(Dims(), 16) == (3, 2, 2, 16, 8)
    assert wire_block_shape(Dims(), 16, 1) == (1, 2, 2, 16, 8)
    assert wire_block_bytes(Dims(), 16, 2) == 2 * 2 * 16 * 3 * 8 * 2


def test_a_partial_ref_is_a_cheap_hashable_key():
    ref = PartialRef("r0", 1)
    assert {ref: 1}[PartialRef("r0", 1)] == 1 and ref.request_id == "r0" and ref.index == 1
    assert not isinstance(ref, bytes)
