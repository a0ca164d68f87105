"""The kvstore's UCX data plane: block bytes between a worker's buffers and the store's pool.

One UCX endpoint per (worker, store node), opened once and reused. A transfer is
a 32-byte header ``[op, n, token]`` (int64 op and count, then the 16-byte token)
and the ``n`` slot numbers; the store answers ACCEPTED or REFUSED (one int64),
then one message per run of consecutive slots follows (``slot_runs``: both sides
cut the same runs from the slot numbers alone), posted all at once (UCX pipelines
them). A chunk of blocks in consecutive slots (the pool hands out sorted slots,
and a fresh pool consecutive ones) is one message, not one per block. The store
sends from and receives into its pool rows directly, so the store side copies
nothing; the worker side sends from and receives into its arrays as they are when
a run's arrays lie back to back in memory (rows of one staging buffer), and
through one joined copy when they do not.

The ranged ops (``OP_WRITE_RANGE``, ``OP_READ_RANGE``) move bytes ``[offset, offset + length)`` of each
slot: a tensor-parallel rank pushes and pulls only its own KV heads, one contiguous byte range of every
block (``engine.parallel``, ``kvstore.rank_agent``), and never handles the other ranks' bytes. After the
slot numbers the client sends one more message, int64 ``[offset, length]``; a range not inside a block
is refused like a bad token. The body is one message per slot (a slice of a row is contiguous, those of
consecutive slots are not adjacent), sent from and received into the caller's arrays as they are.

Which slots a worker may write or read is decided on the control plane, and the
data plane enforces it: ``Reserve`` returns a token for writes into the reserved
slots, a leased ``Lookup`` a token for reads of the leased blocks of that node
(``kvstore.pool``: random 128-bit capabilities that die with their reservation or
lease). The store checks the token against the slots before it touches the pool
(a dict lookup and a set test); without a valid one it answers REFUSED, drops the
connection and counts the transfer (``refused_transfers`` in Stats); the client
raises ``TransferRefusedError`` (a PermissionError).

All UCX work of a process runs on one event loop in its own thread: ucxx
delivers completions as asyncio futures bound to a single loop (the
alternative, polling each pending request, spins a core while idle), so
callers on any loop, or on several, hand their transfers to that one.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import numpy as np

from kvstore.pool import TOKEN_BYTES, BlockPool

T = TypeVar("T")

OP_WRITE = 1
OP_READ = 2
OP_WRITE_RANGE = 3  # bytes [offset, offset + length) of each slot: a tensor-parallel rank's heads
OP_READ_RANGE = 4
OPS = (OP_WRITE, OP_READ, OP_WRITE_RANGE, OP_READ_RANGE)
WRITES = (OP_WRITE, OP_WRITE_RANGE)
RANGED = (OP_WRITE_RANGE, OP_READ_RANGE)
HEADER_WORDS = 2 + TOKEN_BYTES // 8  # op, n, token
ACCEPTED = 1
REFUSED = -1
MAX_BLOCKS_PER_TRANSFER = 1 << 16
MAX_RUN_BYTES = 32 << 20  # the largest data-plane message
# Requests in flight at once on one endpoint. ucxx keeps a pool of 50-100 ready-made Python futures
# for completions; posting more at once empties it (a warning per request, futures made on the spot).
WINDOW = 48


class TransferRefusedError(PermissionError):
    """The store refused a transfer: no valid token for those slots (or the reservation or lease ended)."""


_shutdown_hook = False
_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _ucxx():
    # ucxx sets a variable UCX 1.21 no longer knows, and UCX then warns on stdout. Progress runs in
    # ucxx's own thread and completions reach asyncio as futures (its notifier thread): the other
    # modes poll, every pending receive spinning the event loop (`asyncio.sleep(0)` in a loop), so an
    # idle store with connected workers burns a whole core and starves the engines beside it.
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    # TCP moves a block (hundreds of KB) in segments of UCX's default 8 KB (send) / 64 KB (receive): a
    # syscall and a copy each. 512 KB segments doubled pull throughput on loopback (`tandem bench kv`:
    # 256 blocks 0.8-1.0 -> 1.6-1.9 GB/s); larger ones gained nothing. The environment still wins.
    os.environ.setdefault("UCX_TCP_TX_SEG_SIZE", "512k")
    os.environ.setdefault("UCX_TCP_RX_SEG_SIZE", "512k")
    # A store restarted on its data port while workers still hold connections to the dead one (the
    # kernel keeps that port in FIN_WAIT for a while) could not listen again ("Device is busy").
    os.environ.setdefault("UCX_CM_REUSEADDR", "y")
    os.environ.setdefault("UCXPY_PROGRESS_MODE", "thread")
    os.environ.setdefault("UCXPY_ENABLE_PYTHON_FUTURE", "1")
    import ucxx

    global _shutdown_hook
    if not _shutdown_hook:
        # The notifier thread is not a daemon and runs until told to stop: stop it before the
        # interpreter joins its threads at exit (plain atexit runs after that join, too late).
        threading._register_atexit(ucxx.stop_notifier_thread)
        _shutdown_hook = True
    return ucxx


def _ucx_loop() -> asyncio.AbstractEventLoop:
    """The process's UCX loop, started on first use."""
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="ucx-loop", daemon=True).start()
        return _loop


def _run_sync(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run_coroutine_threadsafe(coro, _ucx_loop()).result()


async def _on_ucx_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on the UCX loop and await it from the caller's loop; cancelling cancels it."""
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, _ucx_loop()))


async def _windowed(n: int, transfer: Callable[[int, int], Awaitable[None]]) -> None:
    """Run ``transfer(start, end)`` over [0, n) in windows of ``WINDOW`` requests, with the
    completion-future pool topped up before each."""
    worker = _ucxx().core._get_ctx().worker  # the notifier's worker: it owns the pool
    for start in range(0, n, WINDOW):
        worker.populate_python_futures_pool()
        await transfer(start, min(n, start + WINDOW))


def slot_runs(slots: list[int], block_bytes: int) -> list[tuple[int, int]]:
    """``(first index, count)`` of each run of consecutive slot numbers, in order, cut at ``MAX_RUN_BYTES``:
    one message each (a few messages in flight keep the link busy while each one lands)."""
    most = max(1, MAX_RUN_BYTES // max(1, block_bytes))
    runs: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1 or i - start == most:
            runs.append((start, i - start))
            start = i
    return runs


def _joined(arrays: list[np.ndarray]) -> np.ndarray | None:
    """One array over ``arrays`` when they lie back to back in memory (rows of one buffer), else None."""
    if len(arrays) == 1:
        return arrays[0]
    first = arrays[0].__array_interface__["data"][0]
    at = first
    for a in arrays:
        if a.__array_interface__["data"][0] != at or not a.flags.c_contiguous:
            return None
        at += a.nbytes
    base = np.ctypeslib.as_array((ctypes.c_uint8 * (at - first)).from_address(first))
    return base  # a view: the caller's arrays keep the memory alive for the transfer


def _status(value: int) -> np.ndarray:
    return np.full(1, value, dtype=np.int64)


def _range_inside(offset: int, length: int, block_bytes: int) -> bool:
    """Whether ``[offset, offset + length)`` is a non-empty range inside one block: the store slices its
    pool rows with it, so a range past the row would move fewer bytes (or another slot's) silently."""
    return 0 <= offset and length > 0 and offset + length <= block_bytes


def _check_slices(arrays: list[np.ndarray], slots: list[int], byte_range: tuple[int, int]) -> None:
    """Raise ValueError unless ``arrays`` are one contiguous 1-D uint8 array of ``length`` bytes per slot:
    each is one message, sent from or received into as it is (no copy to hide a wrong shape)."""
    _, length = byte_range
    if len(arrays) != len(slots):
        raise ValueError(f"{len(slots)} slots but {len(arrays)} arrays")
    for a in arrays:
        if a.dtype != np.uint8 or a.ndim != 1 or not a.flags.c_contiguous or a.nbytes != length:
            raise ValueError(f"a ranged transfer needs contiguous 1-D uint8 arrays of {length} bytes, "
                             f"got {a.dtype} {a.shape} (contiguous: {a.flags.c_contiguous})")


class DataPlaneServer:
    """Serves one pool over a UCX listener, on the process's UCX loop; every transfer needs a token
    of that pool (``BlockPool.begin_transfer``)."""

    def __init__(self, pool: BlockPool, on_bytes: Callable[[int, int], None] | None = None) -> None:
        self.pool = pool
        self.buffer = pool.buffer  # [num_slots, block_bytes] uint8
        self.on_bytes = on_bytes or (lambda received, sent: None)
        self._listener = None

    def start(self, port: int = 0) -> int:
        """Listen on ``port`` (0: a free one); connections are served on the UCX loop."""
        self._listener = _run_sync(self._listen(port))
        return self._listener.port

    async def _listen(self, port: int):
        return _ucxx().create_listener(self._handle, port, endpoint_error_handling=True)

    def close(self) -> None:
        if self._listener is not None:
            _ucx_loop().call_soon_threadsafe(self._listener.close)
            self._listener = None

    async def _handle(self, ep) -> None:
        header = np.empty(HEADER_WORDS, dtype=np.int64)
        try:
            while True:
                header.fill(0)  # a shorter message must not leave an earlier token behind
                await ep.recv(header)
                if not await self._serve(ep, header):
                    return
        except Exception:  # the peer closed or died mid-transfer: its reservation or lease expires
            return
        finally:
            await _close(ep)

    async def _serve(self, ep, header: np.ndarray) -> bool:
        """Serve one transfer; False when it was refused (the caller then drops the connection)."""
        op, n = int(header[0]), int(header[1])
        if op not in OPS or not 0 < n <= MAX_BLOCKS_PER_TRANSFER:
            self.pool.refuse_transfer()
            return False  # a peer that does not speak the protocol: drop the connection
        slots = np.empty(n, dtype=np.int64)
        await ep.recv(slots)
        wanted = slots.tolist()
        span = await self._recv_range(ep, op)
        if span is None:  # counted here: the pool is never asked
            self.pool.refuse_transfer()
            await ep.send(_status(REFUSED))
            return False
        write = op in WRITES
        grant = self.pool.begin_transfer(header[2:].tobytes(), wanted, write=write)
        if grant is None:  # no valid token for these slots: the pool is not touched
            await ep.send(_status(REFUSED))
            return False
        rows = self._rows(wanted, span) if op in RANGED else self._runs(wanted)
        complete = False
        try:
            await ep.send(_status(ACCEPTED))
            await (self._serve_write if write else self._serve_read)(ep, rows)
            complete = True
        finally:
            self.pool.end_transfer(grant)
            if write and not complete:  # a writer gone mid-write never commits
                self.pool.abandon(grant)
        if write:  # after end_transfer: the writer commits as soon as it has this
            await ep.send(np.ones(1, dtype=np.int64))  # every byte is in the pool
        return True

    async def _recv_range(self, ep, op: int) -> tuple[int, int] | None:
        """``(offset, length)`` of each slot the transfer moves: the whole row for OP_WRITE and OP_READ,
        the client's ``[offset, length]`` message for the ranged ops; None when that is not inside a block."""
        block_bytes = self.buffer.shape[1]
        if op not in RANGED:
            return 0, block_bytes
        span = np.zeros(2, dtype=np.int64)  # zeros: a shorter message reads as length 0, refused
        await ep.recv(span)
        offset, length = int(span[0]), int(span[1])
        return (offset, length) if _range_inside(offset, length, block_bytes) else None

    def _runs(self, slots: list[int]) -> list[np.ndarray]:
        """Whole rows, one message per run of consecutive slots (``slot_runs``)."""
        return [self.buffer[slots[i] : slots[i] + k].reshape(-1) for i, k in slot_runs(slots, self.buffer.shape[1])]

    def _rows(self, slots: list[int], span: tuple[int, int]) -> list[np.ndarray]:
        """Each slot's ``(offset, length)`` slice of its row, one message each: slices of consecutive rows
        are not adjacent (a row's other bytes lie between), so no run is one message."""
        offset, length = span
        return [self.buffer[s, offset : offset + length] for s in slots]

    async def _serve_write(self, ep, rows: list[np.ndarray]) -> None:
        async def window(a: int, b: int) -> None:
            # Post the window's receives first, then let the writer go: blocks land in expected
            # receives (straight into the pool) instead of UCX's unexpected-message buffers.
            receives = [asyncio.ensure_future(ep.recv(row)) for row in rows[a:b]]
            await ep.send(np.ones(1, dtype=np.int64))
            await asyncio.gather(*receives)

        await _windowed(len(rows), window)
        self.on_bytes(sum(r.nbytes for r in rows), 0)

    async def _serve_read(self, ep, rows: list[np.ndarray]) -> None:
        await _windowed(len(rows), lambda a, b: asyncio.gather(*(ep.send(row) for row in rows[a:b])))
        self.on_bytes(0, sum(r.nbytes for r in rows))


def _header(op: int, token: bytes, n: int) -> np.ndarray:
    if len(token) not in (0, TOKEN_BYTES):
        raise ValueError(f"a data-plane token is {TOKEN_BYTES} bytes, got {len(token)}")
    header = np.zeros(HEADER_WORDS, dtype=np.int64)
    header[0], header[1] = op, n
    header[2:] = np.frombuffer(bytes(token).ljust(TOKEN_BYTES, b"\0"), dtype=np.int64)
    return header


async def _refused(answer: asyncio.Future, status: np.ndarray) -> bool:
    """Whether the store said REFUSED before the connection went (waiting briefly for its answer)."""
    if not answer.done():
        await asyncio.wait([answer], timeout=1.0)
    if not answer.done():
        answer.cancel()
        return False
    return not answer.cancelled() and answer.exception() is None and status[0] == REFUSED


def _refusal(address: str, status: np.ndarray) -> str:
    return (f"the store at {address} refused the transfer (answer {int(status[0])}): no valid token for "
            "these slots, or the reservation or lease behind it ended")


async def _close(ep) -> None:
    try:
        await ep.close()
    except Exception:
        pass


async def _send_windowed(ep, messages: list[np.ndarray]) -> None:
    """A write's body: each window sent once the store has posted its receives (its ack), then the
    store's final ack (every byte is in the pool)."""
    ack = np.zeros(1, dtype=np.int64)

    async def window(a: int, b: int) -> None:
        await ep.recv(ack)  # the store has posted this window's receives
        await asyncio.gather(*(ep.send(x) for x in messages[a:b]))

    await _windowed(len(messages), window)
    await ep.recv(ack)


async def _recv_windowed(ep, targets: list[np.ndarray]) -> None:
    """A read's body: one receive per message, ``WINDOW`` posted at a time."""
    await _windowed(len(targets), lambda a, b: asyncio.gather(*(ep.recv(x) for x in targets[a:b])))


class DataPlaneClient:
    """A worker's endpoints to store nodes, one per data address, opened on first use."""

    def __init__(self) -> None:
        self._eps: dict[str, object] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def _endpoint(self, address: str):
        ep = self._eps.get(address)
        if ep is None or ep.closed:
            host, port = address.rsplit(":", 1)
            ep = await _ucxx().create_endpoint(host, int(port), endpoint_error_handling=True)
            self._eps[address] = ep
        return ep

    async def connect(self, address: str) -> None:
        await _on_ucx_loop(self._connect(address))

    async def _connect(self, address: str) -> None:
        async with self._locks.setdefault(address, asyncio.Lock()):
            await self._endpoint(address)

    @contextlib.asynccontextmanager
    async def _transfer(self, address: str, op: int, token: bytes, slots: list[int],
                        byte_range: tuple[int, int] | None = None) -> AsyncIterator[object]:
        """One transfer on the node's endpoint: the header sent (and ``byte_range`` for the ranged ops),
        the endpoint yielded for the body.

        A write starts once the store accepted it; a read posts its receives at once (the store's
        answer is matched first, the blocks follow it). A refusal raises TransferRefusedError, any
        other failure ConnectionError; both drop the endpoint (the next transfer reconnects).
        """
        header = _header(op, token, len(slots))
        async with self._locks.setdefault(address, asyncio.Lock()):
            ep = await self._endpoint(address)
            status = np.zeros(1, dtype=np.int64)
            answer = None
            try:
                await ep.send(header)
                await ep.send(np.asarray(slots, dtype=np.int64))
                if byte_range is not None:
                    await ep.send(np.asarray(byte_range, dtype=np.int64))
                answer = asyncio.ensure_future(ep.recv(status))
                if op in WRITES:
                    await answer
                    if status[0] != ACCEPTED:
                        raise TransferRefusedError(_refusal(address, status))
                yield ep
                await answer
            except TransferRefusedError:
                self._eps.pop(address, None)
                raise
            except Exception as exc:
                self._eps.pop(address, None)
                if answer is not None and await _refused(answer, status):  # the store dropped a refused read
                    raise TransferRefusedError(_refusal(address, status)) from exc
                raise ConnectionError(f"UCX transfer with {address} failed: {exc}") from exc

    async def write(self, address: str, token: bytes, slots: list[int], blocks: list[np.ndarray],
                    byte_range: tuple[int, int] | None = None) -> None:
        """Send ``blocks`` into ``slots`` of the node at ``address`` under ``token`` (its Reserve's);
        returns once they are in its pool.

        With ``byte_range=(offset, length)`` only bytes ``[offset, offset + length)`` of each slot are
        written (a tensor-parallel rank's heads), each of ``blocks`` being a contiguous 1-D uint8 array of
        ``length`` bytes (ValueError otherwise); the rest of each slot is left as it is.
        """
        if byte_range is None:
            await _on_ucx_loop(self._write(address, token, slots, blocks))
            return
        _check_slices(blocks, slots, byte_range)
        await _on_ucx_loop(self._write_range(address, token, slots, blocks, byte_range))

    async def _write(self, address: str, token: bytes, slots: list[int], blocks: list[np.ndarray]) -> None:
        messages = []
        for i, k in slot_runs(slots, blocks[0].nbytes):
            run = blocks[i : i + k]
            joined = _joined(run)
            messages.append(joined if joined is not None else np.concatenate(run))
        async with self._transfer(address, OP_WRITE, token, slots) as ep:
            await _send_windowed(ep, messages)

    async def _write_range(self, address: str, token: bytes, slots: list[int], slices: list[np.ndarray],
                           byte_range: tuple[int, int]) -> None:
        async with self._transfer(address, OP_WRITE_RANGE, token, slots, byte_range) as ep:
            await _send_windowed(ep, slices)  # one message per slot, straight from the caller's arrays

    async def read(self, address: str, token: bytes, slots: list[int], out: list[np.ndarray],
                   byte_range: tuple[int, int] | None = None) -> None:
        """Fill ``out`` (contiguous uint8 arrays of one block each) from ``slots`` of the node, under
        ``token`` (the lease token of that node's Lookup).

        With ``byte_range=(offset, length)`` only bytes ``[offset, offset + length)`` of each slot are
        read, each of ``out`` being a contiguous 1-D uint8 array of ``length`` bytes (ValueError
        otherwise), received into directly.
        """
        if byte_range is None:
            await _on_ucx_loop(self._read(address, token, slots, out))
            return
        _check_slices(out, slots, byte_range)
        await _on_ucx_loop(self._read_range(address, token, slots, out, byte_range))

    async def _read(self, address: str, token: bytes, slots: list[int], out: list[np.ndarray]) -> None:
        targets = []  # where each run's message lands: the caller's rows when back to back, else a buffer
        scattered = []  # (buffer, the rows it is copied out to) for runs whose rows are apart
        for i, k in slot_runs(slots, out[0].nbytes):
            rows = out[i : i + k]
            target = _joined(rows)
            if target is None:
                target = np.empty(sum(o.nbytes for o in rows), dtype=np.uint8)
                scattered.append((target, rows))
            targets.append(target)
        async with self._transfer(address, OP_READ, token, slots) as ep:
            await _recv_windowed(ep, targets)
        for target, rows in scattered:
            at = 0
            for o in rows:
                o[:] = target[at : at + o.nbytes]
                at += o.nbytes

    async def _read_range(self, address: str, token: bytes, slots: list[int], out: list[np.ndarray],
                          byte_range: tuple[int, int]) -> None:
        async with self._transfer(address, OP_READ_RANGE, token, slots, byte_range) as ep:
            await _recv_windowed(ep, out)  # one message per slot, straight into the caller's arrays

    async def close(self) -> None:
        await _on_ucx_loop(self._close_all())

    async def _close_all(self) -> None:
        for ep in self._eps.values():
            await _close(ep)
        self._eps.clear()
