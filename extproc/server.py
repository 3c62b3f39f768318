"""The ext_proc gRPC server: envoy.service.ext_proc.v3.ExternalProcessor/Process.

One gRPC stream per HTTP request. Phases, in the order Envoy sends them (see envoy/envoy.yaml):
request headers (path, method, identity and session headers; `GET /v1/models` is answered here)
-> request body, BUFFERED (parse, identity, session key, decide, route by setting the routing
header with clear_route_cache) -> response headers (record `:status`; a `/v1/responses` answer
asks for its body) -> response body, only for `/v1/responses` (record the response id:
extproc.chains) -> response trailers -> stream end, when the lease is released, refreshing the
pin only after a 2xx.

The stream loop knows only Envoy's phases: it hands each decision to the lease table
(extproc.lease_table), which owns every lease, and hands it the stream's end. The end reaches a
grpc.aio handler as the end of reads or as a cancellation; a done-callback on the call catches
any other way; the table's `end` is idempotent, so whichever comes first wins. A lease reported
lost ends the stream with an error; Envoy, failing closed, then resets the HTTP stream: that is
how the spec's "cancel the request" reaches the client.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from dataclasses import dataclass

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest, ProcessingResponse
from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2, health_pb2_grpc
from redis.exceptions import RedisError

from extproc import envoy_messages as msg
from extproc import metrics
from extproc.chains import ChainLink, ResponseChains, ResponseIdReader
from extproc.config import Config
from extproc.degraded import DegradedFlags
from extproc.fleet_state import CachedFleetState, FleetStateReader, on_loop
from extproc.health import HealthMonitor
from extproc.lease_table import Held, LeaseTable, Refusal
from extproc.openai_request import MODELS_PATH, ParsedRequest, RequestError, feature_for_path, parse_request
from extproc.outage import InstanceRegistry, OutagePolicy, RedisBreaker
from extproc.redis_client import open_redis
from extproc.reload import ConfigReloader, LiveConfig, build_live
from extproc.routing import Decision, Rejection, RejectionKind, RoutingRequest
from extproc.sessions import HeaderSignals, SessionKeys, previous_response_id
from extproc.supervision import run_every

log = logging.getLogger(__name__)

GRPC_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# The services grpc.health.v1.Health reports on: the whole server ("") and the one Envoy uses.
EXT_PROC_SERVICE = external_processor_pb2.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name
HEALTH_SERVICES = ("", EXT_PROC_SERVICE)


class SecretMissing(RuntimeError):
    """The session secret's environment variable is not set."""


def session_secret(config: Config) -> bytes:
    """The key of the session-id hash, from the environment variable the config names. Raises
    SecretMissing: every proxy instance must share the same secret, so none is invented."""
    value = os.environ.get(config.session.secret_env)
    if not value:
        raise SecretMissing(f"set {config.session.secret_env} to the session secret shared by every proxy instance")
    return value.encode()


@dataclass
class StreamState:
    """What one gRPC stream (one HTTP request) has learned so far."""

    path: str = ""
    method: str = ""
    signals: HeaderSignals = HeaderSignals()
    identity: str = ""
    session_id: str | None = None
    stores_response: bool = False  # a /v1/responses request whose answer is stored (store not false)
    reads_response_id: bool = False  # the answer's response id is worth its cost (see _routing_request)
    model: str = ""
    held: Held | None = None
    decision: Decision | None = None
    status: int | None = None
    reader: ResponseIdReader | None = None
    ended: bool = False

    @property
    def lease_lost(self) -> bool:
        return self.held is not None and self.held.lost.is_set()


class ExternalProcessor(ext_proc_grpc.ExternalProcessorServicer):
    """The stream loop: knows Envoy's phases, delegates parsing to openai_request and decisions
    to routing. `live` (extproc.reload) is swapped by a config reload; a request reads it once,
    when its body arrives, and decides and adapts with that snapshot."""

    def __init__(self, live: LiveConfig, leases: LeaseTable, secret: bytes, health: HealthMonitor | None = None):
        self.live = live
        self.health = health
        self.leases = leases
        self.secret = secret
        self._routing_header = live.config.server.routing_header  # restart-only: Envoy must agree

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
            metrics.REJECTIONS.labels("internal_error", "").inc()
            return msg.internal_error()

    async def _handle(self, stream: StreamState, request: ProcessingRequest) -> ProcessingResponse | None:
        phase = request.WhichOneof("request")
        if phase == "request_headers":
            return self._on_request_headers(stream, request)
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

    def _on_request_headers(self, stream: StreamState, request: ProcessingRequest) -> ProcessingResponse:
        headers = msg.header_map(request.request_headers)
        stream.path = headers.get(":path", "")
        stream.method = headers.get(":method", "")
        stream.signals = self.sessions.read_headers(headers)
        try:
            if _is_models_path(stream.path):
                return self._answer_models(stream)
            feature_for_path(stream.path)
            if stream.method != "POST":
                raise RequestError(405, f"method {stream.method[:20]!r} is not allowed here: use POST", "method_not_allowed")
            if request.request_headers.end_of_stream:
                raise RequestError(400, "a request body is required", "missing_body")
            if int(headers.get("content-length") or 0) > self.config.server.max_body_bytes:
                raise self._too_large()
        except RequestError as exc:
            return self._reject_request(exc)
        except ValueError:
            return self._reject_request(RequestError(400, "invalid content-length", "invalid_header"))
        return msg.continue_request_headers(remove=[self._routing_header])

    async def _on_request_body(self, stream: StreamState, request: ProcessingRequest) -> ProcessingResponse:
        body = request.request_body.body
        live = self.live
        try:
            if len(body) > live.config.server.max_body_bytes:
                raise self._too_large()
            parsed = parse_request(feature_for_path(stream.path), body, live.config.session.completions_prefix_chars)
            if parsed.model not in live.models:
                raise RequestError(404, f"the model '{parsed.model[:200]}' does not exist", "model_not_found", param="model")
        except RequestError as exc:
            return self._reject_request(exc)
        routing_request = await self._routing_request(stream, parsed)
        started = time.perf_counter()
        try:
            outcome = await self.leases.decide(routing_request, live.router, live.state)
        finally:
            decision_seconds = time.perf_counter() - started
            metrics.DECISION_SECONDS.observe(decision_seconds)
        decision_ms = round(decision_seconds * 1000, 3)
        if isinstance(outcome, Refusal):
            return self._refuse(outcome, parsed.model, decision_ms)
        if isinstance(outcome, Rejection):
            if routing_request.required_provider is not None and outcome.kind is not RejectionKind.UNSUPPORTED:
                return self._reject_chained(routing_request, previous_response_id(parsed), decision_ms)
            return self._reject_routing(outcome, parsed.model, decision_ms)
        if stream.ended:  # the stream ended while the decision was on its way
            self.leases.end(outcome, succeeded=False)
            return None
        stream.held, stream.decision = outcome, outcome.decision
        outcome.on_lost = asyncio.current_task().cancel  # this stream's task: a lost lease cancels it
        decision = outcome.decision
        metrics.DECISIONS.labels(decision.provider.name, parsed.model, decision.reason.value).inc()
        stream.model = parsed.model
        change = live.adapter.adapt(decision.provider, parsed.model, parsed.body)
        metadata = {"provider": decision.provider.name, "reason": decision.reason.value, "decision_ms": decision_ms}
        return msg.route_to_cluster(
            self._routing_header, decision.provider.cluster, change.set_headers, change.remove, change.body, metadata
        )

    async def _routing_request(self, stream: StreamState, parsed: ParsedRequest) -> RoutingRequest:
        """Identity, session key and, for a Responses turn continuing a stored response, the
        provider that stores it (README: "Identity and sessions")."""
        stream.identity = self.sessions.identity(stream.signals, parsed)
        link = None
        previous = previous_response_id(parsed)
        breaker = self.leases.breaker
        if previous is not None and not breaker.is_open:
            try:
                link = await self.chains.lookup(parsed.model, stream.identity, previous)
                breaker.record_success()
            except RedisError as exc:
                breaker.record_failure(exc)
        key = self.sessions.session(stream.signals, parsed, stream.identity, link.session_id if link else None)
        stream.session_id = key.session_id
        stream.stores_response = parsed.feature == "responses" and parsed.body.get("store") is not False
        # A stored answer binds its chain to the provider: always read. An unstored one only tells
        # the next turn its session, which a signal ranked before previous_response_id tells anyway.
        stream.reads_response_id = parsed.feature == "responses" and (
            stream.stores_response or not self.sessions.outranks_previous_response(key.signal)
        )
        metrics.SESSION_SIGNALS.labels(key.signal.value if key.signal else "none").inc()
        required = link.provider if link else None
        return RoutingRequest(parsed.model, parsed.feature, parsed.sub_features, key.session_id, required)

    def _refuse(self, refusal: Refusal, model: str, decision_ms: float) -> ProcessingResponse:
        """README "When Redis is gone": 503 under fail_closed, 429 when this process's Redis
        connections are all busy (load: retry soon)."""
        metrics.REJECTIONS.labels(refusal.value, metrics.model_label(model, self.models)).inc()
        headers = {"retry-after": str(self.config.server.retry_after_seconds)}
        metadata = {"code": refusal.value, "decision_ms": decision_ms}
        if refusal is Refusal.OVERLOADED:
            body = msg.openai_error_body("the routing service is overloaded: retry shortly", "rate_limit_error", refusal.value)
            return msg.immediate_json(429, body, headers, metadata=metadata)
        body = msg.openai_error_body("the routing service is temporarily unavailable", "service_unavailable", refusal.value)
        return msg.immediate_json(503, body, headers, metadata=metadata)

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
            if self.health is not None:
                if unreachable is not None:
                    await self.health.connection_failed(decision.provider, stream.model, unreachable)
                elif 200 <= stream.status < 300:
                    self.health.succeeded(decision.provider, stream.model)
                self.health.observe(decision.provider, stream.model, stream.status)
            if self.config.server.expose_routing_headers:
                extra |= {"x-iris-provider": decision.provider.name, "x-iris-route-reason": decision.reason.value}
        read_body = None
        readable = stream.decision is not None and stream.reads_response_id and not self.leases.breaker.is_open
        if readable and 200 <= stream.status < 300:  # a Responses answer: its other headers count too
            headers = msg.header_map(request.response_headers)
            event_stream = headers.get("content-type", "").startswith("text/event-stream")
            if not headers.get("content-encoding"):  # a compressed body is not read: no chain recorded
                stream.reader = ResponseIdReader(event_stream)
                read_body = "STREAMED" if event_stream else "BUFFERED"
        return msg.continue_response_headers(extra or None, read_body)

    async def _on_response_body(self, stream: StreamState, request: ProcessingRequest) -> ProcessingResponse:
        """Only /v1/responses answers come here: record the response id once it is seen."""
        reader = stream.reader
        if reader is not None and not reader.done:
            response_id = reader.feed(request.response_body.body, request.response_body.end_of_stream)
            if response_id is not None:
                await self._record_chain(stream, response_id)
        return msg.continue_response_body()

    async def _record_chain(self, stream: StreamState, response_id: str) -> None:
        """Before the client can see the id: so a next turn through any instance finds it."""
        provider = stream.decision.provider.name if stream.stores_response else None
        try:
            await self.chains.record(stream.model, stream.identity, response_id, ChainLink(stream.session_id, provider))
            metrics.CHAINS_RECORDED.inc()
        except RedisError as exc:
            self.leases.breaker.record_failure(exc)
            log.warning("response chain not recorded (redis): %s", exc)

    def _end_stream(self, stream: StreamState) -> None:
        """Hand the stream's end to the lease table (idempotent), whichever way it ended."""
        stream.ended = True
        if stream.held is not None:
            succeeded = stream.status is not None and 200 <= stream.status < 300
            self.leases.end(stream.held, succeeded)

    def _too_large(self) -> RequestError:
        limit = self.config.server.max_body_bytes
        return RequestError(413, f"request body is larger than {limit} bytes", "request_too_large")

    def _reject_request(self, exc: RequestError) -> ProcessingResponse:
        metrics.REJECTIONS.labels(exc.code, "").inc()  # before a configured model is known
        body = msg.openai_error_body(exc.message, exc.error_type, exc.code, exc.param)
        return msg.immediate_json(exc.status, body, metadata={"code": exc.code})

    def _answer_models(self, stream: StreamState) -> ProcessingResponse:
        """`GET /v1/models` (and `/v1/models/<id>`) from the configuration, in OpenAI's shape."""
        if stream.method != "GET":
            raise RequestError(405, f"method {stream.method[:20]!r} is not allowed here: use GET", "method_not_allowed")
        path = stream.path.split("?", 1)[0].rstrip("/")
        if path == MODELS_PATH:
            return msg.immediate_json(200, self.live.model_list)
        model = path.removeprefix(MODELS_PATH + "/")
        if path.startswith(MODELS_PATH + "/") and model in self.live.models:
            return msg.immediate_json(200, msg.model_body(model, self.live.model_list))
        raise RequestError(404, f"the model '{model[:200]}' does not exist", "model_not_found", param="model")

    def _reject_chained(self, request: RoutingRequest, response_id: str | None, decision_ms: float) -> ProcessingResponse:
        """A turn continuing a response stored on a provider that cannot take it now: a clear
        error, never a silent 404 from a provider that does not hold the response."""
        provider = request.required_provider
        configured = any(p.name == provider for p in self.config.providers_for(request.model))
        degraded = not configured or self.leases.router.provider_is_degraded(self.config.provider(provider), request.model)
        state = "unavailable (degraded or drained)" if degraded else "at capacity"
        message = (
            f"the previous response '{(response_id or '')[:100]}' is stored on provider {provider}, which is {state}: "
            "retry later, or start a new chain without previous_response_id"
        )
        code = "previous_response_unavailable"
        metrics.REJECTIONS.labels(code, metrics.model_label(request.model, self.models)).inc()
        status, error_type = (503, "service_unavailable") if degraded else (429, "rate_limit_error")
        body = msg.openai_error_body(message, error_type, code, "previous_response_id")
        headers = {"retry-after": str(self.config.server.retry_after_seconds)}
        return msg.immediate_json(status, body, headers, metadata={"code": code, "decision_ms": decision_ms})

    def _reject_routing(self, rejection: Rejection, model: str, decision_ms: float) -> ProcessingResponse:
        headers = {"retry-after": str(self.config.server.retry_after_seconds)}
        if rejection.kind is RejectionKind.UNSUPPORTED:
            status, error_type, code, param, headers = 400, "invalid_request_error", "unsupported_feature", rejection.param, None
        elif rejection.kind is RejectionKind.CAPACITY:
            status, error_type, code, param = 429, "rate_limit_error", "capacity_exceeded", None
        else:
            status, error_type, code, param = 503, "service_unavailable", "no_provider_available", None
        metrics.REJECTIONS.labels(code, metrics.model_label(model, self.models)).inc()
        body = msg.openai_error_body(rejection.message, error_type, code, param)
        return msg.immediate_json(status, body, headers, metadata={"code": code, "decision_ms": decision_ms})


def _is_models_path(path: str) -> bool:
    path = path.split("?", 1)[0].rstrip("/")
    return path == MODELS_PATH or path.startswith(MODELS_PATH + "/")


class Gateway:
    """The running server: gRPC, the Redis client, and background tasks. Use `serve()`."""

    def __init__(self, config: Config, secret: bytes):
        self.config = config
        self.redis = open_redis(config.redis)
        self.secret = secret
        self.degraded = DegradedFlags(self.redis, config)
        live = build_live(config, self.redis, self.degraded, secret)
        self.registry = InstanceRegistry(self.redis, config.redis.key_prefix, ttl_seconds=config.redis.instance_heartbeat_seconds * 5)
        self.breaker = RedisBreaker(self.redis, config.redis.breaker_failures_in_a_row)
        self.outage = OutagePolicy(config, live.router, self.registry)
        self.leases = LeaseTable(config, live.state, live.router, self.outage, self.breaker)
        self.health = HealthMonitor(config, self.redis, self.degraded)
        self.processor = ExternalProcessor(live, self.leases, secret, health=self.health)
        self._retired_monitors: set[asyncio.Task] = set()
        self.fleet_reader: FleetStateReader | None = None  # the metrics' reader, when metrics are served
        self.server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", GRPC_MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 1),  # `serve --workers N` shares the port (grpcio's default on Linux)
            ]
        )
        ext_proc_grpc.add_ExternalProcessorServicer_to_server(self.processor, self.server)
        self.serving = grpc_health.aio.HealthServicer()
        self.draining = False
        health_pb2_grpc.add_HealthServicer_to_server(self.serving, self.server)
        self.port = self.server.add_insecure_port(config.server.listen)
        self._background: list[asyncio.Task] = []

    async def start(self) -> None:
        """Load scripts and flags when Redis is there (it may come later), start serving."""
        self.leases.start()
        try:
            await self.leases.state.load_scripts()
            await self.leases.refresh_epoch()
            await self.degraded.refresh()
        except RedisError as exc:
            log.warning("redis not reachable at start-up, continuing: %s", exc)
        # Supervised (extproc.supervision): a step that raises is restarted, counted and logged.
        redis = self.config.redis
        self._background += [
            asyncio.create_task(self.degraded.run_refresher(self.config.server.degraded_refresh_seconds)),
            asyncio.create_task(run_every("heartbeat", self._heartbeat_once, redis.instance_heartbeat_seconds)),
            asyncio.create_task(run_every("redis_probe", self._probe_once, redis.probe_interval_seconds)),
        ]
        self.health.start()
        for service in HEALTH_SERVICES:
            await self.serving.set(service, health_pb2.HealthCheckResponse.SERVING)
        await self.server.start()
        log.info("ext_proc server listening on %s", self.config.server.listen)

    async def _heartbeat_once(self) -> None:
        """Keep this instance registered, so every instance knows the live count, and watch the
        routing state's epoch (a change adopts every lease held: extproc.lease_table)."""
        try:
            await self.registry.heartbeat()
            if not self.breaker.is_open:
                await self.leases.refresh_epoch()
            self.breaker.record_success()
        except RedisError as exc:
            metrics.REDIS_ERRORS.labels("heartbeat").inc()
            self.breaker.record_failure(exc)

    async def _probe_once(self) -> None:
        """While the breaker is open, probe Redis; when it answers, the lease table adopts what
        is held and shared routing resumes (scripts reload by themselves on NOSCRIPT)."""
        if not self.breaker.is_open or not await self.breaker.probe():
            return
        try:
            await self.degraded.refresh()
            adopted = await self.leases.recover()
        except RedisError:
            return
        log.info("shared routing resumed; %d local leases adopted into Redis", adopted)

    def replace_health_monitor(self, config: Config) -> None:
        """Start a HealthMonitor for `config` and stop the running one (extproc.reload)."""
        old, self.health = self.health, HealthMonitor(config, self.redis, self.degraded)
        self.processor.health = self.health
        self.health.start()
        task = asyncio.get_running_loop().create_task(old.close())
        self._retired_monitors.add(task)
        task.add_done_callback(self._retired_monitors.discard)

    async def drain(self, delay_seconds: float | None = None) -> None:
        """The drain sequence (README: "Draining"): report NOT_SERVING on grpc.health.v1.Health,
        keep serving for `delay_seconds` (default `server.drain_delay_seconds`) while Envoy's
        health check takes this server out of rotation, then take no new stream and let open ones
        finish within `server.drain_grace_seconds` (both seconds), release what is left, close
        Redis."""
        self.draining = True
        settings = self.config.server
        delay = settings.drain_delay_seconds if delay_seconds is None else delay_seconds
        log.info("draining: NOT_SERVING, still taking streams for %s s", delay)
        await self.serving.enter_graceful_shutdown()
        await asyncio.sleep(delay)
        log.info("draining: no new streams, up to %s s for open ones", settings.drain_grace_seconds)
        await self.server.stop(settings.drain_grace_seconds)
        await self.leases.drain()
        await self.health.close()
        for task in self._background:
            task.cancel()
        try:
            await self.registry.leave()
        except RedisError:
            pass
        await self.redis.aclose()


class PeerGoneFilter(logging.Filter):
    """Drops grpc.aio's log of a status it could not send because Envoy had already ended the
    stream (`ExecuteBatchError` on `SendStatusFromServerOperation`): a client abort or upstream
    reset, which the stream end already handled (the lease is released), not a server error."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (type(exc).__name__ == "ExecuteBatchError" and "SendStatusFromServerOperation" in str(exc))


def quiet_peer_gone_errors() -> None:
    """Install PeerGoneFilter on grpc's Cython logger (idempotent)."""
    logger = logging.getLogger("grpc._cython.cygrpc")
    if not any(isinstance(f, PeerGoneFilter) for f in logger.filters):
        logger.addFilter(PeerGoneFilter())


async def serve(config: Config, config_path: str | None = None, envoy_path: str | None = None) -> None:
    """Run the ext_proc server until SIGTERM or SIGINT, then drain and return. With `config_path`
    (the file `config` was read from) the routing config is reloaded on SIGHUP and when the file
    changes (extproc.reload), checked against `envoy_path` when given.

    Raises SecretMissing, adaptation.CredentialError."""
    quiet_peer_gone_errors()
    gateway = Gateway(config, session_secret(config))
    await gateway.start()
    try:
        await _serve_started(gateway, config, config_path, envoy_path)
    except BaseException:
        # A failure after start (say, the metrics port taken) must not leave the gRPC server and
        # background tasks running: the process would never exit.
        if not gateway.draining:
            await asyncio.shield(gateway.drain(delay_seconds=0))
        raise


async def _serve_started(gateway: Gateway, config: Config, config_path: str | None, envoy_path: str | None) -> None:
    """`serve` once the gateway runs: signals, reload, metrics, then the drain on SIGTERM."""
    metrics.CONFIG_LAST_SUCCESS.set(time.time())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    metrics_server = None
    watcher = None
    if config_path is not None:
        reloader = ConfigReloader(gateway, config_path, envoy_path)
        loop.add_signal_handler(signal.SIGHUP, reloader.request)
        watcher = asyncio.create_task(reloader.run_forever())
    if config.server.metrics_listen:
        # Reads at most one a second, on this loop; a scrape waits for it in the metrics thread.
        gateway.fleet_reader = FleetStateReader(config, gateway.redis)
        read = on_loop(gateway.fleet_reader, loop, 2 * config.redis.socket_timeout_seconds + 1)
        fleet = CachedFleetState(read)
        metrics_server, _ = metrics.start_metrics_server(config.server.metrics_listen, fleet, lambda: gateway.breaker.is_open)
        log.info("metrics on http://%s/metrics", config.server.metrics_listen)
    await stop.wait()
    if watcher is not None:
        watcher.cancel()
    await gateway.drain()
    if metrics_server is not None:
        metrics_server.shutdown()
