"""Per-request block tables over the block pool, and the prefix cache built on their keys.

The scheduler asks two things: "admit this request, reusing what is cached" and
"can this request grow by n tokens?"; both answer yes (blocks taken) or no
(nothing taken). After every step the engine registers the blocks that became
full, so that later requests with the same prefix find them.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.block_hash import HASH_BYTES, chain_hashes, root_hash
from engine.block_pool import BlockPool
from engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class PrefixCacheStats:
    """Counted once per admission, over the full blocks a request could have reused."""

    hit_blocks: int = 0
    miss_blocks: int = 0
    hit_tokens: int = 0
    query_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        fingerprint: bytes = bytes(HASH_BYTES),
    ) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.fingerprint = fingerprint
        self.stats = PrefixCacheStats()
        self._roots: dict[str | None, bytes] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def num_blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self.num_blocks_needed(num_tokens) <= self.pool.num_blocks

    def update_hashes(self, request: Request, num_tokens: int) -> None:
        """Extend the request's keys to cover the full blocks among its first ``num_tokens`` tokens."""
        have, bs = len(request.block_hashes), self.block_size
        n_full = num_tokens // bs
        if n_full <= have:
            return
        parent = request.block_hashes[-1] if have else self._root(request.cache_salt)
        request.block_hashes.extend(chain_hashes(parent, request.token_ids(have * bs, n_full * bs), bs))

    def _root(self, salt: str | None) -> bytes:
        root = self._roots.get(salt)
        if root is None:
            if len(self._roots) > 1024:
                self._roots.clear()
            root = self._roots[salt] = root_hash(self.fingerprint, salt)
        return root

    def admit(self, request: Request, num_new_tokens: int, reusable_tokens: int) -> bool:
        """Give a request without blocks its table: cached blocks for up to ``reusable_tokens``
        leading tokens, fresh ones for the rest and ``num_new_tokens`` more.

        On success ``num_computed_tokens`` (and ``num_cached_tokens``) count the reused tokens; on failure nothing
        is taken. ``num_new_tokens`` is counted from the end of the reuse, so callers ask
        ``cached_prefix_tokens`` first to size the step.
        """
        assert not request.block_ids, "admit() is for requests that hold no blocks"
        hits = self._lookup(request, reusable_tokens)
        total = len(hits) * self.block_size + num_new_tokens
        missing = self.num_blocks_needed(total) - len(hits)
        if missing > self.pool.num_free_blocks - self.pool.num_free_among(hits):
            return False
        self.pool.touch(hits)
        request.block_ids = hits + (self.pool.allocate(missing) or [])
        request.num_cached_blocks = len(hits)
        request.num_computed_tokens = request.num_cached_tokens = len(hits) * self.block_size
        if self.enable_prefix_caching:
            n_query = reusable_tokens // self.block_size
            self.stats.hit_blocks += len(hits)
            self.stats.miss_blocks += n_query - len(hits)
            self.stats.hit_tokens += request.num_computed_tokens
            self.stats.query_tokens += request.num_tokens
        return True

    def cached_prefix_tokens(self, request: Request, reusable_tokens: int) -> int:
        """How many leading tokens ``admit`` would reuse now; takes nothing."""
        return len(self._lookup(request, reusable_tokens)) * self.block_size

    def _lookup(self, request: Request, reusable_tokens: int) -> list[int]:
        if not self.enable_prefix_caching or reusable_tokens < self.block_size:
            return []
        self.update_hashes(request, reusable_tokens)
        return self.pool.lookup(request.block_hashes[: reusable_tokens // self.block_size])

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

    def trim(self, request: Request, num_tokens: int) -> None:
        """Give back the blocks past the first ``num_tokens`` tokens (slots of rejected speculative tokens):
        never a registered block, since only computed tokens' blocks are registered."""
        keep = max(self.num_blocks_needed(num_tokens), request.num_cached_blocks)
        if len(request.block_ids) > keep:
            extra = request.block_ids[keep:]
            del request.block_ids[keep:]
            self.pool.free(extra[::-1])

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's blocks that are now full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        n_full = request.num_computed_tokens // self.block_size
        if n_full <= request.num_cached_blocks:
            return
        self.update_hashes(request, n_full * self.block_size)
        for i in range(request.num_cached_blocks, n_full):
            self.pool.cache(request.block_ids[i], request.block_hashes[i])
        request.num_cached_blocks = n_full

    def free(self, request: Request) -> None:
        """Tail first, so that the end of a sequence is evicted before the prefix others share."""
        self.pool.free(request.block_ids[::-1])
        request.block_ids = []
        request.num_cached_blocks = 0

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_cache()
