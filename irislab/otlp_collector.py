"""A small OpenTelemetry collector for the lab: OTLP/gRPC's TraceService (`Export`, from the
`opentelemetry-proto` package) on a loopback port, keeping every span it receives in memory.

The tracing tests start one and point the gateway's `tracing.otlp_endpoint` at it; `python -m
irislab.otlp_collector --port 4317` runs one alone and prints each span as a JSON line (point
`iris-lab up`'s routing config at it to watch the spans of a demo).
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import asdict, dataclass, field
from typing import Any

import grpc
import orjson
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

SPAN_KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
STATUS_CODES = {0: "UNSET", 1: "OK", 2: "ERROR"}


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as received: ids in lowercase hex (`parent_span_id` "" for a root span), its
    name, kind (CLIENT, SERVER...), status (UNSET, OK, ERROR), attributes and its resource's."""

    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    kind: str
    status: str
    attributes: dict[str, Any] = field(default_factory=dict)
    resource: dict[str, Any] = field(default_factory=dict)


def _value(value: AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which == "array_value":
        return [_value(v) for v in value.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, which) if which else None


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, collector: OtlpCollector):
        self.collector = collector

    def Export(self, request, context):  # noqa: N802 (gRPC name)
        received = []
        for resource_spans in request.resource_spans:
            resource = {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(ReceivedSpan(
                        trace_id=span.trace_id.hex(), span_id=span.span_id.hex(), parent_span_id=span.parent_span_id.hex(),
                        name=span.name, kind=SPAN_KINDS.get(span.kind, str(span.kind)),
                        status=STATUS_CODES.get(span.status.code, str(span.status.code)),
                        attributes={kv.key: _value(kv.value) for kv in span.attributes}, resource=resource,
                    ))
        self.collector._receive(received)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpCollector:
    """An OTLP/gRPC trace receiver on `host`:`port` (0: a free port), in threads of this process.
    `on_span`: called with each span received (in a gRPC thread)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, on_span: Callable[[ReceivedSpan], None] | None = None):
        self.host = host
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self._on_span = on_span
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), self._server)
        self.port = self._server.add_insecure_port(f"{host}:{port}")

    @property
    def endpoint(self) -> str:
        """What `tracing.otlp_endpoint` should say: `http://host:port`."""
        return f"http://{self.host}:{self.port}"

    def start(self) -> OtlpCollector:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=None)

    def __enter__(self) -> OtlpCollector:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def spans(self) -> list[ReceivedSpan]:
        """Every span received so far, in arrival order."""
        with self._lock:
            return list(self._spans)

    def wait_for(self, predicate: Callable[[list[ReceivedSpan]], bool], within_seconds: float) -> list[ReceivedSpan]:
        """Poll until `predicate(spans())` holds or `within_seconds` pass; returns spans() then."""
        deadline = time.monotonic() + within_seconds
        while True:
            spans = self.spans()
            if predicate(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.05)

    def _receive(self, spans: list[ReceivedSpan]) -> None:
        with self._lock:
            self._spans += spans
        if self._on_span is not None:
            for span in spans:
                self._on_span(span)


def main(argv: list[str] | None = None) -> None:
    """Run a collector until Ctrl-C, printing each span received as a JSON line."""
    parser = argparse.ArgumentParser(prog="python -m irislab.otlp_collector", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=4317)
    args = parser.parse_args(argv)
    collector = OtlpCollector(args.host, args.port, on_span=lambda span: print(orjson.dumps(asdict(span)).decode(), flush=True))
    with collector:
        print(f"OTLP/gRPC collector on {collector.endpoint}", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
