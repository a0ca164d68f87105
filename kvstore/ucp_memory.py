"""The store's pool as UCX-registered memory that readers on the same host map into their own address space.

UCX moves bytes between processes on one host through shared memory: memory
allocated with ``ucp_mem_map(ALLOCATE)`` comes from its shared-memory memory
domains (sysv, then posix), and a peer that unpacks the region's remote key gets
a local pointer to the very same pages from ``ucp_rkey_ptr``. A pull then is one
copy out of the store's pool, with no socket, no second copy and no work on the
store's side at all. This is the one-sided part of UCX that ucxx does not expose
to Python, so it is called here through ctypes, on a UCX context of its own.

Where UCX cannot map the region (another host, another IPC namespace, a pool
that had to come from private memory), ``attach`` returns None and the caller
keeps to the two-sided transfers of ``kvstore.data_plane``.

A region starts with a header page holding the pool's random id; an attach
checks it, so a reader never takes some other memory for the pool. A mapping
outlives the store that made it (the pages are freed when the last process
unmaps them), so a store that dies mid-read leaves stale but intact bytes,
which the caller's lease and checksums deal with, never a crash. The header
also holds a deadline the store keeps pushing forward while it lives
(``keep_alive``): readers drop mappings past it, so a dead store's memory does
not outlive it for long.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import struct
import threading
import time
from collections.abc import Iterator

import numpy as np

from common.settings import env_default

log = logging.getLogger("tandem.kvstore.ucp")

HEADER_BYTES = 4096  # the region's first page: the pool id and the store's liveness deadline, then the slots
POOL_ID_BYTES = 16
_DEADLINE_AT = POOL_ID_BYTES  # float64 wall-clock time until which the store promises to be alive

_API = (1, 21)  # UCP_API_MAJOR / MINOR of the headers these layouts come from (libucx 1.21)
_FEATURE_RMA = 1 << 1
_PARAM_FIELD_FEATURES = 1 << 0
_MEM_MAP_FIELD_LENGTH, _MEM_MAP_FIELD_FLAGS, _MEM_MAP_ALLOCATE = 1 << 1, 1 << 2, 1 << 1
_MEM_ATTR_FIELD_ADDRESS, _MEM_ATTR_FIELD_LENGTH = 1 << 0, 1 << 1
_EP_FIELD_REMOTE_ADDRESS = 1 << 0
_EP_CLOSE_MODE_FORCE = 0
_INPROGRESS = 1
_ERR_LAST = -100
_MADV_POPULATE_READ = 22
_DESCRIPTOR = struct.Struct("<16sQQQII")  # pool id, base address, length, block bytes, rkey / worker-address sizes

_vp = ctypes.c_void_p


class UcpError(RuntimeError):
    pass


def _params(*fields: tuple[int, str, int]) -> ctypes.Array:
    """A zeroed UCX parameter struct with ``(offset, format, value)`` fields set; UCX reads only the
    fields named in its ``field_mask`` (the first), so the rest of the layout need not be spelled out."""
    buf = ctypes.create_string_buffer(256)  # larger than any of them (ucp_ep_params_t: 112 bytes)
    for offset, fmt, value in fields:
        struct.pack_into(fmt, buf, offset, value)
    return buf


class _Ucp:
    """One UCX context and worker of this process for memory mapping (nothing is ever sent on it)."""

    def __init__(self) -> None:
        os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")  # as kvstore.data_plane: nothing on stdout
        import libucx

        libs = libucx.load_library()  # libucs, libucs_signal, libuct, libucp: the copies ucxx uses
        self.ucs, self.lib = libs[0], libs[3]
        self.ucs.ucs_status_string.restype = ctypes.c_char_p
        self.lib.ucp_ep_close_nb.restype = _vp
        self.lib.ucp_rkey_ptr.argtypes = [_vp, ctypes.c_uint64, ctypes.POINTER(_vp)]
        self.lock = threading.Lock()  # the worker is single-threaded: every call on it holds this
        self.context, self.worker = _vp(), _vp()
        params = _params((0, "<Q", _PARAM_FIELD_FEATURES), (8, "<Q", _FEATURE_RMA))
        self.check(self.lib.ucp_init_version(*_API, params, None, ctypes.byref(self.context)), "ucp_init")
        self.check(self.lib.ucp_worker_create(self.context, _params(), ctypes.byref(self.worker)), "worker_create")

    def check(self, status: int, what: str) -> None:
        if status != 0:
            text = self.ucs.ucs_status_string(status).decode()
            raise UcpError(f"{what}: {text} ({status})")

    def worker_address(self) -> bytes:
        address, size = _vp(), ctypes.c_size_t()
        self.check(self.lib.ucp_worker_get_address(self.worker, ctypes.byref(address), ctypes.byref(size)),
                   "worker_get_address")
        try:
            return ctypes.string_at(address, size.value)
        finally:
            self.lib.ucp_worker_release_address(self.worker, address)

    def close_endpoint(self, ep: _vp) -> None:
        """Force-close (nothing was ever sent on it), progressing a pending close for a bounded time."""
        request = self.lib.ucp_ep_close_nb(ep, _EP_CLOSE_MODE_FORCE)
        if request is None or request >= (1 << 64) + _ERR_LAST:
            return
        for _ in range(10_000):
            if self.lib.ucp_request_check_status(_vp(request)) != _INPROGRESS:
                break
            self.lib.ucp_worker_progress(self.worker)
        self.lib.ucp_request_free(_vp(request))


_ucp: _Ucp | None = None
_ucp_lock = threading.Lock()


def _get() -> _Ucp:
    global _ucp
    with _ucp_lock:
        if _ucp is None:
            _ucp = _Ucp()
        return _ucp


def _region_views(address: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """The region's bytes, and the header's liveness deadline (one float64), as arrays over its memory."""
    whole = np.ctypeslib.as_array((ctypes.c_uint8 * length).from_address(address))
    return whole, whole[_DEADLINE_AT:_DEADLINE_AT + 8].view(np.float64)


class SharedRegion:
    """The store side: a region allocated through UCX, its header written, its descriptor ready for readers."""

    def __init__(self, nbytes: int, block_bytes: int, pool_id: bytes) -> None:
        self._ucp = _get()
        self.block_bytes = block_bytes
        self.memh = _vp()
        params = _params((0, "<Q", _MEM_MAP_FIELD_LENGTH | _MEM_MAP_FIELD_FLAGS),
                         (16, "<Q", HEADER_BYTES + nbytes), (24, "<I", _MEM_MAP_ALLOCATE))
        with self._ucp.lock:
            self._ucp.check(self._ucp.lib.ucp_mem_map(self._ucp.context, params, ctypes.byref(self.memh)), "mem_map")
        attr = _params((0, "<Q", _MEM_ATTR_FIELD_ADDRESS | _MEM_ATTR_FIELD_LENGTH))
        self._ucp.check(self._ucp.lib.ucp_mem_query(self.memh, attr), "mem_query")
        self.address, mapped = struct.unpack_from("<QQ", attr, 8)
        self.length = HEADER_BYTES + nbytes
        if mapped < self.length:
            raise UcpError(f"mem_map gave {mapped} bytes, {self.length} asked for")
        whole, self._deadline = _region_views(self.address, self.length)
        whole[:POOL_ID_BYTES] = np.frombuffer(pool_id, dtype=np.uint8)
        self.keep_alive(60.0)
        self.pool_id = pool_id
        self.array = whole[HEADER_BYTES:HEADER_BYTES + nbytes]  # the pool's slots
        self.descriptor = self._describe()

    def keep_alive(self, seconds: float) -> None:
        """Promise readers that this store lives for ``seconds`` more (the store's upkeep renews it)."""
        self._deadline[0] = time.time() + seconds

    def _describe(self) -> bytes:
        rkey, size = _vp(), ctypes.c_size_t()
        lib = self._ucp.lib
        with self._ucp.lock:
            self._ucp.check(lib.ucp_rkey_pack(self._ucp.context, self.memh, ctypes.byref(rkey), ctypes.byref(size)),
                            "rkey_pack")
            try:
                packed = ctypes.string_at(rkey, size.value)
            finally:
                lib.ucp_rkey_buffer_release(rkey)
            worker = self._ucp.worker_address()
        fixed = _DESCRIPTOR.pack(self.pool_id, self.address, self.length, self.block_bytes, len(packed), len(worker))
        return fixed + packed + worker

    def close(self) -> None:
        """Unmap (readers that mapped the region keep its pages until they detach)."""
        if self.memh:
            with self._ucp.lock:
                self._ucp.lib.ucp_mem_unmap(self._ucp.context, self.memh)
            self.memh = _vp()


class MappedRegion:
    """The reader side: a store's pool mapped through UCX, read in place (``block``)."""

    def __init__(self, ucp: _Ucp, ep: _vp, rkey: _vp, pointer: int, length: int, block_bytes: int,
                 pool_id: bytes) -> None:
        self._ucp, self._ep, self._rkey = ucp, ep, rkey
        self.pool_id = pool_id
        whole, self._deadline = _region_views(pointer, length)
        whole.flags.writeable = False
        self.num_slots = (length - HEADER_BYTES) // block_bytes
        self._rows = whole[HEADER_BYTES:HEADER_BYTES + self.num_slots * block_bytes].reshape(-1, block_bytes)
        self._lock = threading.Lock()
        self._readers = 0
        self._closing = False
        _populate(pointer, length, whole)

    def alive(self) -> bool:
        """Whether the store behind the pool has renewed its deadline (``SharedRegion.keep_alive``)."""
        with self._lock:
            return not self._closing and time.time() < float(self._deadline[0])

    @contextlib.contextmanager
    def reading(self) -> Iterator[bool]:
        """Hold the mapping for a read (a ``close`` meanwhile waits for it); yields False if it is closed."""
        with self._lock:
            usable = not self._closing
            self._readers += usable
        try:
            yield usable
        finally:
            if usable:
                with self._lock:
                    self._readers -= 1
                    last = self._closing and self._readers == 0
                if last:
                    self._unmap()

    def block(self, slot: int, length: int) -> np.ndarray | None:
        """A read-only view of a slot's first ``length`` bytes, valid inside ``reading``; None when the
        slot or length is outside the pool."""
        if not (0 <= slot < self.num_slots and 0 < length <= self._rows.shape[1]):
            return None
        return self._rows[slot, :length]

    def close(self) -> None:
        """Drop the mapping once no read holds it (the last reader of a dead store's pool frees its pages)."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            idle = self._readers == 0
        if idle:
            self._unmap()

    def _unmap(self) -> None:
        if self._rkey:
            with self._ucp.lock:
                self._ucp.lib.ucp_rkey_destroy(self._rkey)
                self._ucp.close_endpoint(self._ep)
            self._rkey = _vp()


def attach(descriptor: bytes) -> MappedRegion | None:
    """Map a store's region from its descriptor; None where UCX cannot give a local pointer to it."""
    try:
        pool_id, base, length, block_bytes, rkey_len, worker_len = _DESCRIPTOR.unpack_from(descriptor)
        packed = descriptor[_DESCRIPTOR.size:_DESCRIPTOR.size + rkey_len]
        worker = descriptor[_DESCRIPTOR.size + rkey_len:]
        if len(packed) != rkey_len or len(worker) != worker_len or not 0 < block_bytes <= length - HEADER_BYTES:
            raise UcpError("malformed pool descriptor")
        ucp = _get()
    except (struct.error, UcpError, OSError, ImportError) as exc:
        log.info("no shared-memory mapping of the store's pool: %s", exc)
        return None
    with ucp.lock:
        ep, rkey, pointer = _vp(), _vp(), _vp()
        address = ctypes.create_string_buffer(worker, len(worker))
        params = _params((0, "<Q", _EP_FIELD_REMOTE_ADDRESS), (8, "<Q", ctypes.addressof(address)))
        if ucp.lib.ucp_ep_create(ucp.worker, params, ctypes.byref(ep)) != 0:
            return None
        ok = ucp.lib.ucp_ep_rkey_unpack(ep, packed, ctypes.byref(rkey)) == 0
        ok = ok and ucp.lib.ucp_rkey_ptr(rkey, base, ctypes.byref(pointer)) == 0 and bool(pointer.value)
        ok = ok and ctypes.string_at(pointer.value, POOL_ID_BYTES) == pool_id
        if not ok:  # another host or IPC namespace, or memory UCX could not share
            if rkey:
                ucp.lib.ucp_rkey_destroy(rkey)
            ucp.close_endpoint(ep)
            return None
    return MappedRegion(ucp, ep, rkey, pointer.value, length, block_bytes, pool_id)


def _populate(pointer: int, length: int, whole: np.ndarray) -> None:
    """Fault the mapping's pages in now, so that the first pulls do not pay for it."""
    libc = ctypes.CDLL(None, use_errno=True)
    start = pointer & ~(mmap.PAGESIZE - 1)
    if libc.madvise(_vp(start), ctypes.c_size_t(pointer + length - start), _MADV_POPULATE_READ) != 0:
        int(whole[:: mmap.PAGESIZE].sum())  # kernels before 5.14: one read per page


def shared_memory_enabled() -> bool:
    """``TANDEM_KV_SHARED_MEMORY=0`` keeps the pool private and every transfer on UCX's two-sided path."""
    return env_default("--kv-shared-memory", True)
