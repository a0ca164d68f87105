"""Rank 0 of a tensor-parallel worker: the engine's ``ModelRunner`` when ``tensor_parallel_size > 1``.

One scheduler (the engine's, on rank 0) drives every rank: each step, rank 0 broadcasts the step's
inputs (``StepInputs.pack``, one int64 message) and runs its own shard; the other ranks
(``engine.parallel.rank``, one process each) receive it and run theirs, meeting rank 0 in the
all-reduces of the row-parallel layers. Only rank 0 computes logits and samples.

KV blocks cross between the connector and the ranks through shared memory: the engine's staging pool
(``engine.kv_staging``, shared when there are ranks), where a pull lands and a push is sent from. For an
export every rank writes its heads straight into their byte range of the rows (the wire layout puts a
rank's heads in one contiguous range); for an import every rank copies its range out of them. Blocks
outside the pool (a transfer larger than it) go through a shared buffer of the executor's, which rank 0
fills with the whole blocks first, or copies them out of. The network hop between the pool and the store
is each rank's own too, when the connector names a transfer agent (``start_transfer_agents``): every
rank loads it by name beside its shard, and rank 0's connector asks it to move the rank's heads.

A rank that dies (or a collective that fails) makes the engine dead: every call raises
``EngineDeadError`` from then on, and ``on_dead`` callbacks run once (the worker exits and the gateway
moves its streams elsewhere).
"""

from __future__ import annotations

import logging
import math
import os
import pickle
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
from torch.distributed import TCPStore

from engine.config import EngineConfig
from engine.errors import EngineDeadError
from engine.kv_blocks import wire_block_shape
from engine.kv_staging import StagingPool
from engine.kv_transfer import RankSlice
from engine.model_runner import ModelRunner
from engine.parallel.group import RankGroup
from engine.parallel.shard import TPShard
from engine.parallel.staging import Staging
from engine.scheduler import SchedulerOutput
from engine.step_inputs import StepInputs

log = logging.getLogger("tandem.engine.tp")

OP_STEP, OP_IMPORT, OP_EXPORT, OP_NOOP, OP_STOP, OP_PING, OP_AGENT = range(7)
IN_STAGING, IN_POOL = 0, 1  # where an import's or export's blocks are: the executor's buffer, or the engine's pool
TIMEOUT_S = 60.0  # a collective that takes longer means a rank is stuck: the engine is dead
KEEPALIVE_S = 5.0  # an idle rank 0 sends a no-op this often, so idle ranks never time out
LOAD_TIMEOUT_S = 600.0


class TPExecutor:
    """The engine's view of all ranks; the same surface as ``ModelRunner`` (whose rank-0 shard it holds)."""

    def __init__(self, config: EngineConfig) -> None:
        mc = config.model_config
        self.config, self.size = config, config.tensor_parallel_size
        self.dead: str | None = None  # why, once a rank has died
        self._on_dead: list[Callable[[str], None]] = []
        self._lock = threading.Lock()
        self._shm_prefix = f"tandem-tp-{os.getpid()}-{id(self):x}"
        self._staging = Staging(self._shm_prefix)
        self._agent_dir = tempfile.mkdtemp(prefix="tandem-tp-agents-")  # the ranks' transfer agents' sockets
        self.pool: StagingPool | None = None
        self.in_place_transfers = 0  # imports and exports that went through the pool with no copy on rank 0
        self._last_send = time.monotonic()
        self.store = TCPStore("127.0.0.1", 0, self.size, True, timedelta(seconds=TIMEOUT_S), wait_for_workers=False)
        self.procs = [self._spawn(rank) for rank in range(1, self.size)]
        try:
            self.local = ModelRunner(config, TPShard.of(mc, 0, self.size))
            self._wait_loaded()
            self.group = RankGroup(0, self.size, self.store, self.local.device, TIMEOUT_S)
        except BaseException:
            self._kill()
            raise
        self.local.model.reduce = self.group.all_reduce
        self._stop = threading.Event()
        self._keepalive = threading.Thread(target=self._keep_alive, name="tp-keepalive", daemon=True)
        self._keepalive.start()

    # The ModelRunner surface the engine and the benchmarks read.
    @property
    def model(self):
        return self.local.model

    @property
    def attn(self):
        return self.local.attn

    @attn.setter
    def attn(self, value) -> None:
        self.local.attn = value

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        return self.local.kv_caches

    @property
    def num_blocks(self) -> int:
        return self.local.num_blocks

    @property
    def block_size(self) -> int:
        return self.local.block_size

    @property
    def device(self) -> torch.device:
        return self.local.device

    @property
    def shard(self) -> TPShard:
        return self.local.shard

    def on_dead(self, callback: Callable[[str], None]) -> None:
        """``callback(why)`` once when a rank dies (from whichever thread notices)."""
        self._on_dead.append(callback)
        if self.dead is not None:
            callback(self.dead)

    def execute(self, sched: SchedulerOutput) -> torch.Tensor:
        inputs = StepInputs.of(sched)
        with self._collective("a step"):
            self.group.send([OP_STEP, *inputs.pack()])
            return self.local.run(inputs)

    @property
    def pool_name(self) -> str:
        """The shared-memory name the engine gives its staging pool, which the ranks attach to."""
        return f"{self._shm_prefix}-pool"

    def use_staging(self, pool: StagingPool) -> None:
        """The engine's staging pool (in shared memory): blocks a pull lands in, or an export fills, are
        read and written there by every rank in place, with no copy on rank 0."""
        self.pool = pool

    def import_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Whole blocks in the wire layout: each rank copies its heads out of shared memory, where the
        connector pulled them (the staging pool), or else out of a shared buffer rank 0 fills first."""
        expected = (len(block_ids), *wire_block_shape(self.config.model_config, self.block_size))
        if tuple(data.shape) != expected:
            raise ValueError(f"KV blocks have shape {tuple(data.shape)}, this engine needs {expected}")
        with self._collective("a KV import"):
            row = self.pool.row_of(data) if self.pool is not None and data.dtype == self.pool.buffer.dtype else None
            if row is not None:
                self.in_place_transfers += 1
                self.group.send([OP_IMPORT, IN_POOL, row, _dtype_code(data.dtype), len(block_ids), *block_ids])
                self.local.import_blocks(block_ids, data)
            else:
                name, buf = self._staging.get(data.numel() * data.element_size())
                shared = torch.frombuffer(buf, dtype=data.dtype, count=data.numel()).view(expected)
                shared.copy_(data)
                self.group.send([OP_IMPORT, IN_STAGING, name, _dtype_code(data.dtype), len(block_ids), *block_ids])
                self.local.import_blocks(block_ids, shared)
            self.group.barrier()

    def export_blocks(self, block_ids: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """Whole blocks in the wire layout, each rank having written its own heads into place: into
        ``out`` itself when it is rows of the staging pool, else through a shared buffer."""
        shape = (len(block_ids), *wire_block_shape(self.config.model_config, self.block_size))
        s = self.shard
        heads = slice(s.first_kv_head, s.first_kv_head + s.num_kv_heads)
        with self._collective("a KV export"):
            row = self.pool.row_of(out) if self.pool is not None and out is not None else None
            if row is not None:
                self.in_place_transfers += 1
                self.group.send([OP_EXPORT, IN_POOL, row, len(block_ids), *block_ids])
                self.local.export_blocks(block_ids, out[:, heads])
                self.group.barrier()
                return out
            dtype, count = self.config.torch_dtype, math.prod(shape)
            name, buf = self._staging.get(count * dtype.itemsize)
            shared = torch.frombuffer(buf, dtype=dtype, count=count).view(shape)
            self.group.send([OP_EXPORT, IN_STAGING, name, len(block_ids), *block_ids])
            self.local.export_blocks(block_ids, shared[:, heads])
            self.group.barrier()
            if out is None:
                return shared.clone()  # the connector pushes it later: not a view of a buffer reused meanwhile
            return out.copy_(shared)

    def import_blocks_async(self, block_ids: list[int], data: torch.Tensor) -> Callable[[], None] | None:
        """``import_blocks``, done when it returns: every rank has its heads after the barrier."""
        self.import_blocks(block_ids, data)
        return None

    def export_blocks_async(self, block_ids: list[int], out: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, Callable[[], None] | None]:
        """``export_blocks``, done when it returns: every rank's part is in place after the barrier."""
        return self.export_blocks(block_ids, out), None

    def start_transfer_agents(self, name: str) -> list[RankSlice]:
        """Every other rank loads ``name`` (``module:function``, the connector's ``rank_agent``) and starts it
        beside its shard, listening on a socket of its own; every rank's slice of a block, and its socket."""
        encoded = name.encode()
        with self._collective("starting the KV transfer agents"):
            self.group.send([OP_AGENT, len(encoded), *to_words(encoded)])
            self.group.barrier()  # every agent listens
        slices = []
        for rank in range(self.size):
            s = TPShard.of(self.config.model_config, rank, self.size)
            slices.append(RankSlice(rank, s.first_kv_head, s.num_kv_heads, s.owns_kv,
                                    agent_socket(self._agent_dir, rank) if rank else ""))
        return slices

    def ping(self, times: int, numel: int) -> float:
        """Seconds per all-reduce of ``numel`` float32 values with no compute around it: the collective's
        own latency, which a step's communication time also counts waiting for the slowest rank on top of."""
        with self._collective("a ping"):
            self.group.send([OP_PING, times, numel])
            t = torch.zeros(numel, device=self.device)
            start = time.perf_counter()
            for _ in range(times):
                self.group.all_reduce(t)
            return (time.perf_counter() - start) / times

    def shutdown(self) -> None:
        """Stop the ranks: they finish on ``OP_STOP``; after a death the survivors are killed."""
        self._stop.set()
        if self.dead is None:
            try:
                with self._lock:
                    self.group.send([OP_STOP])
                for p in self.procs:
                    p.wait(timeout=10)
            except Exception:  # a rank is gone or stuck: killed below
                pass
        self._kill()
        self._staging.close()
        shutil.rmtree(self._agent_dir, ignore_errors=True)

    # --- internals

    def _spawn(self, rank: int) -> subprocess.Popen:
        job = pickle.dumps({"config": self.config, "rank": rank, "size": self.size, "port": self.store.port,
                            "shm_prefix": self._shm_prefix, "pool_name": self.pool_name, "parent": os.getpid(),
                            "agent_dir": self._agent_dir})
        proc = subprocess.Popen([sys.executable, "-m", "engine.parallel.rank"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE)
        proc.stdin.write(job)
        proc.stdin.close()
        return proc

    def _wait_loaded(self) -> None:
        """Until every rank has loaded its shard; a rank that exits first fails the engine's build."""
        waiting = {p.stdout.fileno(): (rank, p) for rank, p in enumerate(self.procs, start=1)}
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while waiting:
            ready, _, _ = select.select(list(waiting), [], [], 0.5)
            for fd in ready:
                rank, p = waiting[fd]
                if p.stdout.readline().strip() == b"loaded":
                    del waiting[fd]
            for rank, p in list(waiting.values()):
                if p.poll() is not None:
                    raise RuntimeError(f"tensor-parallel rank {rank} exited with code {p.returncode} while "
                                       "loading its shard (its log is above)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel ranks {sorted(r for r, _ in waiting.values())} did not load "
                                   f"their shards within {LOAD_TIMEOUT_S:.0f} s")

    def _collective(self, what: str):
        return _Collective(self, what)

    def _dead_rank(self) -> str | None:
        for rank, p in enumerate(self.procs, start=1):
            if p.poll() is not None:
                return f"tensor-parallel rank {rank} died (exit code {p.returncode})"
        return None

    def _check_ranks(self) -> None:
        why = self._dead_rank()
        if why is not None:
            self._die(why)

    def _die(self, why: str) -> None:
        first = self.dead is None
        if first:
            self.dead = why
            log.error("the engine is dead: %s", why)
            for callback in self._on_dead:
                callback(why)
        raise EngineDeadError(self.dead)

    def _keep_alive(self) -> None:
        while not self._stop.wait(1.0):
            if self.dead is not None:
                return
            try:
                with self._lock:
                    self._check_ranks()
                    if time.monotonic() - self._last_send >= KEEPALIVE_S:
                        self._send_locked([OP_NOOP])
            except EngineDeadError:
                return

    def _send_locked(self, words: list[int]) -> None:
        try:
            self.group.send(words)
        except Exception as exc:
            self._die(self._dead_rank() or f"a tensor-parallel broadcast failed: {exc!r}")
        self._last_send = time.monotonic()

    def _kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)
            if p.stdout:
                p.stdout.close()


class _Collective:
    """Holds the executor's lock around one operation all ranks take part in. Any failure inside one
    leaves the ranks out of step, so it kills the engine: it comes out as ``EngineDeadError``."""

    def __init__(self, executor: TPExecutor, what: str) -> None:
        self.executor, self.what = executor, what

    def __enter__(self) -> None:
        ex = self.executor
        ex._lock.acquire()
        try:
            if ex.dead is not None:
                raise EngineDeadError(ex.dead)
            ex._check_ranks()
        except BaseException:
            ex._lock.release()
            raise
        ex._last_send = time.monotonic()

    def __exit__(self, kind, exc, tb) -> bool:
        ex = self.executor
        try:
            if isinstance(exc, Exception) and not isinstance(exc, EngineDeadError):
                ex._die(ex._dead_rank() or f"tensor-parallel ranks fell out of step during {self.what}: {exc!r}")
            return False
        finally:
            ex._lock.release()


DTYPE_CODES = (torch.float32, torch.bfloat16, torch.float16)


def agent_socket(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank-{rank}.sock")


def to_words(data: bytes) -> list[int]:
    """Bytes as int64 words for a broadcast (zero-padded; the receiver is told the length)."""
    padded = data.ljust(-(-len(data) // 8) * 8, b"\0")
    return [int.from_bytes(padded[i : i + 8], "little", signed=True) for i in range(0, len(padded), 8)]


def from_words(words: list[int], length: int) -> bytes:
    return b"".join(int(w).to_bytes(8, "little", signed=True) for w in words)[:length]


def _dtype_code(dtype: torch.dtype) -> int:
    return DTYPE_CODES.index(dtype)
