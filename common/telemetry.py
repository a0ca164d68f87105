"""Tracing for every service: one OpenTelemetry trace per request, carried in gRPC metadata.

Configuration is the standard one: ``OTEL_EXPORTER_OTLP_ENDPOINT`` (OTLP/gRPC
export), ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``,
``OTEL_TRACES_SAMPLER``, ``OTEL_BSP_*``, ``OTEL_SDK_DISABLED``. Without an
endpoint, spans go to the JSONL file named by ``TANDEM_TRACE_FILE`` (what
``tandem up`` sets, and what ``tandem trace`` reads); with neither, nothing is
recorded and the calls below cost next to nothing.

Spans that describe time spent inside an engine (queueing, prefill, the first
decode step) are recorded after the fact from the engine's own timestamps, so the
engine thread never touches the tracer; ``span_at`` converts those monotonic
stamps to the wall clock spans use.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from common.paths import tandem_home

log = logging.getLogger("tandem.telemetry")

TRACER = "tandem"
TRACE_FILE_ENV = "TANDEM_TRACE_FILE"
OTLP_ENDPOINT_ENVS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
_provider = None
# The offset between the monotonic clock (engine stamps) and the wall clock (span times), fixed once.
_WALL_MINUS_MONO_NS = time.time_ns() - time.monotonic_ns()


def default_trace_file() -> Path:
    return tandem_home() / "traces.jsonl"


def setup_tracing(service: str, instance: str = "") -> bool:
    """Install the tracer provider of this process; False when tracing is off (no exporter)."""
    global _provider
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = _exporter()
    if exporter is None:
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attributes = {"service.namespace": "tandem"}
    if not os.environ.get("OTEL_SERVICE_NAME"):
        attributes["service.name"] = f"tandem-{service}"
    if instance and "service.instance.id" not in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", ""):
        attributes["service.instance.id"] = instance  # the deployment's own id wins when it gives one
    _provider = TracerProvider(resource=Resource.create(attributes))
    _provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(_provider)
    return True


def _exporter():
    if any(os.environ.get(k) for k in OTLP_ENDPOINT_ENVS):
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    path = os.environ.get(TRACE_FILE_ENV)
    return JsonlSpanExporter(Path(path)) if path else None


def shutdown_tracing() -> None:
    """Flush what is buffered (a stopping service still exports its last spans)."""
    if _provider is not None:
        _provider.shutdown()


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER)


# -- context in gRPC metadata ------------------------------------------------------------------


def incoming(metadata: Sequence[tuple[str, Any]] | None) -> otel_context.Context:
    """The caller's trace context, from the W3C ``traceparent`` in a call's metadata."""
    carrier = {k: v for k, v in (metadata or ()) if isinstance(v, str)}
    return propagate.extract(carrier)


def outgoing(ctx: otel_context.Context | None = None) -> list[tuple[str, str]]:
    """Metadata that carries ``ctx`` (default: the current context) to the next service."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=ctx)
    return list(carrier.items())


def context_of(span: Span) -> otel_context.Context:
    return trace.set_span_in_context(span)


# -- spans -------------------------------------------------------------------------------------


def wall_ns(monotonic_s: float) -> int:
    """A ``time.monotonic()`` stamp as nanoseconds since the epoch."""
    return int(monotonic_s * 1e9) + _WALL_MINUS_MONO_NS


def span_at(name: str, parent: otel_context.Context, start_mono: float, end_mono: float,
            attributes: Mapping[str, Any] | None = None) -> None:
    """A finished span for an interval measured elsewhere (monotonic seconds)."""
    span = tracer().start_span(name, context=parent, start_time=wall_ns(start_mono), attributes=attributes)
    span.end(end_time=wall_ns(max(end_mono, start_mono)))


@contextmanager
def span(name: str, parent: otel_context.Context | None = None, kind: SpanKind = SpanKind.INTERNAL,
         attributes: Mapping[str, Any] | None = None) -> Iterator[Span]:
    """A live span; an exception ends it with an error status and goes on."""
    s = tracer().start_span(name, context=parent, kind=kind, attributes=attributes)
    try:
        yield s
    except BaseException as exc:
        fail(s, type(exc).__name__, str(exc))
        raise
    finally:
        s.end()


def fail(s: Span, code: str, message: str = "") -> None:
    s.set_attribute("rpc.grpc.status_code", code)
    s.set_status(Status(StatusCode.ERROR, f"{code}: {message}" if message else code))


def server_span(name: str, metadata: Sequence[tuple[str, Any]] | None,
                attributes: Mapping[str, Any] | None = None) -> Any:
    """The span of one RPC on the server side, a child of the caller's."""
    return span(name, incoming(metadata), SpanKind.SERVER, attributes)


# -- the local file --------------------------------------------------------------------------


class JsonlSpanExporter:
    """One JSON object per span, appended to a file several processes share (``tandem trace`` reads it).

    Each batch is one ``write`` on a file opened with O_APPEND, so lines of different
    processes never interleave.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[Any]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        text = "".join(json.dumps(span_record(s), separators=(",", ":")) + "\n" for s in spans)
        try:
            with self._lock:
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, text.encode())
                finally:
                    os.close(fd)
        except OSError as exc:
            log.warning("could not write spans to %s: %s", self.path, exc)
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def span_record(s: Any) -> dict[str, Any]:
    """The fields ``tandem trace`` needs, from an SDK span (the OTLP names, hex ids)."""
    ctx, parent = s.get_span_context(), s.parent
    return {
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_span_id": f"{parent.span_id:016x}" if parent else "",
        "name": s.name,
        "service": s.resource.attributes.get("service.name", ""),
        "start_ns": s.start_time,
        "end_ns": s.end_time,
        "status": s.status.status_code.name,
        "status_message": s.status.description or "",
        "attributes": dict(s.attributes or {}),  # sequences are tuples: JSON arrays all the same
        "events": [{"name": e.name, "time_ns": e.timestamp, "attributes": dict(e.attributes or {})}
                   for e in s.events],
    }
