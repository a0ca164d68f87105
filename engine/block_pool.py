"""The pool of physical KV blocks: reference counts, the free queue and the prefix cache's map.

A block is either in use (ref count > 0, held by one or more requests that share
its prefix) or free. A free block may still hold a cached prefix: it stays
findable by its key until the pool needs it for something else, and the free
queue hands out the least recently freed block first, so eviction is LRU.
Free blocks that hold nothing reusable go to the front of the queue and are
reused before any cached one.
"""

from __future__ import annotations

from collections import OrderedDict


class BlockPool:
    """``OrderedDict`` free queue: O(1) pop at the front and O(1) removal from the middle,
    which reviving a cached free block needs."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_keys: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, cached or not: what allocation can draw on."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks, or None when the pool cannot supply them (nothing is taken then)."""
        if n > len(self._free):
            return None
        out = []
        for _ in range(n):
            block_id = self._free.popitem(last=False)[0]
            self._evict(block_id)
            self.ref_counts[block_id] = 1
            out.append(block_id)
        return out

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on cached blocks another request found by their keys."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                del self._free[block_id]
            self.ref_counts[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference each; give the caller's order of eviction (first in the list, first out)."""
        empty = []
        for block_id in block_ids:
            count = self.ref_counts[block_id]
            assert count > 0, f"block {block_id} freed twice"
            self.ref_counts[block_id] = count - 1
            if count == 1:
                self._free[block_id] = None
                if self.block_keys[block_id] is None:
                    empty.append(block_id)
        for block_id in reversed(empty):  # to the front, keeping their order
            self._free.move_to_end(block_id, last=False)

    def lookup(self, keys: list[bytes]) -> list[int]:
        """Blocks of the longest run of ``keys`` that is cached, from the first key on."""
        hits = []
        for key in keys:
            block_id = self.cached.get(key)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def num_free_among(self, block_ids: list[int]) -> int:
        return sum(1 for b in block_ids if self.ref_counts[b] == 0)

    def cache(self, block_id: int, key: bytes) -> None:
        """Make a full block findable by its key; a key cached already keeps its first block."""
        if self.block_keys[block_id] is None and key not in self.cached:
            self.cached[key] = block_id
            self.block_keys[block_id] = key

    def reset_cache(self) -> int:
        """Forget every cached prefix that no request holds; how many were dropped."""
        dropped = [b for b in self._free if self.block_keys[b] is not None]
        for block_id in dropped:
            self._evict(block_id)
            self._free.move_to_end(block_id, last=False)
        return len(dropped)

    def _evict(self, block_id: int) -> None:
        key = self.block_keys[block_id]
        if key is not None:
            del self.cached[key]
            self.block_keys[block_id] = None
            self.num_evictions += 1
