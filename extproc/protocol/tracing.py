"""OpenTelemetry tracing of routed requests (docs/operations.md "Tracing"), off unless the routing
config sets `tracing.otlp_endpoint`.

On, every request that reaches routing gets one span, from its parsed body to the end of its
response (the ext_proc stream's end), named and attributed after OpenTelemetry's GenAI semantic
conventions (`{gen_ai.operation.name} {gen_ai.request.model}`, kind CLIENT: the gateway is the
client of the provider that generates):

- `gen_ai.operation.name` (`chat`, `text_completion`, `embeddings`; a Responses API request is
  `chat`), `gen_ai.provider.name` (`openai`: the API's flavour, as the conventions define it; the
  deployment is `iris.routing.provider`), `gen_ai.request.model` (the client's model name, a
  configured one), `gen_ai.conversation.id` (an opaque hash of the session, the affinity key:
  never the identity or the session id), `server.address` / `server.port` (a provider with one
  endpoint), `gen_ai.usage.input_tokens` / `gen_ai.usage.output_tokens` (when the answer's usage
  was read: `token_usage`), `http.response.status_code`, `error.type`;
- the routing outcome: `iris.routing.provider`, `iris.routing.provider_kind` (managed,
  unlimited), `iris.routing.reason` (pinned, new_pin, repinned, offloaded, unpinned; rejected
  when the router answered itself, `error.type` then being the code it sent), and
  `iris.routing.decision_ms`.

The client's `traceparent` (and `tracestate`), when it sent one, is the span's parent, and its
sampling decision is followed (ParentBased); a trace started here is sampled at
`tracing.sample_ratio`. The span's own context goes to the provider in `traceparent`, set by the
routing answer's header mutation, so the engine's spans (vLLM's `--otlp-traces-endpoint`) are its
children. A third party (an unlimited provider without `forward_client_identity`) gets no trace
context at all, nor the client's W3C `baggage` (WITHHELD_HEADERS), on a generation as on a
lookup of a stored response by id: the client's trace id would link its requests, as a session
id would.

Spans leave through the SDK's batch processor (a thread of its own, a bounded queue that drops
when the collector is away) to an OTLP/gRPC exporter. The SDK is imported only when tracing is
on; off, the stream loop holds no tracer and pays one `is None` test per phase.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from urllib.parse import urlsplit

from extproc.config import Provider, ProviderKind
from extproc.config.schema import TracingSettings
from extproc.openai_api.adaptation import affinity_key

log = logging.getLogger(__name__)

TRACE_HEADERS = ("traceparent", "tracestate")  # W3C Trace Context
# What a third party that gets no trace context loses (tracing on): the trace context and the
# W3C Baggage header that travels with it (it may carry user and session ids).
WITHHELD_HEADERS = (*TRACE_HEADERS, "baggage")
OPERATION_NAMES = {"chat": "chat", "completions": "text_completion", "embeddings": "embeddings", "responses": "chat"}
PROVIDER_FLAVOUR = "openai"  # gen_ai.provider.name: every provider speaks OpenAI's API
REJECTED = "rejected"
CLOSE_WITHIN_SECONDS = 2.0  # the drain waits this long, at most, for the spans still queued to leave
STALE_PROTO_ISSUE = "https://github.com/grpc/grpc/issues/42926"


class TracingUnavailable(RuntimeError):
    """Tracing is on but its OTLP exporter cannot be imported (the message says why and what fixes
    it). `iris-extproc serve` refuses to start with it, as for a bad session secret."""


def carrier(headers: dict[str, str]) -> dict[str, str] | None:
    """The trace context headers of a request (lowercase name -> value), or None without any."""
    found = {name: headers[name] for name in TRACE_HEADERS if name in headers}
    return found or None


class RequestTracer:
    """Spans of routed requests over one TracerProvider (module docstring). `exporter`: a span
    exporter to use instead of OTLP/gRPC to `settings.otlp_endpoint` (None: that one)."""

    def __init__(self, settings: TracingSettings, exporter=None):
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        if exporter is None:
            exporter_class = otlp_span_exporter()
            endpoint = settings.otlp_endpoint
            exporter = exporter_class(endpoint=endpoint, insecure=endpoint.startswith("http://"))
        self._provider = TracerProvider(
            resource=Resource.create({"service.name": settings.service_name}),
            sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)),
            shutdown_on_exit=False,  # `close` bounds the wait; an exit hook would wait for an absent collector
        )
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("iris-extproc")
        self._propagator = TraceContextTextMapPropagator()
        self._client, self._error = SpanKind.CLIENT, Status(StatusCode.ERROR)
        self._in_context = set_span_in_context

    def start(self, trace_headers: dict[str, str] | None, feature: str, model: str):
        """A started span for a request of `feature` for `model` (a configured name), child of
        the client's trace context `trace_headers` (carrier()) when there is one."""
        parent = self._propagator.extract(trace_headers) if trace_headers else None
        operation = OPERATION_NAMES.get(feature, feature)
        attributes = {"gen_ai.operation.name": operation, "gen_ai.provider.name": PROVIDER_FLAVOUR, "gen_ai.request.model": model}
        return self._tracer.start_span(f"{operation} {model}", context=parent, kind=self._client, attributes=attributes)

    def routed(self, span, provider: Provider, reason: str, session_id: str | None, decision_ms: float) -> dict[str, str]:
        """Record the decision on `span`; returns the trace context headers for the provider
        (empty for a third party that gets none: the module docstring)."""
        if span.is_recording():
            span.set_attributes({
                "iris.routing.provider": provider.name, "iris.routing.provider_kind": provider.kind.value,
                "iris.routing.reason": reason, "iris.routing.decision_ms": decision_ms,
            })
            if session_id is not None:
                span.set_attribute("gen_ai.conversation.id", affinity_key(session_id))
            address = server_address(tuple(provider.endpoints))
            if address is not None:
                span.set_attributes({"server.address": address[0], "server.port": address[1]})
        if not receives_trace_context(provider):
            return {}
        headers: dict[str, str] = {}
        self._propagator.inject(headers, context=self._in_context(span))
        return headers

    def rejected(self, span, status: int, code: str, decision_ms: float | None = None) -> None:
        """The router answered the request itself (`status`, error `code`): record and end `span`."""
        span.set_attributes({"iris.routing.reason": REJECTED, "http.response.status_code": status, "error.type": code})
        if decision_ms is not None:
            span.set_attribute("iris.routing.decision_ms", decision_ms)
        span.set_status(self._error)
        span.end()

    def usage(self, span, input_tokens: int, output_tokens: int) -> None:
        """The token usage the provider reported."""
        span.set_attributes({"gen_ai.usage.input_tokens": input_tokens, "gen_ai.usage.output_tokens": output_tokens})

    def finish(self, span, status: int | None) -> None:
        """The response ended: its HTTP `status` (None: none came, the request was cut short)."""
        if status is None:
            span.set_attribute("error.type", "incomplete")
            span.set_status(self._error)
        else:
            span.set_attribute("http.response.status_code", status)
            if status >= 400:
                span.set_attribute("error.type", str(status))
                span.set_status(self._error)
        span.end()

    def shutdown(self) -> None:
        """Export what is queued and stop. Blocks, as long as the exporter retries (seconds, when
        the collector is away): `close` bounds it."""
        self._provider.shutdown()

    async def close(self, within_seconds: float = CLOSE_WITHIN_SECONDS) -> None:
        """`shutdown` in a daemon thread, awaited for at most `within_seconds`: spans that cannot
        leave by then are dropped, and the process may exit."""
        done = threading.Event()

        def shut() -> None:
            try:
                self.shutdown()
            finally:
                done.set()

        threading.Thread(target=shut, name="tracing-shutdown", daemon=True).start()
        await asyncio.to_thread(done.wait, within_seconds)


def otlp_span_exporter() -> type:
    """The OTLP/gRPC span exporter's class. Raises TracingUnavailable when it cannot be imported.

    The usual cause: xds-protos (the Envoy API types) ships an old copy of opentelemetry-proto's
    modules at the same paths, and the one installed last owns the files; when xds-protos wins,
    the exporter's `InstrumentationScope` import fails (grpc/grpc#42926). Reinstalling
    opentelemetry-proto after everything else (`./dev` and the Dockerfile do) mends it."""
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError as exc:
        advice = ""
        if "opentelemetry.proto" in str(exc):
            advice = (f"; xds-protos overwrote opentelemetry-proto's modules with an older copy ({STALE_PROTO_ISSUE}): "
                      f"reinstall it last, pip install --force-reinstall --no-deps opentelemetry-proto=={_installed('opentelemetry-proto')}")
        raise TracingUnavailable(f"tracing.otlp_endpoint is set but the OTLP exporter cannot be imported ({exc}){advice}") from None
    return OTLPSpanExporter


def _installed(distribution: str) -> str:
    """The installed version of `distribution` ('<version>' when it is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "<version>"


def start_tracing(settings: TracingSettings) -> RequestTracer | None:
    """A RequestTracer when `settings.otlp_endpoint` is set, else None (tracing off)."""
    if settings.otlp_endpoint is None:
        return None
    log.info("tracing: spans to %s (OTLP/gRPC), sample ratio %s", settings.otlp_endpoint, settings.sample_ratio)
    return RequestTracer(settings)


def receives_trace_context(provider: Provider) -> bool:
    """Whether `provider` gets the trace context: own providers, and third parties that get the
    client's identity (`forward_client_identity`)."""
    return provider.kind is ProviderKind.MANAGED or provider.forward_client_identity


@functools.lru_cache(maxsize=256)
def server_address(endpoints: tuple[str, ...]) -> tuple[str, int] | None:
    """(host, port) of a provider with exactly one endpoint URL, else None (a pool: Envoy picks)."""
    if len(endpoints) != 1:
        return None
    url = urlsplit(endpoints[0])
    port = url.port or (443 if url.scheme == "https" else 80)
    return (url.hostname, port) if url.hostname else None
