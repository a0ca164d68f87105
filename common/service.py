"""What every tandem gRPC service shares: a server with health and reflection, the READY
line the launcher waits for, and a graceful stop on SIGINT / SIGTERM.

A service hands its servicers to ``start_server`` (port 0: a free port) or, when a servicer must know
its port first (the kvstore names itself by it), binds with ``create_server`` and then calls
``RunningServer.start``. It installs ``stop_signal``, prints ``announce``'s ``<NAME> READY
grpc=host:port ...`` line and waits for that event; ``RunningServer.stop`` turns health NOT_SERVING
before the server drains, so that load balancers stop sending first.

Every server these create maps exceptions escaping its handlers to gRPC statuses, and counts every
call's outcome, in one place: ``common.status.StatusInterceptor``, with the ``StatusTable`` each
``Service`` names.

Transport security (``common.tls``): ``create_server`` binds its port with TLS when the service's
``ServiceTLS`` has server credentials, and ``start`` then serves ``grpc.health.v1`` alone on a plaintext
health port too (Kubernetes' gRPC probes cannot speak TLS); ``channel`` opens every channel to another
service with the credentials the process installed at start (mutual TLS), plaintext without.
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

from common.status import DEFAULT_STATUSES, StatusInterceptor, StatusTable
from common.tls import ClientTLS, ServerTLS, ServiceTLS, internal_client

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
    """One registered servicer: ``add`` is the generated ``add_XServicer_to_server``; ``statuses`` maps the
    exceptions its handlers let escape to the statuses their calls end with."""

    name: str  # the full proto name, e.g. "tandem.v1.Gateway"
    add: Callable[[Any, grpc.aio.Server], None]
    servicer: Any
    statuses: StatusTable = DEFAULT_STATUSES


@dataclass(slots=True)
class RunningServer:
    """A server bound to ``port``; it serves once ``start`` has registered its services."""

    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    statuses: StatusInterceptor
    host: str
    tls: ServiceTLS
    names: tuple[str, ...] = ()
    health_server: grpc.aio.Server | None = None  # the plaintext health-only port, when TLS is on
    health_port: int | None = None

    async def start(self, services: Sequence[Service]) -> None:
        """Register health and reflection next to ``services``, start (with the plaintext health port
        ``tls`` asks for), and report SERVING."""
        for s in services:
            s.add(s.servicer, self.server)
            self.statuses.tables[s.name] = s.statuses
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.names = tuple(s.name for s in services)
        reflection.enable_server_reflection((*self.names, health.SERVICE_NAME, reflection.SERVICE_NAME),
                                            self.server)
        await self.server.start()
        if self.tls.health_port is not None:
            self.health_server, self.health_port = await start_health_server(self.health, self.host,
                                                                             self.tls.health_port)
        await self.set_serving(True)

    def ready_fields(self, host: str) -> dict[str, str]:
        """What the READY line adds for this server: the health port's address, if there is one."""
        return {"health": f"{host}:{self.health_port}"} if self.health_port is not None else {}

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.names):
            await self.health.set(name, status)

    async def stop(self, grace: float = 5.0) -> None:
        await self.set_serving(False)
        await self.server.stop(grace)
        if self.health_server is not None:
            await self.health_server.stop(0)


def bind(server: grpc.aio.Server, host: str, port: int, tls: ServerTLS | None = None) -> int:
    """Add the service's port to ``server``, with TLS when ``tls`` is given; the port bound."""
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, tls.credentials()) if tls else server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot bind {address}")
    return bound


async def start_health_server(servicer: health.aio.HealthServicer, host: str, port: int
                              ) -> tuple[grpc.aio.Server, int]:
    """``servicer`` (the one the main port serves, so both say the same) alone on a plaintext port."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    bound = bind(server, host, port)
    await server.start()
    return server, bound


def create_server(host: str, port: int, tls: ServiceTLS | None = None,
                  max_receive_bytes: int | None = None) -> RunningServer:
    """The one way a service gets its server: bound (with TLS when ``tls.server`` is set), with the status
    interceptor, not yet started. ``max_receive_bytes``: a smaller limit on request messages than
    MAX_MESSAGE_BYTES (the gateway's public port)."""
    tls = tls or ServiceTLS()
    options = SERVER_OPTIONS
    if max_receive_bytes is not None:
        options = [o for o in SERVER_OPTIONS if o[0] != "grpc.max_receive_message_length"]
        options.append(("grpc.max_receive_message_length", max_receive_bytes))
    statuses = StatusInterceptor()
    server = grpc.aio.server(options=options, interceptors=[statuses])
    bound = bind(server, host, port, tls.server)
    return RunningServer(server, bound, health.aio.HealthServicer(), statuses, host, tls)


async def start_server(services: Sequence[Service], host: str, port: int,
                       tls: ServiceTLS | None = None, max_receive_bytes: int | None = None) -> RunningServer:
    """``create_server`` and ``RunningServer.start``, for a service whose servicers need not know the port."""
    running = create_server(host, port, tls, max_receive_bytes)
    await running.start(services)
    return running


def start_observability(kind: str, host: str, grpc_port: int, metrics_port: int) -> dict[str, str]:
    """Tracing and the /metrics endpoint of one service process; the fields its READY line adds."""
    from common import telemetry
    from common.metrics import serve_metrics

    telemetry.setup_tracing(kind, f"{host}:{grpc_port}")
    port = serve_metrics(host, metrics_port)
    return {"metrics": f"{host}:{port}"} if port else {}


def stop_observability() -> None:
    from common import telemetry

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


def channel(address: str, tls: ClientTLS | None = None) -> grpc.aio.Channel:
    """A client channel to another tandem service, with the shared limits and keepalives.

    TLS: ``tls`` when given, else what this process installed at start (``common.tls.setup``: a
    service's mutual-TLS identity), else plaintext.
    """
    tls = tls or internal_client()
    if tls is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    return grpc.aio.secure_channel(address, tls.credentials(), options=[*CHANNEL_OPTIONS, *tls.options()])
