"""A gRPC server that answers raw ``bytes`` with the same bytes: the baseline of ``tandem bench kv``."""

from __future__ import annotations

import asyncio

import grpc


async def _serve() -> None:
    def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    handler = grpc.method_handlers_generic_handler(
        "tandem.bench.Bytes", {"Put": grpc.unary_unary_rpc_method_handler(echo)}
    )
    server = grpc.aio.server(
        options=[("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"BYTES READY 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(_serve())
