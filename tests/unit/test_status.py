"""The status interceptor every server gets (``common.status``), through a real server on loopback: what an
escaping exception becomes on the wire, what it leaves alone, and how each call is counted."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY, CollectorRegistry

from common.service import Service, channel, start_server
from common.status import BUG_MESSAGE, DEFAULT_STATUSES, HandledView, StatusTable

SERVICE = "tandem.test.Probe"


class GoneError(Exception):
    """An error of this service's own, which its table maps."""


class RefusedError(Exception):
    """An error that carries its own status, as the gateway's do."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


STATUSES = DEFAULT_STATUSES.extend({GoneError: grpc.StatusCode.NOT_FOUND})


async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return request


async def bad_input(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    raise ValueError(f"{request.decode()} is not a number")


async def wrong_type(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    raise TypeError("an int, please")


async def aborts(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    await context.abort(grpc.StatusCode.PERMISSION_DENIED, "not yours")


async def bug(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return {}[request]


async def gone(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    raise GoneError("no such lease")


async def refused(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    raise RefusedError(grpc.StatusCode.UNAUTHENTICATED, "who are you?")


async def fails_mid_stream(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    yield b"one"
    yield b"two"
    raise ValueError("there is no three")


async def bug_mid_stream(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    yield b"one"
    raise RuntimeError("lost the thread")


async def hangs(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    yield b"started"
    await asyncio.Event().wait()


async def sums(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    async for r in requests:
        yield str(int(r)).encode()  # a ValueError on a request that is not a number


HANDLERS = {
    "Echo": grpc.unary_unary_rpc_method_handler(echo),
    "BadInput": grpc.unary_unary_rpc_method_handler(bad_input),
    "WrongType": grpc.unary_unary_rpc_method_handler(wrong_type),
    "Aborts": grpc.unary_unary_rpc_method_handler(aborts),
    "Bug": grpc.unary_unary_rpc_method_handler(bug),
    "Gone": grpc.unary_unary_rpc_method_handler(gone),
    "Refused": grpc.unary_unary_rpc_method_handler(refused),
    "FailsMidStream": grpc.unary_stream_rpc_method_handler(fails_mid_stream),
    "BugMidStream": grpc.unary_stream_rpc_method_handler(bug_mid_stream),
    "Hangs": grpc.unary_stream_rpc_method_handler(hangs),
    "Sums": grpc.stream_stream_rpc_method_handler(sums),
}


def add_probe(servicer: object, server: grpc.aio.Server) -> None:
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, HANDLERS),))


def handled(method: str, code: str, service: str = SERVICE) -> float:
    labels = {"grpc_service": service, "grpc_method": method, "grpc_code": code}
    return REGISTRY.get_sample_value("tandem_grpc_server_handled_total", labels) or 0.0


def serve(test: Callable[[grpc.aio.Channel], Coroutine[Any, Any, None]]) -> None:
    """Run ``test`` against a probe server started the way every service starts its own."""

    async def go() -> None:
        server = await start_server([Service(SERVICE, add_probe, None, STATUSES)], "127.0.0.1", 0)
        try:
            async with channel(f"127.0.0.1:{server.port}") as ch:
                await test(ch)
        finally:
            await server.stop(0)

    asyncio.run(go())


async def call(ch: grpc.aio.Channel, method: str, request: bytes = b"x") -> grpc.aio.AioRpcError | bytes:
    try:
        return await ch.unary_unary(f"/{SERVICE}/{method}")(request, timeout=10)
    except grpc.aio.AioRpcError as exc:
        return exc


async def until_counted(method: str, code: str, before: float, service: str = SERVICE) -> None:
    """Once: the server counts a call when its handler is done, which may be just after the client has the
    status (an abort sends it first) and well after a cancelling client has gone."""
    for _ in range(200):
        if handled(method, code, service) > before:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    assert handled(method, code, service) == before + 1, f"{method} is not counted once as {code}"


@pytest.mark.parametrize(("method", "code", "message"), [
    ("BadInput", grpc.StatusCode.INVALID_ARGUMENT, "abc is not a number"),
    ("WrongType", grpc.StatusCode.INVALID_ARGUMENT, "an int, please"),
    ("Aborts", grpc.StatusCode.PERMISSION_DENIED, "not yours"),
    ("Gone", grpc.StatusCode.NOT_FOUND, "no such lease"),
    ("Refused", grpc.StatusCode.UNAUTHENTICATED, "who are you?"),
])
def test_an_escaping_exception_ends_the_call_with_its_status_and_message(method, code, message):
    async def test(ch: grpc.aio.Channel) -> None:
        before = handled(method, code.name)
        err = await call(ch, method, b"abc")
        assert isinstance(err, grpc.aio.AioRpcError)
        assert (err.code(), err.details()) == (code, message)
        await until_counted(method, code.name, before)

    serve(test)


def test_a_bug_is_internal_with_its_traceback_in_the_log_and_not_in_the_reply(caplog):
    async def test(ch: grpc.aio.Channel) -> None:
        before = handled("Bug", "INTERNAL")
        err = await call(ch, "Bug", b"secret-key")
        assert (err.code(), err.details()) == (grpc.StatusCode.INTERNAL, BUG_MESSAGE)
        await until_counted("Bug", "INTERNAL", before)

    with caplog.at_level(logging.ERROR, logger="tandem.status"):
        serve(test)
    [record] = [r for r in caplog.records if r.name == "tandem.status"]
    assert f"/{SERVICE}/Bug" in record.getMessage() and record.exc_info[0] is KeyError


def test_a_service_table_overrides_the_default_message_of_a_bug():
    table = DEFAULT_STATUSES.extend({Exception: lambda exc: (grpc.StatusCode.INTERNAL, "probe bug")})
    assert table.status(KeyError("k")) == (grpc.StatusCode.INTERNAL, "probe bug")
    assert table.status(ValueError("v")) == (grpc.StatusCode.INVALID_ARGUMENT, "v")  # the more specific class
    assert StatusTable({}).status(KeyError("k")) == (grpc.StatusCode.INTERNAL, BUG_MESSAGE)


def test_a_stream_that_fails_midway_keeps_what_it_sent_and_ends_with_the_status():
    async def test(ch: grpc.aio.Channel) -> None:
        for method, code, message in (("FailsMidStream", grpc.StatusCode.INVALID_ARGUMENT, "there is no three"),
                                      ("BugMidStream", grpc.StatusCode.INTERNAL, BUG_MESSAGE)):
            before = handled(method, code.name)
            got = []
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for msg in ch.unary_stream(f"/{SERVICE}/{method}")(b"", timeout=10):
                    got.append(msg)
            assert got == ([b"one", b"two"] if method == "FailsMidStream" else [b"one"])
            assert (err.value.code(), err.value.details()) == (code, message)
            await until_counted(method, code.name, before)

    serve(test)


def test_a_bidirectional_stream_is_mapped_and_counted_too():
    async def test(ch: grpc.aio.Channel) -> None:
        ok, bad = handled("Sums", "OK"), handled("Sums", "INVALID_ARGUMENT")
        stream = ch.stream_stream(f"/{SERVICE}/Sums")
        assert [m async for m in stream(iter([b"1", b"2"]), timeout=10)] == [b"1", b"2"]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            [m async for m in stream(iter([b"3", b"four"]), timeout=10)]
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "four" in err.value.details()
        await until_counted("Sums", "INVALID_ARGUMENT", bad)
        assert handled("Sums", "OK") == ok + 1

    serve(test)


def test_a_client_that_cancels_is_counted_as_cancelled():
    async def test(ch: grpc.aio.Channel) -> None:
        before = handled("Hangs", "CANCELLED")
        stream = ch.unary_stream(f"/{SERVICE}/Hangs")(b"", timeout=10)
        assert await stream.read() == b"started"
        stream.cancel()
        await until_counted("Hangs", "CANCELLED", before)

    serve(test)


def test_a_passed_deadline_is_counted_as_deadline_exceeded():
    async def test(ch: grpc.aio.Channel) -> None:
        before = handled("Hangs", "DEADLINE_EXCEEDED")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in ch.unary_stream(f"/{SERVICE}/Hangs")(b"", timeout=0.3):
                pass
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await until_counted("Hangs", "DEADLINE_EXCEEDED", before)

    serve(test)


def test_every_service_of_the_server_is_counted_by_service_method_and_code():
    async def test(ch: grpc.aio.Channel) -> None:
        health = "grpc.health.v1.Health"
        before = handled("Echo", "OK"), handled("Check", "OK", health), handled("Check", "NOT_FOUND", health)
        assert await call(ch, "Echo", b"hi") == b"hi"
        stub = health_pb2_grpc.HealthStub(ch)
        assert (await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE))).status == \
            health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError):  # the health servicer aborts for a service it does not know
            await stub.Check(health_pb2.HealthCheckRequest(service="nobody"))
        await until_counted("Check", "NOT_FOUND", before[2], health)
        assert (handled("Echo", "OK"), handled("Check", "OK", health)) == (before[0] + 1, before[1] + 1)

    serve(test)


def test_a_view_reads_one_service_s_methods_out_of_the_one_counter():
    registry = CollectorRegistry()
    registry.register(HandledView("tandem_probe_requests", "Probe calls by final status", SERVICE, ["BadInput"]))

    def view(code: str) -> float:
        return registry.get_sample_value("tandem_probe_requests_total", {"code": code}) or 0.0

    async def test(ch: grpc.aio.Channel) -> None:
        before = view("INVALID_ARGUMENT"), view("OK")
        counted = handled("BadInput", "INVALID_ARGUMENT")
        await call(ch, "BadInput")
        await call(ch, "Echo")  # another method: not in the view
        await until_counted("BadInput", "INVALID_ARGUMENT", counted)
        assert (view("INVALID_ARGUMENT"), view("OK")) == (before[0] + 1, before[1])

    serve(test)


def test_a_stream_written_with_context_write_is_counted_too():
    async def test(ch: grpc.aio.Channel) -> None:
        health, before = "grpc.health.v1.Health", handled("Watch", "CANCELLED", "grpc.health.v1.Health")
        watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=SERVICE), timeout=10)
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
        await until_counted("Watch", "CANCELLED", before, health)

    serve(test)
