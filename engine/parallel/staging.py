"""The shared-memory buffer through which a tensor-parallel worker's ranks exchange KV blocks with the
connector: rank 0 owns it, the other ranks attach to it by name.

It is kept between transfers and only grows (to the next power of two): a fresh segment per transfer
costs its page faults every time, 8x the copy itself at 256 blocks of SmolLM2 on this machine.
"""

from __future__ import annotations

import contextlib
from multiprocessing import resource_tracker, shared_memory


class Staging:
    """Rank 0's side."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.number = -1
        self.shm: shared_memory.SharedMemory | None = None

    def get(self, nbytes: int) -> tuple[int, memoryview]:
        """A buffer of at least ``nbytes``, and its number (the other ranks' name for it)."""
        if self.shm is None or self.shm.size < nbytes:
            self.close()
            self.number += 1
            size = 1 << max(20, (max(1, nbytes) - 1).bit_length())
            self.shm = shared_memory.SharedMemory(name=f"{self.prefix}-{self.number}", create=True, size=size)
        return self.number, self.shm.buf

    def close(self) -> None:
        """Free the segment; views into it must be gone."""
        if self.shm is not None:
            self.shm.close()
            self.shm.unlink()
            self.shm = None


class Attached:
    """Another rank's view of rank 0's current buffer (``numbered``), or of one fixed segment (the engine's
    staging pool, named ``prefix``)."""

    def __init__(self, prefix: str, numbered: bool = True) -> None:
        self.prefix, self.numbered = prefix, numbered
        self.number = -1
        self.shm: shared_memory.SharedMemory | None = None

    def get(self, number: int) -> memoryview:
        if number != self.number or self.shm is None:
            self.close()
            name = f"{self.prefix}-{number}" if self.numbered else self.prefix
            self.shm = shared_memory.SharedMemory(name=name, create=False)
            # Rank 0 unlinks it; this process must not (Python < 3.13 has no track=False).
            resource_tracker.unregister(self.shm._name, "shared_memory")  # noqa: SLF001
            self.number = number
        return self.shm.buf

    def close(self) -> None:
        if self.shm is not None:
            with contextlib.suppress(BufferError):  # a view (the transfer agent's) is still alive: unmapped at exit
                self.shm.close()
            self.shm = None
