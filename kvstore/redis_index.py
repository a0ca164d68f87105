"""The shared block index on Redis, for several store nodes and every gateway.

Layout under ``prefix`` (default ``tandem:kv:``):

- ``{prefix}b:{hex key}``: string ``node|SSSS…LLLL…CCCC…`` (slot, length and
  checksum as 16 hex digits each), readable with ``redis-cli``.
- ``{prefix}n:{node}:blocks``: set of the entry key names a node owns, so a
  purge does not scan the keyspace.
- ``{prefix}node:{node}``: the node's address with a PX ttl, so "alive" is
  "the key exists" and Redis does the expiring.
- ``{prefix}nodes``: every node id ever seen, so ``purge_dead`` can find the ones
  whose registration expired.

Every write is one Lua script call (one round trip, atomic). A read is one
round trip too: a plain MGET of the entries and a small script naming the alive
nodes, pipelined, with the MGET packed here in one pass (entry names are fixed
width) and the reply parsed by hiredis. redis-py's own packing walks its
arguments in Python (about 0.75 ms for a thousand), and an MGET inside Lua
costs Redis four times the MGET itself: either alone would eat half of the
2 ms budget of a 1,000-key lookup.
"""

from __future__ import annotations

import binascii
import operator
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.commands.core import Script
from redis.retry import Retry

from engine.block_hash import HASH_BYTES
from kvstore.index import (
    BlockIndex,
    IndexEntry,
    IndexUnavailableError,
    check_entry,
    check_keys,
    check_node_id,
    check_ttl,
)

_PURGE_BATCH = 10_000  # entries per purge script call, so one call never blocks Redis for long

# Shared Lua helpers. Undeclared keys are touched on purpose: the index runs on one
# standalone Redis, and building names in the script keeps the arguments small.
_LUA_COMMON = """
local prefix = ARGV[1]
local function owner(v) return string.sub(v, 1, string.find(v, '|', 1, true) - 1) end
local alive_cache = {}
local function alive(node)
  local ok = alive_cache[node]
  if ok == nil then
    ok = redis.call('EXISTS', prefix .. 'node:' .. node) == 1
    alive_cache[node] = ok
  end
  return ok
end
"""

# ARGV: prefix. Reply: ids of the alive nodes (those whose registration has not expired).
# Liveness is answered per node, not per entry: a handful of ids, checked by the client.
_ALIVE = """
local alive = {}
for _, node in ipairs(redis.call('SMEMBERS', ARGV[1] .. 'nodes')) do
  if redis.call('EXISTS', ARGV[1] .. 'node:' .. node) == 1 then alive[#alive + 1] = node end
end
return alive
"""


def _resp(*args: bytes) -> bytes:
    """One command in Redis's wire format."""
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


# ARGV: prefix, lines '{hex key}|{value}' joined by '\n'.
# Keep-first: a key is (re)written unless another, alive node holds it.
_COMMIT = (
    _LUA_COMMON
    + """
local seen = {}
for hex, value in string.gmatch(ARGV[2], '(%x+)|([^\\n]+)') do
  local key, node = prefix .. 'b:' .. hex, owner(value)
  local old = redis.call('GET', key)
  local prev = old and owner(old)
  if not prev or prev == node or not alive(prev) then
    redis.call('SET', key, value)
    redis.call('SADD', prefix .. 'n:' .. node .. ':blocks', key)
    if prev and prev ~= node then redis.call('SREM', prefix .. 'n:' .. prev .. ':blocks', key) end
    if not seen[node] then redis.call('SADD', prefix .. 'nodes', node); seen[node] = true end
  end
end
return 0
"""
)

# ARGV: prefix, node, hex keys back to back. Reply: number removed.
_REMOVE = (
    _LUA_COMMON
    + """
local node, hexes = ARGV[2], ARGV[3]
local blocks = prefix .. 'n:' .. node .. ':blocks'
local n = 0
for i = 1, #hexes, 64 do
  local key = prefix .. 'b:' .. string.sub(hexes, i, i + 63)
  local v = redis.call('GET', key)
  if v and owner(v) == node then
    redis.call('DEL', key)
    redis.call('SREM', blocks, key)
    n = n + 1
  end
end
return n
"""
)

# ARGV: prefix, node, batch size, only_if_dead ('1' or '0').
# Reply: {removed, done}; removed = -1 when the node turned out alive (only_if_dead).
_PURGE = (
    _LUA_COMMON
    + """
local node, batch = ARGV[2], tonumber(ARGV[3])
if ARGV[4] == '1' and alive(node) then return {-1, 1} end
redis.call('DEL', prefix .. 'node:' .. node)
local blocks = prefix .. 'n:' .. node .. ':blocks'
local n = 0
for _, key in ipairs(redis.call('SPOP', blocks, batch)) do
  local v = redis.call('GET', key)
  if v and owner(v) == node then
    redis.call('DEL', key)
    n = n + 1
  end
end
if redis.call('SCARD', blocks) > 0 then return {n, 0} end
redis.call('SREM', prefix .. 'nodes', node)
return {n, 1}
"""
)

# ARGV: prefix. Reply: flat list id, address, id, address... of alive nodes.
_NODES = (
    _LUA_COMMON
    + """
local out = {}
for _, node in ipairs(redis.call('SMEMBERS', prefix .. 'nodes')) do
  local addr = redis.call('GET', prefix .. 'node:' .. node)
  if addr then out[#out + 1] = node; out[#out + 1] = addr end
end
return out
"""
)

# ARGV: prefix. Reply: ids of known nodes without a live registration.
_DEAD = (
    _LUA_COMMON
    + """
local out = {}
for _, node in ipairs(redis.call('SMEMBERS', prefix .. 'nodes')) do
  if not alive(node) then out[#out + 1] = node end
end
return out
"""
)

# ARGV: prefix, node, address, ttl ms.
_REGISTER = """
redis.call('SET', ARGV[1] .. 'node:' .. ARGV[2], ARGV[3], 'PX', ARGV[4])
redis.call('SADD', ARGV[1] .. 'nodes', ARGV[2])
return 0
"""


def _redact(url: str) -> str:
    """The URL for error messages, without its password."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + netloc))


class RedisIndex(BlockIndex):
    """``BlockIndex`` on one standalone Redis, shared by every store node and gateway.

    Constructing it does not connect, so a service can start (and report
    UNAVAILABLE) while Redis is still coming up; every call reconnects as needed
    and re-loads its scripts after a Redis restart (NOSCRIPT).
    """

    def __init__(
        self,
        url: str,
        prefix: str = "tandem:kv:",
        *,
        socket_timeout_s: float = 5.0,
        connect_timeout_s: float = 2.0,
    ) -> None:
        self.url = url
        self.prefix = prefix
        # One immediate retry: it absorbs the stale pooled connection after a Redis restart,
        # while a Redis that is really down fails fast instead of backing off for seconds.
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=connect_timeout_s,
            retry=Retry(NoBackoff(), 1),
        )
        self._prefix_b = prefix.encode()
        self._entry_prefix = self._prefix_b + b"b:"
        self._name_width = len(self._entry_prefix) + 2 * HASH_BYTES
        self._decoder = _Decoder()
        script = self._client.register_script
        self._commit = script(_COMMIT)
        self._alive_command = _resp(b"EVAL", _ALIVE.encode(), b"0", self._prefix_b)
        self._remove, self._purge, self._nodes = script(_REMOVE), script(_PURGE), script(_NODES)
        self._dead, self._register = script(_DEAD), script(_REGISTER)

    @contextmanager
    def _reachable(self) -> Iterator[None]:
        try:
            yield
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise IndexUnavailableError(f"kv index: Redis at {_redact(self.url)} is unavailable ({exc})") from exc

    def _call(self, script: Script, *args: Any) -> Any:
        with self._reachable():
            return script(args=(self._prefix_b, *args))

    def commit(self, entries: list[IndexEntry]) -> None:
        entries = [check_entry(e) for e in entries]
        if entries:
            lines = "\n".join(f"{e.key.hex()}|{_value(e)}" for e in entries)
            self._call(self._commit, lines)

    def _mget_command(self, keys: list[bytes]) -> bytes:
        """``MGET`` of the keys' entry names, packed in one pass: every name has the same width."""
        name = b"$%d\r\n" % self._name_width + self._entry_prefix
        names = b"".join(keys).hex("\n", HASH_BYTES).encode().replace(b"\n", b"\r\n" + name)
        return b"*%d\r\n$4\r\nMGET\r\n" % (len(keys) + 1) + name + names + b"\r\n"

    def _read(self, keys: list[bytes]) -> tuple[list[bytes | None], list[bytes]]:
        """The keys' packed values (None for a miss) and the alive node ids, in one round trip."""
        packed = self._mget_command(keys) + self._alive_command
        with self._reachable():
            try:
                return self._round_trip(packed)
            except redis.ConnectionError:  # a pooled connection gone stale (a Redis restart): once more
                return self._round_trip(packed)

    def _round_trip(self, packed: bytes) -> tuple[Any, Any]:
        """Send two packed commands on one pooled connection; their two replies."""
        pool = self._client.connection_pool
        conn = pool.get_connection()
        try:
            conn.send_packed_command([packed])
            return conn.read_response(), conn.read_response()
        except BaseException:
            conn.disconnect()  # a reply may still be on the wire: never hand this connection on
            raise
        finally:
            pool.release(conn)

    def lookup(self, keys: list[bytes]) -> list[IndexEntry]:
        keys = check_keys(keys)
        if not keys:
            return []
        values, alive = self._read(keys)
        return self._decoder.prefix(keys, values, alive)

    def get(self, keys: list[bytes]) -> list[IndexEntry | None]:
        keys = check_keys(keys)
        if not keys:
            return []
        values, alive = self._read(keys)
        return self._decoder.each(keys, values, alive)

    def remove(self, node_id: str, keys: list[bytes]) -> int:
        check_node_id(node_id)
        keys = check_keys(keys)
        if not keys:
            return 0
        return int(self._call(self._remove, node_id, b"".join(dict.fromkeys(keys)).hex()))

    def register_node(self, node_id: str, address: str, ttl_s: float) -> None:
        check_node_id(node_id)
        ttl_ms = max(1, round(check_ttl(ttl_s) * 1000))
        if not isinstance(address, str):
            raise ValueError(f"a node address is a string, got {type(address).__name__}")
        self._call(self._register, node_id, address, ttl_ms)

    def nodes(self) -> dict[str, str]:
        flat = self._call(self._nodes)
        return {flat[i].decode(): flat[i + 1].decode() for i in range(0, len(flat), 2)}

    def _purge_batches(self, node_id: str, only_if_dead: bool) -> int | None:
        """Purge in bounded batches; None when ``only_if_dead`` and the node came back."""
        total = 0
        while True:
            removed, done = self._call(self._purge, node_id, _PURGE_BATCH, "1" if only_if_dead else "0")
            if removed < 0:
                return None
            total += removed
            if done:
                return total

    def purge_node(self, node_id: str) -> int:
        check_node_id(node_id)
        return self._purge_batches(node_id, only_if_dead=False) or 0

    def purge_dead(self) -> list[str]:
        dead = sorted(n.decode() for n in self._call(self._dead))
        return [n for n in dead if self._purge_batches(n, only_if_dead=True) is not None]

    def close(self) -> None:
        self._client.close()


def _value(e: IndexEntry) -> str:
    """``node|`` then slot, length and checksum as 16 hex digits each: one unhexlify + unpack reads back all."""
    return f"{e.node_id}|{e.slot:016x}{e.length:016x}{e.checksum:016x}"


_new = object.__new__
_set_key, _set_node, _set_slot, _set_length, _set_checksum = (
    IndexEntry.__dict__[f].__set__ for f in ("key", "node_id", "slot", "length", "checksum")
)


def _entry(key: bytes, node_id: str, slot: int, length: int, checksum: int) -> IndexEntry:
    """``IndexEntry(...)`` at half the cost, by setting the slots directly.

    The frozen dataclass ``__init__`` goes through ``object.__setattr__`` per field,
    and building entries is most of a cold 1,000-key lookup's client time.
    """
    e = _new(IndexEntry)
    _set_key(e, key)
    _set_node(e, node_id)
    _set_slot(e, slot)
    _set_length(e, length)
    _set_checksum(e, checksum)
    return e


def _decode(keys: list[bytes], lines: list[bytes]) -> list[IndexEntry]:
    """Packed values -> entries, column-wise (one split, one unhexlify, one unpack for all numbers)."""
    fields = b"|".join(lines).split(b"|")
    nodes = fields[0::2]
    names = {n: n.decode() for n in set(nodes)}
    numbers = struct.unpack(f">{3 * len(nodes)}Q", binascii.unhexlify(b"".join(fields[1::2])))
    return list(map(_entry, keys, map(names.__getitem__, nodes), numbers[0::3], numbers[1::3], numbers[2::3]))


_node_of = operator.attrgetter("node_id")


class _Decoder:
    """Packed values -> entries, memoised on (key, value).

    An entry is a pure function of its key and packed value, so the memo never
    goes stale (a changed entry is a different value), and hot prefixes, a system
    prompt shared by every request, are decoded once instead of on every lookup.
    Cleared when full rather than LRU: bookkeeping per hit would cost what it saves.
    """

    def __init__(self, capacity: int = 1 << 16) -> None:
        self._memo: dict[tuple[bytes, bytes], IndexEntry] = {}
        self._capacity = capacity

    def entries(self, keys: list[bytes], lines: list[bytes]) -> list[IndexEntry]:
        pairs = list(zip(keys, lines, strict=True))
        found = list(map(self._memo.get, pairs))
        if all(found):
            return found  # type: ignore[return-value]  # all() proved there is no None
        entries = _decode(keys, lines)
        if len(self._memo) + len(pairs) > self._capacity:
            self._memo.clear()
        self._memo.update(zip(pairs, entries, strict=False))
        return entries

    def prefix(self, keys: list[bytes], values: list[bytes | None], alive: list[bytes]) -> list[IndexEntry]:
        """Entries of the present prefix, cut at the first miss or entry whose node is dead."""
        n = values.index(None) if None in values else len(values)
        entries = self.entries(keys[:n], values[:n])  # type: ignore[arg-type]  # no None before n
        alive_ids = {a.decode() for a in alive}
        if set(map(_node_of, entries)) <= alive_ids:
            return entries
        return entries[: next(i for i, e in enumerate(entries) if e.node_id not in alive_ids)]

    def each(self, keys: list[bytes], values: list[bytes | None], alive: list[bytes]) -> list[IndexEntry | None]:
        """One answer per key: None for a miss or an entry whose node is dead."""
        present = [(k, v) for k, v in zip(keys, values, strict=True) if v is not None]
        decoded = iter(self.entries([k for k, _ in present], [v for _, v in present]))
        alive_ids = {a.decode() for a in alive}
        out: list[IndexEntry | None] = []
        for v in values:
            e = next(decoded) if v is not None else None
            out.append(e if e is not None and e.node_id in alive_ids else None)
        return out
