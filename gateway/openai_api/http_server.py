"""uvicorn inside the gateway's event loop, beside the gRPC server.

The gateway owns the process's signals (SIGTERM drains both APIs, then stops them), so uvicorn's own
signal handling is turned off; the port is bound here so that ``--http-port 0`` can announce the port it
got, and the public port's TLS flags give the HTTP port the same certificate (and client CA).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import ssl
from collections.abc import Iterator
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI

SHUTDOWN_GRACE_S = 1.0  # after the gateway's drain: connections still open are closed


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # the gateway handles SIGTERM / SIGINT itself
        yield


@dataclass(slots=True)
class HttpServer:
    server: uvicorn.Server
    task: asyncio.Task
    port: int

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.task


async def start_http(app: FastAPI, host: str, port: int, tls: argparse.Namespace | None = None) -> HttpServer:
    """Serve ``app`` on ``host:port`` (0: a free port); ``tls``: the gateway's flags (``--tls-cert``, ...)."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    options = dict(log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
                   server_header=False)
    if tls is not None and getattr(tls, "tls_cert", None):
        options.update(ssl_certfile=tls.tls_cert, ssl_keyfile=tls.tls_key)
        if getattr(tls, "tls_client_ca", None):
            options.update(ssl_ca_certs=tls.tls_client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    server = _Server(uvicorn.Config(app, **options))
    task = asyncio.create_task(server.serve(sockets=[sock]), name="http-front")
    while not server.started:
        if task.done():
            task.result()  # raises why it could not start
            raise RuntimeError("the HTTP server stopped before it started")
        await asyncio.sleep(0.01)
    return HttpServer(server, task, sock.getsockname()[1])
