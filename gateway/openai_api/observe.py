"""The telemetry of the HTTP front: a span per request, and requests counted by route and status."""

from __future__ import annotations

from collections.abc import Iterable

from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import Counter

from common import telemetry

HTTP_REQUESTS = Counter("tandem_http_requests", "Requests to the OpenAI-compatible HTTP API, by route and status",
                        ["route", "status"])
TRACE_HEADERS = ("traceparent", "tracestate")


class HttpRecord:
    """The telemetry of one HTTP request: its span, the parent of each choice's ``gateway.generate`` (so a
    request with ``n`` choices is one trace), and its count in ``tandem_http_requests_total``."""

    def __init__(self, route: str, headers: Iterable[tuple[str, str]], choices: int) -> None:
        headers = [(k.lower(), v) for k, v in headers]
        self.route = route
        self.span = telemetry.tracer().start_span(
            f"POST {route}", context=telemetry.incoming(headers), kind=SpanKind.SERVER,
            attributes={"http.request.method": "POST", "url.path": route, "tandem.choices": choices})
        # what each Generate call reads as its metadata: the client's headers, in this span's trace
        self.headers = [(k, v) for k, v in headers if k not in TRACE_HEADERS]
        self.headers += telemetry.outgoing(telemetry.context_of(self.span))
        self.code: int | None = None

    def status(self, code: int) -> None:
        if self.code is None:
            self.code = code

    def end(self) -> None:
        code = self.code or 500
        HTTP_REQUESTS.labels(self.route, str(code)).inc()
        self.span.set_attribute("http.response.status_code", code)
        if code >= 500:
            self.span.set_status(Status(StatusCode.ERROR))
        self.span.end()
