"""The pool of physical KV blocks and the per-request block tables over it.

The pool owns which blocks are free; the scheduler only asks "can this request
grow by n tokens?" and gets a yes (blocks appended to its table) or a no.
"""

from __future__ import annotations

from collections import OrderedDict

from engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockPool:
    """Free blocks in eviction order: the oldest freed block is reused first.

    An ``OrderedDict`` gives O(1) pop from the front and O(1) removal from the
    middle, which the prefix cache needs to revive a cached block.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` blocks, or None when the pool cannot supply them (nothing is taken then)."""
        if n > len(self._free):
            return None
        return [self._free.popitem(last=False)[0] for _ in range(n)]

    def free(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            assert block_id not in self._free, f"block {block_id} freed twice"
            self._free[block_id] = None


class KVCacheManager:
    """Grows and frees the block tables of requests."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def num_blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self.num_blocks_needed(num_tokens) <= self.pool.num_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` more computed tokens; False means "cannot fit"."""
        total = request.num_computed_tokens + num_new_tokens
        missing = self.num_blocks_needed(total) - len(request.block_ids)
        if missing <= 0:
            return True
        blocks = self.pool.allocate(missing)
        if blocks is None:
            return False
        request.block_ids.extend(blocks)
        return True

    def free(self, request: Request) -> None:
        """Tail first, so that the blocks holding the end of a sequence are reused first."""
        self.pool.free(list(reversed(request.block_ids)))
        request.block_ids = []
