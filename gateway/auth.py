"""API keys at the gateway: who is calling, and whether they may call now.

A keys file (``--api-keys-file``, env ``TANDEM_API_KEYS_FILE``; YAML or JSON) lists one entry per key::

    keys:
      - name: team-a                 # what logs, spans and metrics show; the key itself never appears
        sha256: 9f86d08...           # hex SHA-256 of the key (`tandem keys add NAME` writes it)
        requests_per_minute: 600     # optional: a token bucket (a minute's worth may come at once)
        max_concurrent_streams: 16   # optional: Generate streams open at once
        cache_salt: team-a           # optional: the tenant's cache namespace (default: the key's name)
        share_cache: false           # optional: true: the client's cache_salt alone, shared with other such keys

Clients send ``authorization: Bearer <key>`` (or ``x-api-key: <key>``) metadata. A missing or unknown key gets
UNAUTHENTICATED, a key past one of its limits RESOURCE_EXHAUSTED naming the limit. Without a keys file
there is no authentication (local use). The file is read again when it changes (a Kubernetes Secret update).

Keys are 256-bit random strings, so a plain SHA-256 is a safe hash at rest: a slow, salted hash guards secrets
people choose, and would make every unauthenticated call cost the gateway CPU time. The presented key's hash is
compared with every entry in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import os
import re
import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

log = logging.getLogger("tandem.gateway.auth")

KEY_PREFIX = "tdm_"
NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
FIELDS = {"name", "sha256", "requests_per_minute", "max_concurrent_streams", "cache_salt", "share_cache"}
# Tenant salts hold a NUL, which validation refuses in a client's cache_salt: a client of a share_cache key
# cannot pick a salt that lands in another tenant's blocks.
TENANT_SALT = "tenant\x00{}\x00{}"
RETRY_AFTER = "retry-after"  # trailing metadata of a refusal: seconds until a retry may be admitted
RETRY_AFTER_BUSY_S = 1.0  # the retry hint of a refusal for streams in flight (they end at their own pace)


class AuthError(Exception):
    """Ends the call with ``code``; the message names the key's name at most, never the key."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after = retry_after  # seconds until a retry can succeed, when the refusal knows


class KeysFileError(ValueError):
    """The keys file cannot be used; the message says where."""


@dataclass(frozen=True, slots=True)
class ApiKey:
    name: str
    digest: bytes  # SHA-256 of the key
    requests_per_minute: float | None = None
    max_concurrent_streams: int | None = None
    cache_salt: str | None = None  # None: the key's name
    share_cache: bool = False

    def salt(self, client_salt: str) -> str:
        """The cache_salt requests of this key run under: the tenant's namespace, then the client's own salt."""
        if self.share_cache:
            return client_salt
        return TENANT_SALT.format(self.cache_salt if self.cache_salt is not None else self.name, client_salt)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def parse_keys(doc: Any) -> list[ApiKey]:
    """The entries of a keys file's content (``{"keys": [...]}`` or the list alone)."""
    entries = doc.get("keys") if isinstance(doc, dict) else doc
    if entries is None:
        entries = []
    if not isinstance(entries, list):
        raise KeysFileError("expected a list of keys, or a mapping with a `keys` list")
    keys, names, digests = [], set(), set()
    for i, entry in enumerate(entries):
        key = _parse_entry(i, entry)
        if key.name in names:
            raise KeysFileError(f"keys[{i}]: the name {key.name!r} is used twice")
        if key.digest in digests:
            raise KeysFileError(f"keys[{i}] ({key.name}): the same key hash as another entry")
        names.add(key.name)
        digests.add(key.digest)
        keys.append(key)
    return keys


def _parse_entry(i: int, entry: Any) -> ApiKey:
    if not isinstance(entry, dict):
        raise KeysFileError(f"keys[{i}]: expected a mapping with name and sha256")
    unknown = set(entry) - FIELDS
    if unknown:
        raise KeysFileError(f"keys[{i}]: unknown fields {sorted(map(str, unknown))}; known: {sorted(FIELDS)}")
    name = entry.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise KeysFileError(f"keys[{i}]: name must be 1-64 characters of A-Z a-z 0-9 . _ -")
    where = f"keys[{i}] ({name})"
    digest = entry.get("sha256")
    if not isinstance(digest, str) or not SHA256_HEX.fullmatch(digest.lower()):
        raise KeysFileError(f"{where}: sha256 must be the 64 hex digits of the key's SHA-256")
    rpm = entry.get("requests_per_minute")
    if rpm is not None and (isinstance(rpm, bool) or not isinstance(rpm, int | float) or not 0 < rpm < math.inf):
        raise KeysFileError(f"{where}: requests_per_minute must be a number > 0")
    streams = entry.get("max_concurrent_streams")
    if streams is not None and (isinstance(streams, bool) or not isinstance(streams, int) or streams < 1):
        raise KeysFileError(f"{where}: max_concurrent_streams must be an integer >= 1")
    salt = entry.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt.isprintable() or len(salt) > 256):
        raise KeysFileError(f"{where}: cache_salt must be at most 256 printable characters")
    share = entry.get("share_cache", False)
    if not isinstance(share, bool):
        raise KeysFileError(f"{where}: share_cache must be true or false")
    if share and salt is not None:
        raise KeysFileError(f"{where}: give cache_salt or share_cache, not both")
    return ApiKey(name, bytes.fromhex(digest), rpm, streams, salt, share)


def read_keys_file(path: str | Path) -> list[ApiKey]:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise KeysFileError(f"cannot read the API keys file {path}: {exc.strerror or exc}") from exc
    try:
        doc = _parse_doc(path, text)
    except ValueError as exc:  # json.JSONDecodeError and yaml.YAMLError (wrapped below)
        raise KeysFileError(f"{path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {exc}") from exc
    try:
        return parse_keys(doc)
    except KeysFileError as exc:
        raise KeysFileError(f"{path}: {exc}") from exc


def _parse_doc(path: Path, text: str) -> Any:
    return json.loads(text) if path.suffix == ".json" else _yaml(text)


def _yaml(text: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(str(exc)) from exc


def add_key(path: str | Path, name: str, requests_per_minute: float | None = None,
            max_concurrent_streams: int | None = None, cache_salt: str | None = None,
            share_cache: bool = False) -> str:
    """Append a new key's entry to the keys file (created if missing) and return the key, which is stored
    nowhere: the caller shows it once."""
    path = Path(path)
    doc: Any = {"keys": []}
    if path.exists():
        read_keys_file(path)  # refuse to extend a file the gateway would refuse
        doc = _parse_doc(path, path.read_text()) or {"keys": []}
        if isinstance(doc, list):
            doc = {"keys": doc}
        doc["keys"] = doc.get("keys") or []
    if isinstance(requests_per_minute, float) and requests_per_minute.is_integer():
        requests_per_minute = int(requests_per_minute)
    key = new_key()
    entry: dict[str, Any] = {"name": name, "sha256": hash_key(key)}
    for field_name, value in (("requests_per_minute", requests_per_minute),
                              ("max_concurrent_streams", max_concurrent_streams), ("cache_salt", cache_salt)):
        if value is not None:
            entry[field_name] = value
    if share_cache:
        entry["share_cache"] = True
    doc["keys"].append(entry)
    parse_keys(doc)  # the same checks the gateway makes, before anything is written
    _write_private(path, doc)
    return key


def _write_private(path: Path, doc: Any) -> None:
    """Write through a temporary file readable by its owner only, then rename it over the old one."""
    if path.suffix == ".json":
        text = json.dumps(doc, indent=2) + "\n"
    else:
        import yaml

        text = yaml.safe_dump(doc, sort_keys=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def presented_key(metadata: Iterable[tuple[str, Any]] | None) -> str | None:
    """The key in ``authorization: Bearer <key>`` or ``x-api-key: <key>``; None when neither is there."""
    bearer = api_key = None
    for name, value in metadata or ():
        if not isinstance(value, str):
            continue
        if name == "authorization" and bearer is None:
            scheme, _, rest = value.strip().partition(" ")
            if scheme.lower() == "bearer":
                bearer = rest.strip()
        elif name == "x-api-key" and api_key is None:
            api_key = value.strip()
    return bearer or api_key or None


@dataclass(slots=True)
class TokenBucket:
    """``rate`` tokens a second, at most ``capacity`` saved up."""

    rate: float
    capacity: float
    tokens: float
    updated: float

    def take(self, now: float) -> float:
        """0.0 if a token was taken, else the seconds until one is there."""
        self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.rate


@dataclass(slots=True)
class Usage:
    streams: int = 0
    bucket: TokenBucket | None = None


class Lease:
    """One admitted stream of a key; ``release`` when the call ends (idempotent)."""

    def __init__(self, usage: Usage | None) -> None:
        self._usage = usage

    def release(self) -> None:
        if self._usage is not None:
            self._usage.streams -= 1
            self._usage = None


@dataclass(slots=True)
class KeyRing:
    """The keys of one keys file, read again when the file changes, with each key's limits' state."""

    path: Path
    reload_interval_s: float = 1.0
    clock: Callable[[], float] = time.monotonic
    keys: list[ApiKey] = field(default_factory=list)
    usage: dict[str, Usage] = field(default_factory=dict)
    _signature: tuple[int, int, int] | None = None
    _checked: float = -math.inf
    _failed: str | None = None

    @classmethod
    def load(cls, path: str | Path, reload_interval_s: float = 1.0,
             clock: Callable[[], float] = time.monotonic) -> KeyRing:
        """Raises KeysFileError when the file cannot be used: the gateway does not start then."""
        ring = cls(Path(path), reload_interval_s, clock)
        ring._signature = ring._stat()
        ring.keys = read_keys_file(ring.path)
        ring._checked = clock()
        if not ring.keys:
            log.warning("the API keys file %s has no keys: every call is refused", ring.path)
        log.info("API keys: %d loaded from %s", len(ring.keys), ring.path)
        return ring

    def authenticate(self, metadata: Sequence[tuple[str, Any]] | None) -> ApiKey:
        self._maybe_reload()
        key = presented_key(metadata)
        if key is None:
            raise AuthError(grpc.StatusCode.UNAUTHENTICATED,
                            "this gateway needs an API key: send the metadata `authorization: Bearer <key>`")
        digest = hashlib.sha256(key.encode("utf-8", "replace")).digest()
        found = None
        for entry in self.keys:  # no early exit: the time does not depend on which entry matches
            if hmac.compare_digest(digest, entry.digest):
                found = entry
        if found is None:
            raise AuthError(grpc.StatusCode.UNAUTHENTICATED, "the API key is not valid")
        return found

    def admit(self, key: ApiKey) -> Lease:
        """Count one new stream against the key's limits; RESOURCE_EXHAUSTED naming the limit when over one."""
        usage = self.usage.setdefault(key.name, Usage())
        if key.max_concurrent_streams is not None and usage.streams >= key.max_concurrent_streams:
            raise AuthError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"API key {key.name!r} has {usage.streams} streams open, its limit of concurrent "
                            f"streams is {key.max_concurrent_streams}; retry when one ends", RETRY_AFTER_BUSY_S)
        if key.requests_per_minute is not None:
            wait = self._bucket(usage, key.requests_per_minute).take(self.clock())
            if wait > 0:
                raise AuthError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"API key {key.name!r} is over its rate limit of {key.requests_per_minute:g} "
                                f"requests per minute; retry in {wait:.1f} s", wait)
        usage.streams += 1
        return Lease(usage)

    def _bucket(self, usage: Usage, rpm: float) -> TokenBucket:
        rate, capacity = rpm / 60.0, max(1.0, rpm)
        b = usage.bucket
        if b is None:
            b = usage.bucket = TokenBucket(rate, capacity, capacity, self.clock())
        elif (b.rate, b.capacity) != (rate, capacity):  # the limit changed in the file
            b.rate, b.capacity, b.tokens = rate, capacity, min(b.tokens, capacity)
        return b

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)  # follows symlinks: a Secret volume swaps its ..data link on updates
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _maybe_reload(self) -> None:
        now = self.clock()
        if now - self._checked < self.reload_interval_s:
            return
        self._checked = now
        signature = self._stat()
        if signature == self._signature:
            return
        self._signature = signature
        try:
            keys = read_keys_file(self.path)
        except KeysFileError as exc:
            message = str(exc)
            if message != self._failed:  # once per change, not once per call
                log.error("the API keys file changed but cannot be used (%s); keeping the %d keys loaded before",
                          message, len(self.keys))
            self._failed = message
            return
        self._failed = None
        self.keys = keys
        names = {k.name for k in keys}
        self.usage = {n: u for n, u in self.usage.items() if n in names or u.streams}
        log.info("API keys: %d loaded from %s (the file changed)", len(keys), self.path)
