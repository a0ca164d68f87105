"""How a call's exception becomes its gRPC status, and how every call's outcome is counted: once, here.

``common.service`` puts a ``StatusInterceptor`` on every server it creates. For each call it

- lets a call that already ended its status (``context.abort``, cancellation) pass as it is;
- ends a call whose handler raised with the status its service's ``StatusTable`` names for the
  exception (``DEFAULT_STATUSES``: a caller's bad input, ``ValueError`` / ``TypeError``, is
  INVALID_ARGUMENT with the exception's message; anything unforeseen is INTERNAL, with its traceback
  in the log and not in the reply); an exception that carries its own ``code`` (a ``grpc.StatusCode``)
  and ``message`` ends the call with those;
- counts the outcome in ``tandem_grpc_server_handled_total{grpc_service,grpc_method,grpc_code}``.

A handler that needs its own outcome (a span's status, a per-request record) asks ``outcome`` with the
same table, so that what it records and what the client gets never disagree.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import Any

import grpc
from prometheus_client import Counter
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import REGISTRY, Collector, CollectorRegistry

log = logging.getLogger("tandem.status")

Status = tuple[grpc.StatusCode, str]
# What an exception class maps to: a code (the message is ``str(exc)``), or a function of the exception.
Rule = grpc.StatusCode | Callable[[BaseException], Status]

HANDLED = Counter("tandem_grpc_server_handled", "gRPC calls served, by service, method and final status code",
                  ["grpc_service", "grpc_method", "grpc_code"])


def status_name(context: grpc.aio.ServicerContext) -> str:
    """The status a call is ending with: the one it aborted with, else the caller went away."""
    code = context.code()
    if isinstance(code, grpc.StatusCode) and code != grpc.StatusCode.OK:
        return code.name
    remaining = context.time_remaining()
    return "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0 else "CANCELLED"


def internal(message: str | None = None) -> Rule:
    """INTERNAL with ``message`` (default: the exception's own): a bug, whose traceback goes to the log."""
    return lambda exc: (grpc.StatusCode.INTERNAL, str(exc) if message is None else message)


class StatusTable:
    """Exception classes to statuses. The most specific class in an exception's MRO wins, so a service
    adds its own errors (``extend``) without caring about the order they are listed in."""

    def __init__(self, rules: Mapping[type[BaseException], Rule]) -> None:
        self._rules = dict(rules)

    def extend(self, rules: Mapping[type[BaseException], Rule]) -> StatusTable:
        """A new table: the default one is shared by every service, so it is never changed in place."""
        return StatusTable({**self._rules, **rules})

    def status(self, exc: Exception) -> Status:
        carried = getattr(exc, "code", None)
        if isinstance(carried, grpc.StatusCode):
            return carried, str(getattr(exc, "message", exc))
        for cls in type(exc).__mro__:
            rule = self._rules.get(cls)
            if rule is not None:
                return (rule, str(exc)) if isinstance(rule, grpc.StatusCode) else rule(exc)
        return grpc.StatusCode.INTERNAL, BUG_MESSAGE


BUG_MESSAGE = "internal error in the service; see its log"
DEFAULT_STATUSES = StatusTable({
    ValueError: grpc.StatusCode.INVALID_ARGUMENT,
    TypeError: grpc.StatusCode.INVALID_ARGUMENT,
    Exception: internal(BUG_MESSAGE),
})


def _ended(exc: BaseException) -> bool:
    """The call has its status already: the handler aborted it, or it was cancelled or closed."""
    return isinstance(exc, grpc.aio.AbortError) or not isinstance(exc, Exception)


def outcome(exc: BaseException, context: grpc.aio.ServicerContext,
            table: StatusTable = DEFAULT_STATUSES) -> tuple[str, str]:
    """(status name, message) the call ends with once ``exc`` leaves its handler."""
    if _ended(exc):
        return status_name(context), context.details() or ""
    code, message = table.status(exc)
    return code.name, message


class StatusInterceptor(grpc.aio.ServerInterceptor):
    """The one place a server's calls get their status from an exception, and are counted.

    ``tables``: the ``StatusTable`` of each service by its full name (services not named, health and
    reflection among them, use ``DEFAULT_STATUSES``). A server is created with its interceptor before its
    services are added, so ``RunningServer.start`` fills this in.
    """

    def __init__(self, tables: Mapping[str, StatusTable] | None = None) -> None:
        self.tables: dict[str, StatusTable] = dict(tables or {})

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:  # an unknown method: gRPC answers UNIMPLEMENTED itself
            return handler
        service, _, method = handler_call_details.method.lstrip("/").rpartition("/")
        call = _Call(service, method, self.tables.get(service, DEFAULT_STATUSES))
        if handler.unary_unary is not None:
            return _rebuild(handler, grpc.unary_unary_rpc_method_handler, call.unary(handler.unary_unary))
        if handler.unary_stream is not None:
            return _rebuild(handler, grpc.unary_stream_rpc_method_handler, call.stream(handler.unary_stream))
        if handler.stream_unary is not None:
            return _rebuild(handler, grpc.stream_unary_rpc_method_handler, call.unary(handler.stream_unary))
        return _rebuild(handler, grpc.stream_stream_rpc_method_handler, call.stream(handler.stream_stream))


def _rebuild(handler: grpc.RpcMethodHandler, make: Callable[..., grpc.RpcMethodHandler],
             behavior: Callable[..., Any] | None) -> grpc.RpcMethodHandler:
    if behavior is None:  # a synchronous handler (none of ours): left as it is
        return handler
    return make(behavior, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


class _Call:
    """The wrapping of one method's handler."""

    __slots__ = ("method", "service", "table")

    def __init__(self, service: str, method: str, table: StatusTable) -> None:
        self.service, self.method, self.table = service, method, table

    def unary(self, behavior: Callable[..., Any]) -> Callable[..., Any] | None:
        """A handler that returns its one response (unary or client-streaming requests)."""
        if not inspect.iscoroutinefunction(behavior):
            return None

        async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
            async with self._ending(context):
                return await behavior(request, context)

        return handle

    def stream(self, behavior: Callable[..., Any]) -> Callable[..., Any] | None:
        """A handler of a response stream: an async generator, or a coroutine that ``context.write``s."""
        if inspect.iscoroutinefunction(behavior):  # e.g. grpc.health.v1's Watch
            return self.unary(behavior)
        if not inspect.isasyncgenfunction(behavior):
            return None

        async def handle(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async with self._ending(context), contextlib.aclosing(behavior(request, context)) as responses:
                async for response in responses:
                    yield response

        return handle

    @contextlib.asynccontextmanager
    async def _ending(self, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        """Around one call: end it with the status of an exception that escapes its handler (unless it has
        one already), and count how it ended."""
        code = "CANCELLED"
        try:
            yield
            code = _returned(context)
        except BaseException as exc:
            if _ended(exc):
                code = status_name(context)
                raise
            status = self.table.status(exc)
            code = status[0].name
            if status[0] == grpc.StatusCode.INTERNAL:
                log.error("/%s/%s failed", self.service, self.method, exc_info=exc)
            await context.abort(*status)  # raises: the call ends here
        finally:
            HANDLED.labels(self.service, self.method, code).inc()


def _returned(context: grpc.aio.ServicerContext) -> str:
    """A handler that returned may still have set a status (``context.set_code``)."""
    code = context.code()
    return code.name if isinstance(code, grpc.StatusCode) else "OK"


class HandledView(Collector):
    """An older per-service outcome counter, ``name{code}``, read from ``HANDLED`` at scrape time: dashboards
    and alerts on it keep working, and nothing counts twice."""

    def __init__(self, name: str, doc: str, service: str, methods: Iterable[str]) -> None:
        self.name, self.doc, self.service, self.methods = name, doc, service, frozenset(methods)

    def describe(self) -> list[CounterMetricFamily]:
        return [CounterMetricFamily(self.name, self.doc, labels=["code"])]

    def collect(self) -> list[CounterMetricFamily]:
        totals: dict[str, float] = {}
        for metric in HANDLED.collect():
            for s in metric.samples:
                if (s.name.endswith("_total") and s.labels["grpc_service"] == self.service
                        and s.labels["grpc_method"] in self.methods):
                    totals[s.labels["grpc_code"]] = totals.get(s.labels["grpc_code"], 0.0) + s.value
        family = CounterMetricFamily(self.name, self.doc, labels=["code"])
        for code, total in sorted(totals.items()):
            family.add_metric([code], total)
        return [family]


def handled_view(name: str, doc: str, service: str, methods: Iterable[str],
                 registry: CollectorRegistry = REGISTRY) -> HandledView:
    """A ``HandledView`` registered in ``registry``."""
    view = HandledView(name, doc, service, methods)
    registry.register(view)
    return view
