"""The stream loop of Envoy's ext_proc protocol: envoy.service.ext_proc.v3.ExternalProcessor/Process.

One gRPC stream per HTTP request. Phases, in the order Envoy sends them (see envoy/envoy.yaml):
request headers (path, method, identity and session headers; `GET /v1/models` is answered here)
-> request body, BUFFERED (parse, identity, session key, decide, route by setting the routing
header with clear_route_cache) -> response headers (record `:status`; a `/v1/responses` answer
asks for its body, and so does an answer whose token usage is counted: `token_usage`) -> response
body, only for those (record the response id: extproc.openai_api.chains; count the usage:
extproc.openai_api.usage) -> response trailers -> stream end, when the lease is released,
refreshing the pin only after a 2xx. An answer body is asked for BUFFERED only when it is JSON
that announces at most WHOLE_BODY_MAX_BYTES: Envoy fails (500) an answer larger than its buffer
that it must buffer, so any other is read STREAMED, chunk by chunk, and never held whole. With
tracing on (extproc.protocol.tracing), a span runs from the parsed body to the stream end.

The stream loop knows only Envoy's phases: it hands each decision to the lease table
(extproc.routing.lease_table), which owns every lease, and hands it the stream's end. The end reaches a
grpc.aio handler as the end of reads or as a cancellation; a done-callback on the call catches
any other way; the table's `end` is idempotent, so whichever comes first wins. A lease reported
lost ends the stream with an error; Envoy, failing closed, then resets the HTTP stream: that is
how the spec's "cancel the request" reaches the client.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Protocol

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest, ProcessingResponse

from extproc import metrics
from extproc.config import Config, Provider, ProviderKind
from extproc.openai_api.chains import ChainLink, ChainRecordsUnreadable, ResponseChains, ResponseReader
from extproc.openai_api.renaming import ModelNameRewriter
from extproc.openai_api.request import ParsedRequest, RequestError, feature_for_path, parse_request, response_lookup
from extproc.openai_api.sessions import HeaderSignals, SessionKeys, previous_response_id
from extproc.openai_api.usage import UsageReader
from extproc.protocol import answers, tracing
from extproc.protocol import messages as msg
from extproc.protocol.live import LiveConfig
from extproc.protocol.lookups import REASON as LOOKUP_REASON
from extproc.protocol.lookups import RENAMED_ACTIONS, RoutedLookup, refresh_looked_up, route_lookup
from extproc.routing.lease_table import Held, LeaseTable, Refusal
from extproc.routing.outage import RedisBreaker
from extproc.routing.placement import deciding_with, prompt_blocks
from extproc.routing.router import Decision, Rejection, RejectionKind, RoutingRequest
from extproc.storage.client import REDIS_FAILURES, in_own_task

log = logging.getLogger(__name__)

# A JSON answer to read or rewrite is asked for BUFFERED (one round trip, its content-length kept)
# only when its content-length says at most this many bytes: below Envoy's default buffer limit
# (1 MiB; envoy/envoy.yaml's listener has 16 MiB), which a larger buffered answer would exceed
# (Envoy then answers 500, response_payload_too_large). Any other is read STREAMED.
WHOLE_BODY_MAX_BYTES = 256 * 1024


class UpstreamObserver(Protocol):
    """What the stream loop reports of each routed request's response headers (implemented by
    extproc.operations.health.HealthMonitor: passive health and the connect degradation)."""

    async def connection_failed(self, provider: Provider, model: str, what: str, endpoint: str | None = None) -> None: ...

    def succeeded(self, provider: Provider, model: str) -> None: ...

    def observe(self, provider: Provider, model: str, status: int | None, endpoint: str | None = None) -> None: ...

@dataclass
class StreamState:
    """What one gRPC stream (one HTTP request) has learned so far."""

    path: str = ""
    method: str = ""
    signals: HeaderSignals = HeaderSignals()
    identity: str = ""
    priority_header: str | None = None  # the admission queue's trusted class header, when configured (docs/queue.md)
    session_id: str | None = None
    stores_response: bool = False  # a /v1/responses request whose answer is stored (store not false)
    chained_endpoint: tuple[str, str] | None = None  # (provider, ip:port) storing the previous response (affinity pick)
    prompt_blocks: tuple[str, ...] = ()  # the prompt's block hashes the decision placed with (affinity pick)
    background: bool = False  # a /v1/responses request with `background: true`
    reads_response_id: bool = False  # the answer's response id is worth its cost (see _routing_request)
    model: str = ""
    held: Held | None = None
    decision: Decision | None = None
    status: int | None = None
    reader: ResponseReader | None = None
    response_id: str | None = None  # the Responses answer's id, once recorded as a chain
    chain_running: bool = False  # the recorded response still runs (background): its record keeps the background TTL
    buffered: bool = False  # the answer body was asked for BUFFERED (whole, content-length kept)
    upstream_model: str | None = None  # the provider's name of the model, to rewrite in the answer
    rewriter: ModelNameRewriter | None = None
    lookup: RoutedLookup | None = None  # a stored response by id, routed in the headers phase
    ended: bool = False
    trace_headers: dict[str, str] | None = None  # the client's trace context (tracing on)
    span: object | None = None  # the request's span, until the stream ends (tracing on)
    usage: UsageReader | None = None  # reads the answer's token usage (token_usage)

    @property
    def lease_lost(self) -> bool:
        return self.held is not None and self.held.lost.is_set()


class ExternalProcessor(ext_proc_grpc.ExternalProcessorServicer):
    """The stream loop: knows Envoy's phases, delegates parsing to extproc.openai_api, decisions to
    the lease table (extproc.routing.lease_table) and error answers to extproc.protocol.answers.
    `live` (extproc.protocol.live) is replaced by `apply` on a config reload; a request reads it
    once, when its body arrives, and decides and adapts with that snapshot. `breaker`: the Redis
    circuit breaker the chain lookups and records report to. `observer`: where response
    headers are reported (health), if anywhere. `tracer`: the spans' (None: tracing off)."""

    def __init__(
        self, live: LiveConfig, leases: LeaseTable, breaker: RedisBreaker, observer: UpstreamObserver | None = None,
        tracer: tracing.RequestTracer | None = None,
    ):
        self.live = live
        self.observer = observer
        self.tracer = tracer
        self.leases = leases
        self.breaker = breaker
        self._chain_refreshes: set[asyncio.Task] = set()
        self._routing_header = live.config.server.routing_header  # restart-only: Envoy must agree
        self._client_may_not_send = [self._routing_header, live.config.server.affinity_header, msg.DESTINATION_ENDPOINT_HEADER]

    def apply(self, live: LiveConfig) -> None:
        """Take a new live config: streams whose body arrives from now on decide with it."""
        self.live = live

    @property
    def config(self) -> Config:
        """The running config (the latest reload's)."""
        return self.live.config

    @property
    def sessions(self) -> SessionKeys:
        return self.live.sessions

    @property
    def chains(self) -> ResponseChains:
        return self.live.chains

    @property
    def models(self) -> frozenset[str]:
        return self.live.models

    async def Process(self, request_iterator, context: grpc.aio.ServicerContext) -> None:  # noqa: N802 (gRPC name)
        stream = StreamState()
        context.add_done_callback(lambda _: self._end_stream(stream))
        task = asyncio.current_task()
        try:
            while (request := await context.read()) is not grpc.aio.EOF:
                response = await self._handle_or_answer_500(stream, request)
                if response is not None:
                    await context.write(response)
                    if response.HasField("immediate_response"):
                        break
        except asyncio.CancelledError:
            if not stream.lease_lost:
                raise
            task.uncancel()
        finally:
            self._end_stream(stream)
        if stream.lease_lost:
            await context.abort(grpc.StatusCode.ABORTED, "request lease lost: the request is cancelled")

    async def _handle_or_answer_500(self, stream: StreamState, request: ProcessingRequest) -> ProcessingResponse | None:
        """The last resort: any unexpected exception of a phase is logged with its traceback and
        answered with a generic 500 (code internal_error); the stream end releases any lease."""
        try:
            return await self._handle(stream, request)
        except Exception:
            log.exception("unexpected error in the %s phase of %s; answered 500", request.WhichOneof("request"), stream.path[:200])
            return answers.internal_error()

    async def _handle(self, stream: StreamState, request: ProcessingRequest) -> ProcessingResponse | None:
        phase = request.WhichOneof("request")
        if phase == "request_headers":
            return await self._on_request_headers(stream, request)
        if phase == "request_body":
            return await self._on_request_body(stream, request)
        if phase == "response_headers":
            return await self._on_response_headers(stream, request)
        if phase == "response_trailers":
            return msg.continue_response_trailers()
        if phase == "response_body":
            return await self._on_response_body(stream, request)
        if phase == "request_trailers":
            return msg.continue_request_trailers()
        return None

    async def _on_request_headers(self, stream: StreamState, request: ProcessingRequest) -> ProcessingResponse:
        headers = msg.header_map(request.request_headers)
        stream.path = headers.get(":path", "")
        stream.method = headers.get(":method", "")
        stream.signals = self.sessions.read_headers(headers)
        class_header = self.config.routing.queue.class_header
        if class_header is not None:
            stream.priority_header = headers.get(class_header)
        if self.tracer is not None:
            stream.trace_headers = tracing.carrier(headers)
        try:
            if answers.is_models_path(stream.path):
                return answers.models(stream.method, stream.path, self.live.model_list, self.live.models)
            lookup = response_lookup(stream.method, stream.path)
            if lookup is not None:  # no body follows, or one that is passed on as it is
                stream.identity = self.sessions.identity(stream.signals, None)
                answer, stream.lookup = await route_lookup(
                    self.live, self.breaker, lookup, stream.identity, self._routing_header, self._client_may_not_send,
                    tracing_on=self.tracer is not None,
                )
                return answer
            feature_for_path(stream.path, self.live.passthrough)
            if stream.method != "POST":
                raise RequestError(405, f"method {stream.method[:20]!r} is not allowed here: use POST", "method_not_allowed")
            if request.request_headers.end_of_stream:
                raise answers.missing_body()
            if int(headers.get("content-length") or 0) > self.config.server.max_body_bytes:
                raise answers.too_large(self.config.server.max_body_bytes)
        except RequestError as exc:
            return answers.request_error(exc)
        except ValueError:
            return answers.request_error(RequestError(400, "invalid content-length", "invalid_header"))
        return msg.continue_request_headers(remove=self._client_may_not_send)

    async def _on_request_body(self, stream: StreamState, request: ProcessingRequest) -> ProcessingResponse:
        if stream.lookup is not None:  # routed with its headers
            return msg.continue_request_body()
        body = request.request_body.body
        live = self.live
        try:
            if not body:
                raise answers.missing_body()
            if len(body) > live.config.server.max_body_bytes:
                raise answers.too_large(live.config.server.max_body_bytes)
            feature = feature_for_path(stream.path, live.passthrough)
            parsed = parse_request(feature, body, live.config.session.completions_prefix_chars)
            if parsed.model not in live.models:
                raise RequestError(404, f"the model '{parsed.model[:200]}' does not exist", "model_not_found", param="model")
        except RequestError as exc:
            return answers.request_error(exc)
        try:
            routing_request = await self._routing_request(stream, parsed)
        except RequestError as exc:
            return answers.request_error(exc)
        span = None if self.tracer is None else self.tracer.start(stream.trace_headers, parsed.feature, parsed.model)
        started = time.perf_counter()
        try:
            stream.prompt_blocks = self._prompt_blocks(parsed, live)
            with deciding_with(stream.prompt_blocks, stream.chained_endpoint):
                outcome = await self.leases.decide(routing_request, live.router, live.state)
        finally:
            decision_seconds = time.perf_counter() - started
            metrics.DECISION_SECONDS.observe(decision_seconds)
        decision_ms = round(decision_seconds * 1000, 3)
        if isinstance(outcome, (Refusal, Rejection)):
            answer = self._answer_refused(outcome, routing_request, parsed, live, decision_ms)
            if span is not None:
                self._trace_refused(span, answer, decision_ms)
            return answer
        if stream.ended:  # the stream ended while the decision was on its way
            self.leases.end(outcome, succeeded=False)
            if span is not None:
                self.tracer.finish(span, None)
            return None
        stream.held, stream.decision = outcome, outcome.decision
        outcome.on_lost = asyncio.current_task().cancel  # this stream's task: a lost lease cancels it
        decision = outcome.decision
        metrics.child(metrics.DECISIONS, decision.provider.name, decision.provider.kind.value, parsed.model, decision.reason.value).inc()
        stream.model = parsed.model
        if live.config.adaptation.restore_model_name:
            stream.upstream_model = live.adapter.upstream_model(decision.provider, parsed.model)
        change = live.adapter.adapt(decision.provider, parsed.model, parsed.body, routing_request.session_id, body)
        metadata = {"provider": decision.provider.name, "reason": decision.reason.value, "decision_ms": decision_ms}
        set_headers, remove = change.set_headers, change.remove
        if stream.reads_response_id or stream.upstream_model is not None or self._counts_usage(decision.provider):
            set_headers = {**set_headers, **msg.UNENCODED_ANSWER}  # the answer is read: not compressed
        if span is not None:
            stream.span = span
            set_headers, remove = self._trace_context(span, decision, routing_request.session_id, decision_ms, set_headers, remove)
        answer = msg.route_to_cluster(self._routing_header, change.cluster, set_headers, remove, change.body, metadata)
        return msg.with_destination(answer, decision.lease.endpoints) if decision.lease is not None else answer

    @staticmethod
    def _prompt_blocks(parsed: ParsedRequest, live: LiveConfig) -> tuple[str, ...]:
        """The prompt's chained block hashes, for placement on a provider with affinity pick
        (extproc.routing.placement); () when no provider of the model picks."""
        if not live.state.picks(parsed.model):
            return ()
        placement = live.config.routing.placement
        return prompt_blocks(parsed.stable_prefix, placement.block_chars, placement.max_blocks)

    def _trace_refused(self, span, answer: ProcessingResponse, decision_ms: float) -> None:
        """End `span` with the status and error code of the router's own `answer`."""
        fields = answer.dynamic_metadata.fields[msg.METADATA_NAMESPACE].struct_value.fields
        self.tracer.rejected(span, answer.immediate_response.status.code, fields["code"].string_value, decision_ms)

    def _trace_context(
        self, span, decision: Decision, session_id: str | None, decision_ms: float, set_headers: dict[str, str], remove: list[str]
    ) -> tuple[dict[str, str], list[str]]:
        """Record the decision on `span`; the routing answer's headers then carry the span's trace
        context to the provider, or, for a third party that gets none, lose the client's."""
        context = self.tracer.routed(span, decision.provider, decision.reason.value, session_id, decision_ms)
        if context:
            return {**set_headers, **context}, remove
        return set_headers, [*remove, *tracing.WITHHELD_HEADERS]

    async def _routing_request(self, stream: StreamState, parsed: ParsedRequest) -> RoutingRequest:
        """Identity, session key and, for a Responses turn continuing a stored response, the
        provider that stores it (docs/sessions.md "Identity and sessions"). Raises RequestError
        (400 previous_response_unavailable) for a turn that switches to a model its previous
        response's provider does not serve."""
        stream.identity = self.sessions.identity(stream.signals, parsed)
        link = None
        previous = previous_response_id(parsed)
        breaker = self.breaker
        if previous is not None and not breaker.open_for(parsed.model):
            try:
                link = await in_own_task(self._chain_of(parsed.model, stream.identity, previous))
                breaker.record_success(parsed.model)
            except ChainRecordsUnreadable as exc:  # the fallback under other models: theirs, not this model's
                breaker.record_success(parsed.model)  # its own lookup was answered
                for model, error in exc.errors.items():
                    breaker.record_failure(error, model)
            except REDIS_FAILURES as exc:
                breaker.record_failure(exc, parsed.model)
        key = self.sessions.session(stream.signals, parsed, stream.identity, link.session_id if link else None)
        stream.session_id = key.session_id
        stream.stores_response = parsed.feature == "responses" and parsed.body.get("store") is not False
        stream.background = parsed.feature == "responses" and parsed.body.get("background") is True
        # A stored answer binds its chain to the provider: always read. An unstored one only tells
        # the next turn its session, which a signal ranked before previous_response_id tells anyway.
        stream.reads_response_id = parsed.feature == "responses" and (
            stream.stores_response or not self.sessions.outranks_previous_response(key.signal)
        )
        metrics.child(metrics.SESSION_SIGNALS, key.signal.value if key.signal else "none").inc()
        required = link.provider if link else None
        if link is not None and link.provider is not None and link.endpoint is not None:  # the replica that stores it
            stream.chained_endpoint = (link.provider, link.endpoint)
        priority, tenant = None, ""
        queue = self.live.router.queue
        if queue.enabled(parsed.model):  # the admission queue's class and fairness key (docs/queue.md)
            priority, tenant = queue.class_for(stream.priority_header, stream.identity), self.sessions.tenant(stream.identity)
        share = self.sessions.identity_key(stream.identity) if self.config.routing.third_party_share is not None else None
        return RoutingRequest(parsed.model, parsed.feature, parsed.sub_features, key.session_id, required, priority, tenant, share)

    async def _chain_of(self, model: str, identity: str, response_id: str) -> ChainLink | None:
        """The chain record of `response_id` for `identity`: under `model`, else under any other
        model a stored response may belong to, as lookups by id find it (a turn may switch model,
        as OpenAI's API allows; the response stays where it was stored). Raises RequestError (400
        previous_response_unavailable) when the storing provider does not serve `model`; the
        RedisError of the lookup under `model`; ChainRecordsUnreadable when the fallback found
        nothing and some other model's records could not be read (extproc.openai_api.chains)."""
        link = await self.chains.lookup(model, identity, response_id)
        if link is not None:
            return link
        found = await self.chains.find(identity, response_id, [m for m in self.live.responses_models if m != model])
        if found is None:
            return None
        stored_model, link = found
        if link.provider is not None and all(p.name != link.provider for p in self.config.providers_for(model)):
            raise RequestError(
                400,
                f"the previous response '{response_id[:100]}' was made with model '{stored_model}' and is stored on provider "
                f"{link.provider}, which does not serve model '{model[:200]}': continue the chain with a model that provider "
                "serves, or start a new chain without previous_response_id",
                "previous_response_unavailable", param="previous_response_id",
            )
        return link

    def _answer_refused(
        self, outcome: Refusal | Rejection, request: RoutingRequest, parsed: ParsedRequest, live: LiveConfig, decision_ms: float
    ) -> ProcessingResponse:
        """No provider for this request: the lease table refused to decide, or the router found none."""
        model_label = metrics.model_label(parsed.model, live.models)
        retry_after = live.config.server.retry_after_seconds
        if isinstance(outcome, Refusal):
            return answers.refusal(outcome, model_label, retry_after, decision_ms)
        provider = request.required_provider
        if provider is not None and outcome.kind is not RejectionKind.UNSUPPORTED:
            configured = any(p.name == provider for p in live.config.providers_for(request.model))
            degraded = not configured or live.router.provider_is_degraded(live.config.provider(provider), request.model)
            return answers.chained_unavailable(provider, previous_response_id(parsed), degraded, model_label, retry_after, decision_ms)
        return answers.routing_rejection(outcome, model_label, retry_after, decision_ms)

    async def _on_response_headers(self, stream: StreamState, request: ProcessingRequest) -> ProcessingResponse:
        """Record `:status` (pin refresh, passive check). When Envoy answers itself because the
        provider refused the connection or reset it before the headers, degrade the pair at once
        (awaited: this instance's next decision must see it) and tell the client when to retry."""
        try:
            stream.status = int(msg.header_value(request.response_headers, ":status") or "0")
        except ValueError:
            stream.status = 0
        extra: dict[str, str] = {}
        decision = stream.decision
        if decision is not None:
            unreachable = msg.upstream_unreachable(request)
            if unreachable is not None:
                extra["retry-after"] = str(self.config.server.retry_after_seconds)
            endpoint = await self._follow_picked_endpoint(stream, request, unreachable)
            decision = stream.decision  # its lease names the endpoint that answered
            if self.observer is not None:
                if unreachable is not None:
                    await self.observer.connection_failed(decision.provider, stream.model, unreachable, endpoint)
                elif 200 <= stream.status < 300:
                    self.observer.succeeded(decision.provider, stream.model)
                self.observer.observe(decision.provider, stream.model, stream.status, endpoint)
            if self.config.server.expose_routing_headers:
                extra |= {"x-iris-provider": decision.provider.name, "x-iris-route-reason": decision.reason.value}
                if decision.lease is not None and decision.lease.endpoint is not None:  # affinity pick
                    extra["x-iris-endpoint"] = decision.lease.endpoint
        elif stream.lookup is not None:
            await self._on_lookup_answer(stream)
            if self.config.server.expose_routing_headers:
                extra |= {"x-iris-provider": stream.lookup.provider.name, "x-iris-route-reason": LOOKUP_REASON}
        read_body, remove = None, None
        if 200 <= stream.status < 300:
            read_body, remove = self._body_readers(stream, request)
            if stream.lookup is not None and stream.reader is None:  # answered, and its status is not read
                self._spawn_chain_task(refresh_looked_up(self.chains, stream.lookup, None))
        return msg.continue_response_headers(extra or None, read_body, remove)

    async def _follow_picked_endpoint(self, stream: StreamState, request: ProcessingRequest, unreachable: str | None) -> str | None:
        """Affinity pick: the endpoint (`ip:port`) that answered or failed, Envoy's
        `upstream.address`, else the one picked; None on any other pair. When Envoy answered
        from another endpoint than the one picked, the picked one failed before anything was
        sent (the route retries only then, or override_host found it unusable): it is reported as
        a connection failure of that endpoint, which takes it out (extproc.operations.health),
        and, when that endpoint answered (not Envoy itself), the lease counts there from now on
        (LeaseTable.answered_by: one more Redis call on this path only, which also teaches its
        prefix index the prompt's blocks; `stream.decision` then names it, for the chain record
        and `x-iris-endpoint`)."""
        decision = stream.decision
        picked = decision.lease.endpoint if decision.lease is not None else None
        if picked is None:
            return None
        answered_by = msg.upstream_address(request) or picked
        if answered_by == picked:
            return answered_by
        if unreachable is None and stream.held is not None:
            with deciding_with(stream.prompt_blocks):  # the answering endpoint's prefix index learns them
                await in_own_task(self.leases.answered_by(stream.held, answered_by))
            stream.decision = stream.held.decision
        if self.observer is not None:
            what = f"{picked} failed before the response headers; {answered_by} answered " + (unreachable or "")
            await self.observer.connection_failed(decision.provider, stream.model, what.strip(), picked)
        return answered_by

    def _body_readers(self, stream: StreamState, request: ProcessingRequest) -> tuple[str | None, list[str] | None]:
        """For a 2xx answer: set up what reads or rewrites its body (the Responses id and status,
        the model name, the token usage) and return (the body mode to ask Envoy for, headers to
        remove), or (None, None) when none applies. A compressed body is neither read nor
        rewritten. BUFFERED only for a JSON answer of a known length of at most
        WHOLE_BODY_MAX_BYTES; otherwise STREAMED, without content-length when it is rewritten."""
        reads_id = stream.decision is not None and stream.reads_response_id and not self.breaker.open_for(stream.model)
        reads_status = stream.lookup is not None and stream.lookup.lookup.action in RENAMED_ACTIONS
        counts_usage = stream.decision is not None and self._counts_usage(stream.decision.provider)
        if not (reads_id or reads_status or counts_usage or stream.upstream_model is not None):
            return None, None
        headers = msg.header_map(request.response_headers)
        if headers.get("content-encoding", "identity") not in ("", "identity"):
            if counts_usage:
                metrics.child(metrics.USAGE_UNREPORTED, stream.decision.provider.name, stream.model).inc()
            return None, None
        event_stream = headers.get("content-type", "").startswith("text/event-stream")
        reads_status = reads_status and not event_stream  # a resumed stream need not start with the response
        if reads_id or reads_status:
            stream.reader = ResponseReader(event_stream)
        if counts_usage:
            stream.usage = UsageReader()
        stream.buffered = not event_stream and _announced_length(headers) <= WHOLE_BODY_MAX_BYTES
        if stream.upstream_model is not None:
            stream.rewriter = ModelNameRewriter(stream.upstream_model, stream.model, event_stream)
            if not stream.buffered:  # chunks may change length
                return "STREAMED", ["content-length"]
        return ("BUFFERED" if stream.buffered else "STREAMED"), None

    async def _on_lookup_answer(self, stream: StreamState) -> None:
        """A lookup's answer: after a delete the provider answered 2xx, the chain record goes too;
        a retrieved (or cancelled) response names the model as the client does."""
        routed = stream.lookup
        if not 200 <= stream.status < 300:
            return
        stream.model = routed.model
        if routed.lookup.action in RENAMED_ACTIONS:  # answered with the response object
            stream.upstream_model = routed.upstream_model
        elif routed.lookup.action == "delete":
            try:
                await in_own_task(self.chains.forget(routed.model, routed.identity, routed.lookup.response_id))
            except REDIS_FAILURES as exc:
                self.breaker.record_failure(exc, routed.model)
                log.warning("response chain not forgotten after a delete (redis): %s", exc)

    def _counts_usage(self, provider: Provider) -> bool:
        whose = self.config.token_usage.providers
        return whose == "all" or (whose == "unlimited" and provider.kind is ProviderKind.UNLIMITED)

    def _count_usage(self, stream: StreamState, chunk: bytes, end_of_stream: bool) -> None:
        """Feed the usage reader; once the body ends, count the tokens it reported
        (iris_tokens_total) or that it reported none (iris_usage_unreported_total)."""
        if not stream.usage.feed(chunk, end_of_stream):
            return
        usage, provider = stream.usage.usage, stream.decision.provider
        if usage is None:
            metrics.child(metrics.USAGE_UNREPORTED, provider.name, stream.model).inc()
            return
        kind = provider.kind.value
        metrics.child(metrics.TOKENS, provider.name, kind, stream.model, "input").inc(usage.input_tokens)
        metrics.child(metrics.TOKENS, provider.name, kind, stream.model, "output").inc(usage.output_tokens)
        if stream.span is not None:
            self.tracer.usage(stream.span, usage.input_tokens, usage.output_tokens)

    async def _on_response_body(self, stream: StreamState, request: ProcessingRequest) -> ProcessingResponse:
        """A /v1/responses answer (record the response id once it is seen), an answer to rewrite
        (put the client's model name in place of the provider's) or one whose usage is counted
        (`_body_readers`)."""
        chunk, end = request.response_body.body, request.response_body.end_of_stream
        if stream.usage is not None and not stream.usage.done:
            self._count_usage(stream, chunk, end)
        reader = stream.reader
        if reader is not None and not reader.done and reader.feed(chunk, end):
            if stream.lookup is not None:
                self._spawn_chain_task(refresh_looked_up(self.chains, stream.lookup, reader.status))
            elif reader.response_id is not None:
                await self._record_chain(stream, reader.response_id, stream.background and reader.running)
        if end and stream.chain_running and reader is not None and reader.event_stream:
            stream.chain_running = False  # a background response's stream ends when the response does
        rewriter = stream.rewriter
        if rewriter is None:
            return msg.continue_response_body()
        rewritten = rewriter.feed(chunk, end)
        if rewritten is chunk:
            return msg.continue_response_body()
        return msg.continue_response_body(rewritten, content_length=stream.buffered)

    async def _record_chain(self, stream: StreamState, response_id: str, running: bool) -> None:
        """Before the client can see the id: so a next turn through any instance finds it.
        `running`: a background response the answer says still runs (its record keeps the
        background TTL)."""
        decision = stream.decision
        provider = decision.provider.name if stream.stores_response else None
        endpoint = decision.lease.endpoint if stream.stores_response and decision.lease is not None else None
        try:
            link = ChainLink(stream.session_id, provider, endpoint)  # affinity pick: the replica that stores it
            if not await in_own_task(self.chains.record(stream.model, stream.identity, response_id, link, running)):
                metrics.CHAINS_CAPPED.inc()
                return
            stream.response_id, stream.chain_running = response_id, running
            self._keep_chain(stream)
            metrics.CHAINS_RECORDED.inc()
        except REDIS_FAILURES as exc:
            self.breaker.record_failure(exc, stream.model)
            log.warning("response chain not recorded (redis): %s", exc)

    def _end_stream(self, stream: StreamState) -> None:
        """Hand the stream's end to the lease table (idempotent), whichever way it ended."""
        if stream.ended:
            return
        stream.ended = True
        if stream.span is not None:
            self.tracer.finish(stream.span, stream.status)
        if stream.held is not None:
            succeeded = stream.status is not None and 200 <= stream.status < 300
            self.leases.end(stream.held, succeeded)
            if succeeded and stream.response_id is not None:
                self._refresh_chain(stream)

    def _keep_chain(self, stream: StreamState) -> None:
        """While the answer streams, the chain's TTL starts again every third of the lease
        timeout, as the lease is renewed: a stream longer than the TTL keeps its chain."""
        period = self.config.lease_timeout_seconds / 3

        async def keep() -> None:
            while True:
                await asyncio.sleep(period)
                if stream.ended:
                    return
                await self._refresh_chain_once(stream)

        self._spawn_chain_task(keep())

    def _refresh_chain(self, stream: StreamState) -> None:
        """In the background (the stream is over): the chain's TTL starts again at the answer's
        end; a background response still running keeps its longer one."""
        running = stream.chain_running
        self._spawn_chain_task(self._refresh_chain_once(stream, running=running, ended=not running))

    async def _refresh_chain_once(self, stream: StreamState, running: bool | None = None, ended: bool = False) -> None:
        try:
            running = stream.chain_running if running is None else running
            await self.chains.refresh(stream.model, stream.identity, stream.response_id, running, ended)
        except REDIS_FAILURES as exc:
            log.warning("response chain TTL not refreshed (redis): %s", exc)

    def _spawn_chain_task(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._chain_refreshes.add(task)
        task.add_done_callback(self._chain_refreshes.discard)


def _announced_length(headers: dict[str, str]) -> float:
    """The answer's content-length in bytes; infinity when it announces none (chunked) or an
    unreadable one."""
    try:
        return int(headers["content-length"])
    except (KeyError, ValueError):
        return float("inf")
