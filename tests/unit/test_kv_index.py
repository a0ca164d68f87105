"""The block index contract, run against the in-process dicts. tests/e2e/test_kv_index.py runs the same tests
against a real redis-server."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest

from engine.block_hash import prompt_block_hashes
from kvstore.index import BlockIndex, IndexEntry, IndexUnavailableError, MemoryIndex
from kvstore.redis_index import RedisIndex

TTL_S = 0.3  # short enough to sleep through on redis, long enough to outlast a slow scheduler


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Backend:
    """One index under test, plus how to open a second client of it and let time pass."""

    def __init__(self, kind: str, url: str | None = None) -> None:
        self.kind = kind
        self.url = url
        self.prefix = f"test:{uuid.uuid4().hex}:"
        self.clock = FakeClock()
        self._opened: list[BlockIndex] = []
        self.index = self.connect()

    def connect(self) -> BlockIndex:
        """A second "store node" view of the same index (memory: the same object, as in one process)."""
        if self.kind == "memory":
            if self._opened:
                return self._opened[0]
            index: BlockIndex = MemoryIndex(clock=self.clock)
        else:
            assert self.url is not None
            index = RedisIndex(self.url, prefix=self.prefix)
        self._opened.append(index)
        return index

    def advance(self, seconds: float) -> None:
        if self.kind == "memory":
            self.clock.now += seconds
        else:
            time.sleep(seconds)

    def close(self) -> None:
        for index in self._opened:
            index.close()


@pytest.fixture(params=["memory"])  # the "redis" backend, a real redis-server: tests/e2e/test_kv_index.py
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    b = Backend(request.param)
    yield b
    b.close()


@pytest.fixture
def index(backend: Backend) -> BlockIndex:
    return backend.index


KEYS = prompt_block_hashes(b"\x01" * 32, list(range(16 * 8)), 16)


def entry(i: int, node: str = "node-a", slot: int | None = None) -> IndexEntry:
    return IndexEntry(KEYS[i], node, i if slot is None else slot, 4096, 2**64 - 1 - i)


def test_lookup_returns_the_longest_committed_prefix(index: BlockIndex) -> None:
    index.register_node("node-a", "10.0.0.1:7000", 60)
    index.commit([entry(0), entry(1), entry(2), entry(4)])
    assert index.lookup(KEYS[:6]) == [entry(0), entry(1), entry(2)]
    assert index.lookup([KEYS[3], KEYS[0]]) == []
    assert index.lookup([]) == []
    assert index.lookup([KEYS[0]]) == [entry(0)]


def test_long_lookups_cross_the_scripts_chunks(index: BlockIndex) -> None:
    keys = prompt_block_hashes(b"\x02" * 32, list(range(16 * 2500)), 16)
    entries = [IndexEntry(k, f"node-{i % 3}", i, 8192, i * 7919) for i, k in enumerate(keys)]
    for n in range(3):
        index.register_node(f"node-{n}", f"h{n}:1", 60)
    index.commit(entries)
    assert index.lookup(keys) == entries
    assert index.lookup(keys[:1500] + KEYS[:1] + keys[1500:]) == entries[:1500]
    assert index.lookup(keys[:1000] + KEYS[:1]) == entries[:1000]
    assert index.get(keys[:999] + KEYS[:2] + keys[999:]) == entries[:999] + [None, None] + entries[999:]


def test_lookup_stops_at_the_first_entry_of_a_dead_node(backend: Backend, index: BlockIndex) -> None:
    index.register_node("node-a", "a:1", 60)
    index.register_node("node-b", "b:1", TTL_S)
    chain = [entry(0, "node-a"), entry(1, "node-a"), entry(2, "node-b"), entry(3, "node-a")]
    index.commit(chain)
    assert index.lookup(KEYS[:4]) == chain  # decoded once while node-b is alive ...
    backend.advance(TTL_S + 0.1)
    assert index.lookup(KEYS[:4]) == chain[:2]  # ... and still cut once it is not
    assert index.get(KEYS[:4]) == [chain[0], chain[1], None, chain[3]]


def test_get_answers_each_key_independently(index: BlockIndex) -> None:
    index.register_node("node-a", "a:1", 60)
    index.commit([entry(0), entry(2)])
    assert index.get([KEYS[0], KEYS[1], KEYS[2]]) == [entry(0), None, entry(2)]
    assert index.get([KEYS[1]]) == [None]
    assert index.get([]) == []


@pytest.mark.parametrize(
    "bad",
    [
        IndexEntry(b"\x00" * 31, "node-a", 0, 1, 1),
        IndexEntry(KEYS[5], "node-a", -1, 1, 1),
        IndexEntry(KEYS[5], "node-a", 0, -1, 1),
        IndexEntry(KEYS[5], "node-a", 0, 1, 2**64),
        IndexEntry(KEYS[5], "node-a", 0, 1, -1),
        IndexEntry(KEYS[5], "", 0, 1, 1),
        IndexEntry(KEYS[5], "a|b", 0, 1, 1),
    ],
    ids=["short-key", "slot", "length", "checksum-high", "checksum-neg", "empty-node", "pipe-node"],
)
def test_a_commit_with_one_invalid_entry_commits_nothing(index: BlockIndex, bad: IndexEntry) -> None:
    index.register_node("node-a", "a:1", 60)
    with pytest.raises(ValueError):
        index.commit([entry(0), entry(1), bad])
    assert index.get([KEYS[0], KEYS[1]]) == [None, None]


def test_bytes_like_keys_are_accepted(index: BlockIndex) -> None:
    index.register_node("node-a", "a:1", 60)
    index.commit([IndexEntry(bytearray(KEYS[0]), "node-a", 0, 4096, 2**64 - 1)])
    assert index.lookup([memoryview(KEYS[0])]) == [entry(0)]
    assert index.remove("node-a", [bytearray(KEYS[0])]) == 1


def test_malformed_keys_are_invalid_arguments(index: BlockIndex) -> None:
    for call in (index.lookup, index.get, lambda keys: index.remove("node-a", keys)):
        with pytest.raises(ValueError, match="32 bytes"):
            call([KEYS[0], b"short"])
        with pytest.raises(ValueError):
            call(["not bytes" * 4])
    with pytest.raises(ValueError):
        index.register_node("node-a", "a:1", 0)


def test_recommit_by_the_same_node_overwrites(index: BlockIndex) -> None:
    index.register_node("node-a", "a:1", 60)
    index.commit([entry(0, slot=1)])
    assert index.lookup([KEYS[0]]) == [entry(0, slot=1)]
    index.commit([entry(0, slot=9)])
    assert index.lookup([KEYS[0]]) == index.get([KEYS[0]]) == [entry(0, slot=9)]


def test_another_nodes_commit_keeps_the_first_owner(index: BlockIndex) -> None:
    index.register_node("node-a", "a:1", 60)
    index.register_node("node-b", "b:1", 60)
    index.commit([entry(0, "node-a", slot=1)])
    index.commit([entry(0, "node-b", slot=2), entry(1, "node-b")])
    assert index.lookup(KEYS[:2]) == [entry(0, "node-a", slot=1), entry(1, "node-b")]
    # node-b never owned key 0, so its purge leaves it alone
    assert index.purge_node("node-b") == 1
    assert index.get([KEYS[0], KEYS[1]]) == [entry(0, "node-a", slot=1), None]


def test_a_dead_owners_key_is_taken_over(backend: Backend, index: BlockIndex) -> None:
    index.register_node("node-a", "a:1", TTL_S)
    index.register_node("node-b", "b:1", 60)
    index.commit([entry(0, "node-a")])
    backend.advance(TTL_S + 0.1)
    index.commit([entry(0, "node-b", slot=7)])
    assert index.lookup(KEYS[:1]) == [entry(0, "node-b", slot=7)]
    assert index.purge_dead() == ["node-a"]
    assert index.get([KEYS[0]]) == [entry(0, "node-b", slot=7)]


def test_remove_drops_only_the_callers_entries(index: BlockIndex) -> None:
    index.register_node("node-a", "a:1", 60)
    index.register_node("node-b", "b:1", 60)
    index.commit([entry(0, "node-a"), entry(1, "node-a"), entry(2, "node-b")])
    assert index.remove("node-b", [KEYS[0], KEYS[2]]) == 1
    assert index.remove("node-a", [KEYS[0], KEYS[0], KEYS[6]]) == 1
    assert index.remove("node-a", []) == 0
    assert index.get(KEYS[:3]) == [None, entry(1, "node-a"), None]
    assert index.purge_node("node-a") == 1


def test_heartbeats_keep_a_node_alive(backend: Backend, index: BlockIndex) -> None:
    assert index.nodes() == {}
    index.register_node("node-a", "10.0.0.1:7000", TTL_S)
    index.register_node("node-b", "10.0.0.2:7000", TTL_S)
    assert index.nodes() == {"node-a": "10.0.0.1:7000", "node-b": "10.0.0.2:7000"}
    index.commit([entry(0, "node-a")])
    for _ in range(2):
        backend.advance(TTL_S / 2)
        index.register_node("node-a", "10.0.0.1:7001", TTL_S)  # a heartbeat may also move the address
    assert index.nodes() == {"node-a": "10.0.0.1:7001"}
    assert index.lookup(KEYS[:1]) == [entry(0, "node-a")]


def test_an_expired_nodes_entries_are_misses_until_purged(backend: Backend, index: BlockIndex) -> None:
    index.register_node("node-a", "a:1", TTL_S)
    index.register_node("node-b", "b:1", 60)
    index.commit([entry(0, "node-a"), entry(1, "node-a"), entry(2, "node-b")])
    assert index.purge_dead() == []
    backend.advance(TTL_S + 0.1)
    assert index.lookup(KEYS[:3]) == []
    assert index.get(KEYS[:3]) == [None, None, entry(2, "node-b")]
    assert index.nodes() == {"node-b": "b:1"}
    assert index.purge_dead() == ["node-a"]
    assert index.purge_dead() == []
    index.register_node("node-a", "a:1", 60)  # comes back empty: the purge really dropped its entries
    assert index.get(KEYS[:3]) == [None, None, entry(2, "node-b")]
    assert index.purge_node("node-a") == 0


def test_a_node_that_never_registered_is_dead(index: BlockIndex) -> None:
    index.commit([entry(0, "ghost")])
    assert index.lookup(KEYS[:1]) == []
    assert index.purge_dead() == ["ghost"]


def test_purge_node_drops_the_node_and_its_entries(index: BlockIndex) -> None:
    index.register_node("node-a", "a:1", 60)
    index.register_node("node-b", "b:1", 60)
    index.commit([entry(i, "node-a") for i in range(5)] + [entry(5, "node-b")])
    assert index.purge_node("node-a") == 5
    assert index.nodes() == {"node-b": "b:1"}
    assert index.get(KEYS[:6]) == [None] * 5 + [entry(5, "node-b")]
    assert index.purge_node("node-a") == 0
    assert index.purge_node("never-seen") == 0


def test_purging_a_large_node_spans_batches(index: BlockIndex) -> None:
    keys = prompt_block_hashes(b"\x03" * 32, list(range(16 * 25_000)), 16)
    index.register_node("big", "big:1", 60)
    index.commit([IndexEntry(k, "big", i, 1, i) for i, k in enumerate(keys)])
    assert index.purge_node("big") == len(keys)
    assert index.get(keys[:3] + keys[-3:]) == [None] * 6


def test_two_clients_see_each_others_commits(backend: Backend) -> None:
    a, b = backend.index, backend.connect()
    a.register_node("node-a", "a:1", 60)
    b.register_node("node-b", "b:1", 60)
    a.commit([entry(0, "node-a"), entry(1, "node-a")])
    b.commit([entry(1, "node-b"), entry(2, "node-b")])
    expected = [entry(0, "node-a"), entry(1, "node-a"), entry(2, "node-b")]
    assert a.lookup(KEYS[:3]) == b.lookup(KEYS[:3]) == expected
    assert a.nodes() == b.nodes() == {"node-a": "a:1", "node-b": "b:1"}
    assert b.remove("node-b", [KEYS[1], KEYS[2]]) == 1
    assert a.lookup(KEYS[:3]) == expected[:2]


def test_unavailable_message_hides_the_password() -> None:
    index = RedisIndex("redis://user:s3cret@127.0.0.1:1/0", connect_timeout_s=0.5)
    with pytest.raises(IndexUnavailableError) as err:
        index.nodes()
    assert "s3cret" not in str(err.value) and "redis://user:***@127.0.0.1:1/0" in str(err.value)
    index.close()
