"""The ranks of one worker as a process group: the all-reduce the model calls, and the one broadcast
per step that carries rank 0's orders to the others.

The group is a gloo (CPU) or NCCL (CUDA) backend built on its own ``TCPStore``, not
``torch.distributed``'s global default group: two engines in one process (a test, a draft model
beside its target) each keep their own ranks.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
from torch.distributed import TCPStore

# Words of the fixed-size broadcast buffer: a step of up to a few hundred sequences fits in one
# broadcast; a larger message follows in a second one, whose size the first announced.
MESSAGE_WORDS = 8192


class RankGroup:
    def __init__(self, rank: int, size: int, store: TCPStore, device: torch.device, timeout_s: float) -> None:
        timeout = timedelta(seconds=timeout_s)
        if device.type == "cuda":
            from torch.distributed import ProcessGroupNCCL

            self.pg = ProcessGroupNCCL(store, rank, size, timeout)
        else:
            from torch.distributed import ProcessGroupGloo

            self.pg = ProcessGroupGloo(store, rank, size, timeout)
        self.rank, self.size, self.device = rank, size, device
        self._buffer = torch.zeros(MESSAGE_WORDS, dtype=torch.int64, device=device)
        self._parts: dict[tuple, torch.Tensor] = {}
        self.comm_seconds = 0.0  # time spent in collectives, for `tandem bench tp`
        self.comm_calls = 0
        self.comm_bytes = 0

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum ``t`` in place over the ranks (the row-parallel layers' partial outputs).

        On CPU it is an all-gather and a local sum in rank order (so every rank gets the same bits):
        gloo's ring all-reduce takes several round trips and measured 1.0-2.0 ms between two processes
        here, its all-gather 0.5-0.7 ms. NCCL's all-reduce is the right call on CUDA.
        """
        start = time.perf_counter()
        if self.device.type == "cuda":
            self.pg.allreduce([t]).wait()
        else:
            parts = self._gathered(t)
            self.pg.allgather([list(parts)], [t]).wait()
            torch.sum(parts, dim=0, out=t)
        self._count(start, t.numel() * t.element_size())

    def _gathered(self, t: torch.Tensor) -> torch.Tensor:
        """A reused ``[size, *t.shape]`` buffer for the all-gather."""
        key = (tuple(t.shape), t.dtype)
        buf = self._parts.get(key)
        if buf is None:
            if len(self._parts) > 64:  # batch shapes vary: keep the cache small
                self._parts.clear()
            buf = self._parts[key] = torch.empty((self.size, *t.shape), dtype=t.dtype, device=t.device)
        return buf

    def barrier(self) -> None:
        self.all_reduce(torch.zeros(1, device=self.device))

    def send(self, words: list[int]) -> None:
        """Rank 0: broadcast a message of int64 words (one broadcast, two when it is long)."""
        start = time.perf_counter()
        n = len(words)
        buf = self._buffer
        head = min(n, MESSAGE_WORDS - 1)
        buf[0] = n
        buf[1 : 1 + head] = torch.tensor(words[:head], dtype=torch.int64)
        self.pg.broadcast(buf, 0).wait()
        if n > head:
            self.pg.broadcast(torch.tensor(words[head:], dtype=torch.int64, device=self.device), 0).wait()
        self._count(start, 8 * (n + 1))

    def receive(self) -> list[int]:
        """Ranks > 0: the next message rank 0 sent."""
        buf = self._buffer
        self.pg.broadcast(buf, 0).wait()
        n = int(buf[0])
        head = min(n, MESSAGE_WORDS - 1)
        words = buf[1 : 1 + head].tolist()
        if n > head:
            rest = torch.empty(n - head, dtype=torch.int64, device=self.device)
            self.pg.broadcast(rest, 0).wait()
            words += rest.tolist()
        return words

    def _count(self, start: float, nbytes: int) -> None:
        self.comm_seconds += time.perf_counter() - start
        self.comm_calls += 1
        self.comm_bytes += nbytes
