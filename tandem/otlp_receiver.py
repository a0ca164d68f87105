"""A minimal OTLP/gRPC trace receiver: spans in, the JSONL records ``tandem trace`` reads out.

For a laptop without a collector, and for tests: point the services at it with
``OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317`` and read the file with
``tandem trace --file``. A real deployment sends OTLP to its collector instead.

    python -m tandem.otlp_receiver --port 4317 --file spans.jsonl
"""

from __future__ import annotations

import argparse
import json
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tspb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as tspb_grpc
from opentelemetry.proto.common.v1 import common_pb2

STATUS = {0: "UNSET", 1: "OK", 2: "ERROR"}


def any_value(v: common_pb2.AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [any_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return attributes(v.kvlist_value.values)
    return getattr(v, kind) if kind else None


def attributes(kvs: Iterable[common_pb2.KeyValue]) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in kvs}


def records(request: tspb.ExportTraceServiceRequest) -> list[dict[str, Any]]:
    """OTLP spans as ``tandem trace`` records (the fields of ``common.telemetry.span_record``)."""
    out = []
    for rs in request.resource_spans:
        resource = attributes(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append({
                    "trace_id": s.trace_id.hex(),
                    "span_id": s.span_id.hex(),
                    "parent_span_id": s.parent_span_id.hex(),
                    "name": s.name,
                    "service": resource.get("service.name", ""),
                    "start_ns": s.start_time_unix_nano,
                    "end_ns": s.end_time_unix_nano,
                    "status": STATUS.get(s.status.code, "UNSET"),
                    "status_message": s.status.message,
                    "attributes": attributes(s.attributes),
                    "events": [{"name": e.name, "time_ns": e.time_unix_nano,
                                "attributes": attributes(e.attributes)}
                               for e in s.events],
                })
    return out


class Receiver(tspb_grpc.TraceServiceServicer):
    """Keeps every span it receives, and appends them to ``path`` when given."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self.spans: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def Export(self, request: tspb.ExportTraceServiceRequest, context: Any) -> tspb.ExportTraceServiceResponse:
        got = records(request)
        with self._lock:
            self.spans.extend(got)
            if self.path is not None:
                with self.path.open("a") as f:
                    f.writelines(json.dumps(r, separators=(",", ":")) + "\n" for r in got)
        return tspb.ExportTraceServiceResponse()

    def snapshot(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.spans)


def start(port: int = 0, path: Path | None = None, host: str = "127.0.0.1") -> tuple[grpc.Server, int, Receiver]:
    """A receiver on a thread-pool server (usable from tests that run no event loop)."""
    from concurrent.futures import ThreadPoolExecutor

    receiver = Receiver(path)
    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    tspb_grpc.add_TraceServiceServicer_to_server(receiver, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    server.start()
    return server, bound, receiver


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem.otlp_receiver")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=4317)
    p.add_argument("--file", type=Path, required=True)
    args = p.parse_args(argv)
    server, port, _ = start(args.port, args.file, args.host)
    print(f"OTLP receiver on {args.host}:{port}, spans to {args.file}", flush=True)
    try:
        server.wait_for_termination()
    except KeyboardInterrupt:
        server.stop(1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
