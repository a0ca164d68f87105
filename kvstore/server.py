"""``tandem serve kvstore``: one store node (pool + UCX data plane + gRPC control plane).

The node registers itself in the index and heartbeats; a node that stops
heartbeating is purged by the others (its blocks read as misses). Upkeep also
expires reservations, leases and request-scoped partial blocks.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket

from prometheus_client.core import GaugeMetricFamily

from common.metrics import add_metrics_args, counter, gauge, register_state
from common.service import (
    Service,
    announce,
    create_server,
    start_observability,
    stop_observability,
    stop_signal,
)
from common.settings import env_default
from common.tls import ServiceTLS, add_tls_args, setup
from kvstore.control import STATUSES, KVStoreService
from kvstore.data_plane import DataPlaneServer
from kvstore.index import BlockIndex, IndexUnavailableError, MemoryIndex
from kvstore.pool import BlockPool
from kvstore.ucp_memory import POOL_ID_BYTES, SharedRegion, UcpError, shared_memory_enabled
from protos import kvstore_pb2, kvstore_pb2_grpc

log = logging.getLogger("tandem.kvstore")

# One block of the default model (SmolLM2-135M: 30 layers x K,V x 16 tokens x 3 KV heads x 64) in float32.
DEFAULT_BLOCK_BYTES = 30 * 2 * 16 * 3 * 64 * 4


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default=env_default("--host", "127.0.0.1"), help="address to bind and advertise")
    p.add_argument("--port", type=int, default=env_default("--port", 0), help="gRPC port (0: pick a free one)")
    p.add_argument("--data-port", type=int, default=env_default("--data-port", 0), help="UCX port (0: free one)")
    p.add_argument("--capacity-gb", type=float, default=env_default("--capacity-gb", 1.0))
    p.add_argument("--block-bytes", type=int, default=env_default("--block-bytes", DEFAULT_BLOCK_BYTES),
                   help="bytes of one KV block (all layers) of the served model and dtype")
    p.add_argument("--redis-url", default=env_default("--redis-url", None, str),
                   help="share the index through Redis (default: an embedded in-memory index)")
    p.add_argument("--node-id", default=env_default("--node-id", None, str))
    p.add_argument("--heartbeat-s", type=float, default=env_default("--heartbeat-s", 2.0))
    p.add_argument("--partial-ttl-s", type=float, default=env_default("--partial-ttl-s", 60.0))
    p.add_argument("--reserve-ttl-s", type=float, default=env_default("--reserve-ttl-s", 10.0),
                   help="seconds a writer has from Reserve to Commit; a writer that died frees its slots after this")
    p.add_argument("--lease-ttl-s", type=float, default=env_default("--lease-ttl-s", 30.0),
                   help="seconds a reader's lease holds its blocks unless released; a dead reader's ends after this")
    add_metrics_args(p)
    add_tls_args(p)  # the gRPC control plane; the UCX data plane is not encrypted (README, Security)


def make_index(redis_url: str | None) -> BlockIndex:
    if not redis_url:
        return MemoryIndex()
    from kvstore.redis_index import RedisIndex

    return RedisIndex(redis_url)


async def _upkeep(service: KVStoreService, args: argparse.Namespace, node_id: str,
                  region: SharedRegion | None) -> None:
    ttl = 3 * args.heartbeat_s
    while True:
        if region is not None:  # readers that mapped the pool drop it once this deadline passes
            region.keep_alive(max(1.0, 10 * args.heartbeat_s))
        try:
            await asyncio.to_thread(service.index.register_node, node_id, service.node_address, ttl)
            dead = await asyncio.to_thread(service.index.purge_dead)
            if dead:
                log.warning("purged dead store nodes %s", dead)
        except IndexUnavailableError as exc:
            log.warning("index unavailable: %s", exc)
        service.pool.expire()
        await asyncio.sleep(args.heartbeat_s)


def make_pool(args: argparse.Namespace) -> tuple[BlockPool, SharedRegion | None]:
    """The node's pool, in UCX shared memory that same-host readers map (private memory where that
    cannot be had, or with ``TANDEM_KV_SHARED_MEMORY=0``: every read then goes over the data plane)."""
    capacity = int(args.capacity_gb * 2**30)
    region = None
    if shared_memory_enabled():
        try:
            region = SharedRegion(capacity, args.block_bytes, os.urandom(POOL_ID_BYTES))
        except (UcpError, OSError, ImportError) as exc:
            log.warning("the pool is private memory (readers on this host cannot map it): %s", exc)
    pool = BlockPool(capacity, args.block_bytes, args.partial_ttl_s, memory=region.array if region else None)
    return pool, region


async def serve(args: argparse.Namespace, tls: ServiceTLS | None = None) -> None:
    tls = tls or setup(args, "kvstore")
    pool, region = make_pool(args)
    server = create_server(args.host, args.port, tls)  # bound first: the node is named by its port
    port = server.port
    node_id = args.node_id or f"{socket.gethostname()}:{port}"
    data = DataPlaneServer(pool)
    data_port = data.start(args.data_port)
    service = KVStoreService(pool, make_index(args.redis_url), node_id, f"{args.host}:{data_port}",
                             lease_ttl_s=args.lease_ttl_s, reserve_ttl_s=args.reserve_ttl_s,
                             control_address=f"{args.host}:{port}",  # other nodes' readers lease here
                             pool_id=region.pool_id if region else os.urandom(POOL_ID_BYTES),
                             pool_map=region.descriptor if region else b"")
    with contextlib.suppress(IndexUnavailableError):  # a restarted node's old entries name an empty pool
        await asyncio.to_thread(service.index.purge_node, node_id)
    data.on_bytes = lambda received, sent: setattr(service.counters, "bytes_out", service.counters.bytes_out + sent)
    await server.start([Service(kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"].full_name,
                                kvstore_pb2_grpc.add_KVStoreServicer_to_server, service, STATUSES)])
    upkeep = asyncio.create_task(_upkeep(service, args, node_id, region))
    stop = stop_signal()
    register_state(lambda: store_state(service))
    extra = start_observability("kvstore", args.host, port, args.metrics_port)
    # The launcher and tests read this line to find the ports.
    announce("kvstore", grpc=f"{args.host}:{port}", data=f"{args.host}:{data_port}", node=node_id,
             slots=pool.num_slots, **server.ready_fields(args.host), **extra)
    await stop.wait()
    upkeep.cancel()
    with contextlib.suppress(IndexUnavailableError):
        await asyncio.to_thread(service.index.purge_node, node_id)  # a clean stop leaves nothing behind
    await server.stop(grace=1)  # health NOT_SERVING first, then the drain
    data.close()  # the pool's shared memory goes with the process (readers' mappings keep it until they drop them)
    stop_observability()


def store_state(service: KVStoreService) -> list:
    """What /metrics reads of the store at scrape time."""
    snap, c = service.pool.snapshot(), service.counters
    blocks = GaugeMetricFamily("tandem_kvstore_blocks", "Pool slots by state", labels=["state"])
    for state in ("stored", "free", "reserved", "leased", "partial"):
        blocks.add_metric([state], snap[f"{state}_blocks"])
    return [
        blocks,
        gauge("tandem_kvstore_capacity_blocks", "Slots in the preallocated pool", snap["capacity_blocks"]),
        gauge("tandem_kvstore_active_leases", "Readers' leases held now", snap["active_leases"]),
        counter("tandem_kvstore_evictions", "Blocks evicted (LRU over unleased blocks)", snap["evictions"]),
        counter("tandem_kvstore_refused_transfers", "Data-plane transfers refused: no valid token for their slots",
                snap["refused_transfers"]),
        counter("tandem_kvstore_lookups", "Lookup calls", c.lookups),
        counter("tandem_kvstore_lookup_hit_blocks", "Blocks found by lookups", c.hit_blocks),
        counter("tandem_kvstore_lookup_miss_blocks", "Blocks asked for and not found", c.miss_blocks),
        counter("tandem_kvstore_bytes_in", "Block bytes committed into the pool", c.bytes_in),
        counter("tandem_kvstore_bytes_out", "Block bytes sent to readers", c.bytes_out),
    ]


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    tls = setup(args, "kvstore")
    asyncio.run(serve(args, tls))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem serve kvstore")
    add_args(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
