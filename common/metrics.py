"""Prometheus metrics of every service, named in the style of vLLM's with a ``tandem_`` prefix.

Events (a request finished, a token sent, a transfer done) are observed where
they happen; state (running and waiting requests, KV usage, the store's blocks)
is read at scrape time by a collector, so nothing is updated per engine step.
Each service serves ``/metrics`` over HTTP on ``--metrics-port`` (0: a free port,
announced on its READY line; -1: off).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import REGISTRY, Collector, CollectorRegistry

from common.settings import env_default
from common.status import handled_view
from protos import gateway_pb2

# Buckets after vLLM's: request latencies span milliseconds to minutes on CPU and GPU alike.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 10.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


def add_metrics_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--metrics-port", type=int, default=env_default("--metrics-port", 0),
                   help="HTTP port of Prometheus /metrics (0: a free one, announced on the READY line; -1: off)")


def serve_metrics(host: str, port: int) -> int | None:
    """Start the /metrics endpoint in a background thread; its port, None when off."""
    if port < 0:
        return None
    server, _ = start_http_server(port, addr=host)
    return server.server_port


class StateCollector(Collector):
    """Gauges and counters read from a service's own state at scrape time."""

    def __init__(self, read: Callable[[], Iterable[Any]]) -> None:
        self._read = read

    def collect(self) -> Iterable[Any]:
        return list(self._read())


def register_state(read: Callable[[], Iterable[Any]]) -> None:
    REGISTRY.register(StateCollector(read))


def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


class RequestMetrics:
    """What the gateway observes of every request, as the client sees it."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        r = registry  # tests give each in-process gateway its own
        self.ttft = Histogram("tandem_time_to_first_token_seconds", "Time to first token, at the gateway",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("tandem_inter_token_latency_seconds", "Time between consecutive streamed messages",
                             buckets=ITL_BUCKETS, registry=r)
        self.tpot = Histogram("tandem_request_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request", buckets=ITL_BUCKETS,
                              registry=r)
        self.e2e = Histogram("tandem_e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=E2E_BUCKETS, registry=r)
        self.queue = Histogram("tandem_request_queue_time_seconds",
                               "Time requests waited in engine queues (prefill + decode)", buckets=TTFT_BUCKETS,
                               registry=r)
        self.prompt_tokens = Counter("tandem_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("tandem_generation_tokens", "Tokens generated and sent", registry=r)
        self.cached_tokens = Counter("tandem_prompt_tokens_cached",
                                     "Prompt tokens served from a cache (engine or kvstore)", registry=r)
        # Generate calls as the status interceptor counts them (tandem_grpc_server_handled_total), by code.
        self.outcomes = handled_view("tandem_requests", "Requests by final gRPC status code",
                                     gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name, ("Generate",), r)
        self.running = Gauge("tandem_num_requests_running", "Requests in flight at the gateway", registry=r)
        self.prefill_retries = Counter("tandem_prefill_retries", "Prefill attempts re-sent to another worker",
                                       registry=r)
        self.migrations = Counter("tandem_migrations", "Requests moved to another decode worker mid-stream",
                                  registry=r)
        # Only with API keys on: the names come from the keys file, so the label is bounded.
        self.api_key_requests = Counter("tandem_api_key_requests", "Generate calls by API key name and final "
                                        "gRPC status code", ["api_key", "code"], registry=r)


class TransferMetrics:
    """KV moved between an engine and the kvstore."""

    def __init__(self) -> None:
        self.bytes = Counter("tandem_kv_transfer_bytes", "KV bytes moved to or from the kvstore", ["direction"])
        self.seconds = Histogram("tandem_kv_transfer_seconds", "Duration of one KV push or pull",
                                 ["direction"], buckets=TRANSFER_BUCKETS)
        self.blocks = Counter("tandem_kv_transfer_blocks", "KV blocks moved to or from the kvstore", ["direction"])

    def observe(self, direction: str, blocks: int, nbytes: int, seconds: float) -> None:
        self.bytes.labels(direction).inc(nbytes)
        self.blocks.labels(direction).inc(blocks)
        self.seconds.labels(direction).observe(seconds)


_transfer: TransferMetrics | None = None


def transfer_metrics() -> TransferMetrics:
    """One set per process (a worker's connector pushes or pulls)."""
    global _transfer
    if _transfer is None:
        _transfer = TransferMetrics()
    return _transfer
