"""What every tandem gRPC service shares: a server with health and reflection, the READY
line the launcher waits for, and a graceful stop on SIGINT / SIGTERM.

A service builds its servicers, hands them to ``start_server`` (which binds port 0
to a free port when asked), prints ``<NAME> READY grpc=host:port ...`` and then
``wait_for_signal``; health goes NOT_SERVING before the server drains, so that
load balancers stop sending first.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

# Large enough for a 128k-token prompt of uint32 ids with room to spare; the gateway
# enforces its own, tighter limits on what a client may send.
MAX_MESSAGE_BYTES = 64 * 2**20
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
    # Accept the clients' keepalive pings (CHANNEL_OPTIONS), idle channels included; by default a
    # server answers them with GOAWAY "too_many_pings", which cuts every stream on the connection.
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
]
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Notice a dead peer within seconds even on an idle channel.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # A restarted worker is back in routing within seconds: the default backoff grows to 2 minutes.
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


@dataclass(slots=True)
class Service:
    """One registered servicer: ``add`` is the generated ``add_XServicer_to_server``."""

    name: str  # the full proto name, e.g. "tandem.v1.Gateway"
    add: Callable[[Any, grpc.aio.Server], None]
    servicer: Any


@dataclass(slots=True)
class RunningServer:
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    names: tuple[str, ...]

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.names):
            await self.health.set(name, status)

    async def stop(self, grace: float = 5.0) -> None:
        await self.set_serving(False)
        await self.server.stop(grace)


async def start_server(services: Sequence[Service], host: str, port: int) -> RunningServer:
    """Bind, register health and reflection next to ``services``, start, and report SERVING."""
    server = grpc.aio.server(options=SERVER_OPTIONS)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    for s in services:
        s.add(s.servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = tuple(s.name for s in services)
    reflection.enable_server_reflection((*names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    await server.start()
    running = RunningServer(server, bound, health_servicer, names)
    await running.set_serving(True)
    return running


def start_observability(kind: str, host: str, grpc_port: int, metrics_port: int) -> dict[str, str]:
    """Tracing and the /metrics endpoint of one service process; the fields its READY line adds."""
    from tandem import telemetry
    from tandem.metrics import serve_metrics

    telemetry.setup_tracing(kind, f"{host}:{grpc_port}")
    port = serve_metrics(host, metrics_port)
    return {"metrics": f"{host}:{port}"} if port else {}


def stop_observability() -> None:
    from tandem import telemetry

    telemetry.shutdown_tracing()


def announce(name: str, **fields: object) -> None:
    """The line ``tandem up`` and the tests read to learn a service's addresses."""
    extra = " ".join(f"{k}={v}" for k, v in fields.items())
    print(f"{name.upper()} READY {extra}", flush=True)


def stop_signal() -> asyncio.Event:
    """An event that SIGINT / SIGTERM set. Install it before announcing READY: a launcher may
    signal as soon as it reads that line, and the default action would skip the graceful stop."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")


def channel(address: str) -> grpc.aio.Channel:
    """A client channel to another tandem service, with the shared limits and keepalives."""
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
