"""A tensor-parallel rank other than 0: loads its shard, then does what rank 0 broadcasts, step by step.

Started by ``TPExecutor`` as ``python -m engine.parallel.rank`` with its job pickled on stdin; it
prints ``loaded`` on stdout once its shard is in memory. It exits when rank 0 says stop, when a
collective fails (rank 0 died), or when its parent process is gone.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import pickle
import sys
import threading
import time
from datetime import timedelta
from typing import NamedTuple

import torch
from torch.distributed import TCPStore

from engine.kv_blocks import wire_block_shape
from engine.model_runner import ModelRunner
from engine.parallel.executor import (
    DTYPE_CODES,
    IN_POOL,
    OP_AGENT,
    OP_EXPORT,
    OP_IMPORT,
    OP_NOOP,
    OP_PING,
    OP_STEP,
    OP_STOP,
    TIMEOUT_S,
    agent_socket,
    from_words,
)
from engine.parallel.group import RankGroup
from engine.parallel.shard import TPShard
from engine.parallel.staging import Attached
from engine.step_inputs import StepInputs

log = logging.getLogger("tandem.engine.tp")


def main() -> int:
    job = pickle.load(sys.stdin.buffer)
    config, rank, size = job["config"], job["rank"], job["size"]
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank-{rank} %(levelname)s %(message)s")
    _exit_with_parent(job["parent"])
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    runner = ModelRunner(config, TPShard.of(config.model_config, rank, size))
    print("loaded", flush=True)
    store = TCPStore("127.0.0.1", job["port"], size, False, timedelta(seconds=TIMEOUT_S))
    group = RankGroup(rank, size, store, runner.device, TIMEOUT_S)
    runner.model.reduce = group.all_reduce
    try:
        serve(runner, group, job["shm_prefix"], job["pool_name"], job["agent_dir"])
    except Exception as exc:  # rank 0 is gone (or a bug): nothing more to do here
        log.error("leaving: %r", exc)
        return 1
    return 0


def serve(runner: ModelRunner, group: RankGroup, shm_prefix: str, pool_name: str, agent_dir: str) -> None:
    buffers = _Buffers(Attached(shm_prefix), Attached(pool_name, numbered=False))
    stop_agent = None
    try:
        while True:
            words = group.receive()
            op, args = words[0], words[1:]
            if op == OP_STEP:
                runner.run(StepInputs.unpack(args))
            elif op == OP_IMPORT:
                _import(runner, group, buffers, args)
            elif op == OP_EXPORT:
                _export(runner, group, buffers, args)
            elif op == OP_PING:
                t = torch.zeros(args[1], device=runner.device)
                for _ in range(args[0]):
                    group.all_reduce(t)
            elif op == OP_AGENT:
                try:
                    stop_agent = _start_agent(runner, buffers, from_words(args[1:], args[0]).decode(), agent_dir)
                finally:
                    group.barrier()
            elif op == OP_STOP:
                return
            elif op != OP_NOOP:
                raise RuntimeError(f"unknown operation {op} from rank 0")
    finally:
        if stop_agent is not None:
            stop_agent()
        buffers.staging.close()
        buffers.pool.close()


class _Buffers(NamedTuple):
    staging: Attached  # rank 0's own buffer, by number
    pool: Attached  # the engine's staging pool: blocks the connector pulls or pushes, in place


def _start_agent(runner: ModelRunner, buffers: _Buffers, name: str, agent_dir: str):
    """Load the connector's transfer agent by name and start it on this rank's slice of the staging pool;
    its stop function. A rank that cannot start it fails like any rank: the worker dies cleanly."""
    module, function = name.split(":")
    start = getattr(importlib.import_module(module), function)
    mc, s = runner.config.model_config, runner.shard
    block_bytes = math.prod(wire_block_shape(mc, runner.block_size)) * runner.config.torch_dtype.itemsize
    return start(socket_path=agent_socket(agent_dir, s.rank), pool=buffers.pool.get(0), block_bytes=block_bytes,
                 first_kv_head=s.first_kv_head, num_kv_heads=s.num_kv_heads, total_kv_heads=mc.num_kv_heads)


def _blocks(runner: ModelRunner, buffers: _Buffers, where: int, at: int, dtype: torch.dtype, n: int) -> torch.Tensor:
    """``n`` whole blocks: at buffer number ``at`` of rank 0's staging, or from row ``at`` of the pool."""
    block = (*wire_block_shape(runner.config.model_config, runner.block_size),)
    count = math.prod(block)
    if where == IN_POOL:
        buf = buffers.pool.get(0)
        rows = len(buf) // (count * torch.empty((), dtype=dtype).element_size())
        return torch.frombuffer(buf, dtype=dtype, count=rows * count).view(rows, *block)[at : at + n]
    return torch.frombuffer(buffers.staging.get(at), dtype=dtype, count=n * count).view(n, *block)


def _import(runner: ModelRunner, group: RankGroup, buffers: _Buffers, args: list[int]) -> None:
    where, at, dtype, n, ids = args[0], args[1], DTYPE_CODES[args[2]], args[3], args[4:]
    try:
        runner.import_blocks(ids, _blocks(runner, buffers, where, at, dtype, n))
    finally:
        group.barrier()  # rank 0 reuses the buffer after this


def _export(runner: ModelRunner, group: RankGroup, buffers: _Buffers, args: list[int]) -> None:
    where, at, n, ids = args[0], args[1], args[2], args[3:]
    try:
        if runner.shard.owns_kv:  # replicas of a KV head: the first one writes it
            s = runner.shard
            view = _blocks(runner, buffers, where, at, runner.config.torch_dtype, n)
            runner.export_blocks(ids, view[:, s.first_kv_head : s.first_kv_head + s.num_kv_heads])
    finally:
        group.barrier()


def _exit_with_parent(parent: int) -> None:
    """Rank 0 killed outright (SIGKILL) cannot stop its ranks: they notice it is gone and leave."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
