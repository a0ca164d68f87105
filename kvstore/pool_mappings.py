"""A reader's mappings of store pools on its own host, one per store node, kept while they are current.

A node's Lookup answer names its pool (``pool_id``, new at every start of the
node). The first Lookup at a node asks for the pool's UCX descriptor too
(``map_pool``); the reader maps the pool once and then reads leased blocks of it
in place. A node that restarted answers with a new pool id: the old mapping is
dropped and the next Lookup maps the new pool. A pool that cannot be mapped
(another host) is remembered as such, so the reader does not ask again until the
pool changes. A dead node's pool lives on in its readers' mappings: each pull
drops mappings whose store has stopped renewing its liveness deadline.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from kvstore import ucp_memory
from kvstore.ucp_memory import MappedRegion


@dataclass(slots=True)
class _Entry:
    pool_id: bytes
    region: MappedRegion | None  # None: the pool cannot be mapped from here


class PoolMappings:
    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._by_address: dict[str, _Entry] = {}  # the node's gRPC address -> its pool's mapping

    def mapped(self, address: str) -> bytes | None:
        """The id of the pool mapped for the node at ``address``, if one is."""
        entry = self._by_address.get(address)
        return entry.pool_id if entry is not None and entry.region is not None else None

    def wants_map(self, address: str) -> bool:
        """Whether a Lookup at ``address`` should ask for the pool's descriptor."""
        return self.enabled and address not in self._by_address

    async def region_for(self, address: str, pool_id: bytes, pool_map: bytes) -> MappedRegion | None:
        """The mapping of the pool a Lookup at ``address`` answered for; None when it is not mapped
        (not on this host, not asked for yet, or the node restarted since)."""
        entry = self._by_address.get(address)
        if entry is not None and entry.pool_id != pool_id:
            self._drop(address)
            entry = None
        if entry is None and pool_map:  # only sent when asked for (``wants_map``)
            # Mapping faults in every page of the pool (hundreds of ms per GB): off the event loop.
            region = await asyncio.to_thread(ucp_memory.attach, pool_map)
            entry = self._by_address[address] = _Entry(pool_id, region)
        return entry.region if entry is not None else None

    def expire(self) -> None:
        """Drop the mappings of stores that stopped renewing their deadline (dead, or hung)."""
        for address in [a for a, e in self._by_address.items() if e.region is not None and not e.region.alive()]:
            self._drop(address)

    def _drop(self, address: str) -> None:
        entry = self._by_address.pop(address)
        if entry.region is not None:
            entry.region.close()

    def close(self) -> None:
        for address in list(self._by_address):
            self._drop(address)
