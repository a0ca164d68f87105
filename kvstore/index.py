"""The block index: which store node holds each committed KV block (ARCHITECTURE.md, "kvstore").

Two backends share one contract so that a single store node needs nothing
installed (``MemoryIndex``) while several store nodes and every gateway can
share one Redis (``RedisIndex``, in ``kvstore.redis_index``). The shared test
suite in ``tests/unit/test_kv_index.py`` pins the contract:

- ``commit`` is all-or-nothing, so a reader never sees half of a request's blocks.
- A key already held by another *alive* node is kept (first writer wins): both
  copies hold the same bytes, and flapping owners would break readers' leases.
  A key whose owner is dead is taken over, so a recomputed block is visible again
  without waiting for ``purge_dead``.
- Entries of a node whose heartbeat expired read as misses, never as errors: the
  prefill recomputes them.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from types import TracebackType

from engine.block_hash import HASH_BYTES

_MAX_U64 = 2**64
_MAX_NODE_ID = 256


class IndexUnavailableError(ConnectionError):
    """The index backend cannot be reached; the service maps it to gRPC UNAVAILABLE."""


@dataclass(frozen=True, slots=True)
class IndexEntry:
    key: bytes  # 32-byte block hash
    node_id: str  # store node holding it
    slot: int  # slot in that node's pool
    length: int  # bytes
    checksum: int  # xxh3-64 of the bytes (unsigned 64-bit int)


def check_key(key: object) -> bytes:
    """Reject anything but a block hash early: a wrong key would silently never hit."""
    if not isinstance(key, bytes | bytearray | memoryview) or len(key) != HASH_BYTES:
        size = len(key) if isinstance(key, bytes | bytearray | memoryview) else type(key).__name__
        raise ValueError(f"a block key is {HASH_BYTES} bytes, got {size}")
    return bytes(key)


def check_keys(keys: Iterable[object]) -> list[bytes]:
    keys = list(keys)
    if set(map(type, keys)) <= {bytes} and set(map(len, keys)) <= {HASH_BYTES}:
        return keys  # the common case, checked column-wise: a 1,000-key lookup has a 2 ms budget
    return [check_key(k) for k in keys]


def check_node_id(node_id: object) -> str:
    """Node ids end up inside Redis key names and packed values, so '|' and whitespace are refused."""
    if not isinstance(node_id, str) or not node_id or len(node_id) > _MAX_NODE_ID:
        raise ValueError(f"a node id is a non-empty string of at most {_MAX_NODE_ID} characters, got {node_id!r}")
    if "|" in node_id or not node_id.isprintable() or any(c.isspace() for c in node_id):
        raise ValueError(f"a node id may not contain '|', whitespace or control characters, got {node_id!r}")
    return node_id


def _check_int(name: str, value: object, upper: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < upper:
        raise ValueError(f"{name} must be an integer in [0, {upper}), got {value!r}")


def check_entry(entry: IndexEntry) -> IndexEntry:
    """Validate before anything is written, which is what makes a commit with a bad entry commit nothing."""
    if not isinstance(entry, IndexEntry):
        raise ValueError(f"expected an IndexEntry, got {type(entry).__name__}")
    key = check_key(entry.key)
    check_node_id(entry.node_id)
    _check_int("slot", entry.slot, _MAX_U64)
    _check_int("length", entry.length, _MAX_U64)
    _check_int("checksum", entry.checksum, _MAX_U64)
    return entry if type(entry.key) is bytes else replace(entry, key=key)  # a bytearray key is not hashable


def check_ttl(ttl_s: object) -> float:
    if not isinstance(ttl_s, int | float) or isinstance(ttl_s, bool) or not ttl_s > 0:
        raise ValueError(f"a node ttl must be a positive number of seconds, got {ttl_s!r}")
    return float(ttl_s)


class BlockIndex(ABC):
    """Block hash -> (store node, slot, length, checksum), plus the registry of alive store nodes."""

    @abstractmethod
    def commit(self, entries: list[IndexEntry]) -> None:
        """Make ``entries`` visible atomically; keys held by another alive node keep their first owner."""

    @abstractmethod
    def lookup(self, keys: list[bytes]) -> list[IndexEntry]:
        """Entries of the longest present prefix of ``keys``: a prompt can only reuse blocks up to the first miss."""

    @abstractmethod
    def get(self, keys: list[bytes]) -> list[IndexEntry | None]:
        """One answer per key, each independent of the others (None: absent or on a dead node)."""

    @abstractmethod
    def remove(self, node_id: str, keys: list[bytes]) -> int:
        """Drop the entries of ``keys`` that ``node_id`` owns (eviction); returns how many went."""

    @abstractmethod
    def register_node(self, node_id: str, address: str, ttl_s: float) -> None:
        """Announce or heartbeat a store node; it stays alive for ``ttl_s`` after the latest call."""

    @abstractmethod
    def nodes(self) -> dict[str, str]:
        """Alive node id -> address."""

    @abstractmethod
    def purge_node(self, node_id: str) -> int:
        """Forget a node and every entry it owns; returns the number of entries dropped."""

    @abstractmethod
    def purge_dead(self) -> list[str]:
        """Purge every known node whose heartbeat expired; returns their ids."""

    @abstractmethod
    def close(self) -> None:
        """Release connections; the index is not used afterwards."""

    def __enter__(self) -> BlockIndex:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class MemoryIndex(BlockIndex):
    """The embedded index of a single store node: plain dicts behind one lock.

    ``clock`` is injectable so tests can expire heartbeats without sleeping.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[bytes, IndexEntry] = {}
        self._by_node: dict[str, set[bytes]] = {}
        self._nodes: dict[str, tuple[str, float]] = {}  # node id -> (address, deadline)

    def _alive(self, node_id: str, now: float) -> bool:
        reg = self._nodes.get(node_id)
        return reg is not None and now < reg[1]

    def _visible(self, key: bytes, now: float) -> IndexEntry | None:
        entry = self._entries.get(key)
        return entry if entry is not None and self._alive(entry.node_id, now) else None

    def _put(self, entry: IndexEntry, now: float) -> None:
        old = self._entries.get(entry.key)
        if old is not None and old.node_id != entry.node_id:
            if self._alive(old.node_id, now):
                return  # keep first
            self._by_node[old.node_id].discard(entry.key)
        self._entries[entry.key] = entry
        self._by_node.setdefault(entry.node_id, set()).add(entry.key)

    def commit(self, entries: list[IndexEntry]) -> None:
        entries = [check_entry(e) for e in entries]
        with self._lock:
            now = self._clock()
            for entry in entries:
                self._put(entry, now)

    def lookup(self, keys: list[bytes]) -> list[IndexEntry]:
        keys = check_keys(keys)
        out: list[IndexEntry] = []
        with self._lock:
            now = self._clock()
            for key in keys:
                entry = self._visible(key, now)
                if entry is None:
                    break
                out.append(entry)
        return out

    def get(self, keys: list[bytes]) -> list[IndexEntry | None]:
        keys = check_keys(keys)
        with self._lock:
            now = self._clock()
            return [self._visible(k, now) for k in keys]

    def remove(self, node_id: str, keys: list[bytes]) -> int:
        check_node_id(node_id)
        keys = check_keys(keys)
        with self._lock:
            owned = self._by_node.get(node_id, set())
            gone = [k for k in dict.fromkeys(keys) if k in owned]
            for key in gone:
                owned.discard(key)
                del self._entries[key]
            return len(gone)

    def register_node(self, node_id: str, address: str, ttl_s: float) -> None:
        check_node_id(node_id)
        ttl_s = check_ttl(ttl_s)
        if not isinstance(address, str):
            raise ValueError(f"a node address is a string, got {type(address).__name__}")
        with self._lock:
            self._nodes[node_id] = (address, self._clock() + ttl_s)

    def nodes(self) -> dict[str, str]:
        with self._lock:
            now = self._clock()
            return {n: addr for n, (addr, deadline) in self._nodes.items() if now < deadline}

    def _purge(self, node_id: str) -> int:
        self._nodes.pop(node_id, None)
        owned = self._by_node.pop(node_id, set())
        for key in owned:
            del self._entries[key]
        return len(owned)

    def purge_node(self, node_id: str) -> int:
        check_node_id(node_id)
        with self._lock:
            return self._purge(node_id)

    def purge_dead(self) -> list[str]:
        with self._lock:
            now = self._clock()
            dead = sorted(n for n in self._nodes.keys() | self._by_node.keys() if not self._alive(n, now))
            for node_id in dead:
                self._purge(node_id)
            return dead

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self._by_node.clear()
            self._nodes.clear()
