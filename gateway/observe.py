"""The telemetry of one Generate call: its root span, the route span, and the request metrics.

The root span ``gateway.generate`` is the trace of the request: every other
service's spans hang under it through the context the gateway sends in its
calls' metadata. It ends with the call, with the gRPC status of the outcome,
and carries ``ttft_ms`` with its breakdown, so a trace viewer shows where the
time to first token went without joining spans.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from common import telemetry
from common.metrics import RequestMetrics
from protos import gateway_pb2 as gpb

# Timings fields that add up to ttft_ms, in the order of the request's life.
TTFT_PARTS = ("tokenize_ms", "route_ms", "prefill_queue_ms", "prefill_compute_ms", "first_token_ms")


class Reroutes:
    """The gateway's counts of requests sent on to another worker (its Stats and its metrics), kept in step:
    the generations that re-send a request count through these methods, and nothing else writes them."""

    def __init__(self, metrics: RequestMetrics) -> None:
        self._metrics = metrics
        self._prefill_retries = 0
        self._migrations = 0

    @property
    def prefill_retries(self) -> int:
        return self._prefill_retries

    @property
    def migrations(self) -> int:
        return self._migrations

    def prefill_retried(self) -> None:
        self._prefill_retries += 1
        self._metrics.prefill_retries.inc()

    def migrated(self) -> None:
        self._migrations += 1
        self._metrics.migrations.inc()


class RequestRecord:
    def __init__(self, metrics: RequestMetrics, metadata: Sequence[tuple[str, Any]] | None, inflight: int) -> None:
        self.metrics = metrics
        self.start = time.monotonic()
        self.root = telemetry.tracer().start_span(
            "gateway.generate", context=telemetry.incoming(metadata), kind=SpanKind.SERVER,
            attributes={"gateway.inflight_at_admission": inflight})
        self.ctx = telemetry.context_of(self.root)
        self._outgoing = telemetry.outgoing(self.ctx)  # the context never changes: injected once, not per call
        self.route: Span | None = None
        self.tokens_sent = 0
        self._last_sent: float | None = None

    def metadata(self) -> list[tuple[str, str]]:
        """For calls made on behalf of the request: their spans join its trace."""
        return self._outgoing

    def start_route(self) -> list[tuple[str, str]]:
        self.route = telemetry.tracer().start_span("gateway.route", context=self.ctx)
        return telemetry.outgoing(telemetry.context_of(self.route))

    def end_route(self, **attributes: Any) -> None:
        if self.route is not None:
            self.route.set_attributes(attributes)
            self.route.end()
            self.route = None

    def attributes(self, **attributes: Any) -> None:
        self.root.set_attributes(attributes)

    def sent(self, msg: gpb.GenerateResponse) -> None:
        """A message went to the client: the gap since the last one is an inter-token latency."""
        n = len(msg.token_ids)
        if not n:
            return
        now = time.monotonic()
        if self._last_sent is not None:
            self.metrics.itl.observe(now - self._last_sent)
        self._last_sent = now
        self.tokens_sent += n
        self.metrics.generation_tokens.inc(n)

    def finish(self, code: str, message: str, last: gpb.GenerateResponse | None) -> None:
        # The call's outcome is counted by the server's status interceptor (tandem_requests is a view of it).
        self.end_route()
        self.root.set_attribute("gen_ai.usage.output_tokens", self.tokens_sent)
        if last is not None and last.HasField("usage"):
            self._finished(last)
        if code != "OK":
            telemetry.fail(self.root, code, message)
        else:
            self.root.set_attribute("rpc.grpc.status_code", "OK")
            self.root.set_status(Status(StatusCode.OK))
        self.root.end()

    def _finished(self, last: gpb.GenerateResponse) -> None:
        t, u = last.timings, last.usage
        m = self.metrics
        m.ttft.observe(t.ttft_ms / 1000)
        m.e2e.observe(t.e2e_ms / 1000)
        m.queue.observe(t.queue_ms / 1000)
        if u.completion_tokens > 1:
            m.tpot.observe((t.e2e_ms - t.ttft_ms) / 1000 / (u.completion_tokens - 1))
        m.prompt_tokens.inc(u.prompt_tokens)
        m.cached_tokens.inc(u.cached_tokens)
        attrs = {
            "gen_ai.usage.input_tokens": u.prompt_tokens,
            "tandem.cached_tokens": u.cached_tokens,
            "tandem.finish_reason": last.finish_reason,
            "ttft_ms": t.ttft_ms,
            "e2e_ms": t.e2e_ms,
            "kv_push_ms": t.kv_push_ms,
            "kv_pull_ms": t.kv_pull_ms,
            "decode_queue_ms": t.decode_queue_ms,
            "tandem.prefill_worker": last.prefill_worker,
            "tandem.decode_worker": last.decode_worker,
        }
        attrs.update({f"ttft.{name}": getattr(t, name) for name in TTFT_PARTS})
        self.root.set_attributes(attrs)
