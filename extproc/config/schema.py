"""The routing config's schema: pydantic models of the YAML file.

The file names the providers in priority order (the spec's MANAGED_PROVIDERS_IN_PRIORITY_ORDER
followed by UNLIMITED_PROVIDERS_IN_PRIORITY_ORDER), the models each serves with their features,
and the spec's limits per (provider, model) pair. extproc.config.loading validates a file against
these models and the cross-field rules.

Most settings are reloaded live (extproc.operations.reload). A field annotated with RESTART_ONLY
keeps its running value until the process restarts: `restart_only_fields()` lists them, and the
configuration reference (docs/configuration.md, made by extproc.config.reference) marks them.
"""

from __future__ import annotations

import enum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

FEATURE_CLASSES = frozenset({"chat", "completions", "embeddings", "responses"})
SUB_FEATURES = frozenset({"tools", "vision", "json_schema"})


class RestartOnly:
    """Marks a setting that a running server keeps until it restarts (as `Annotated` metadata):
    a reload that changes it logs that a restart is needed and keeps the running value."""

    def __repr__(self) -> str:
        return "RESTART_ONLY"


RESTART_ONLY = RestartOnly()


def restart_only_fields(model: type[BaseModel]) -> tuple[str, ...]:
    """The names of `model`'s fields marked RESTART_ONLY, in declaration order."""
    return tuple(name for name, field in model.model_fields.items() if any(isinstance(m, RestartOnly) for m in field.metadata))


class ProviderKind(str, enum.Enum):
    """`managed`: our own deployment, health-checked, may have limits. `unlimited`: a third party."""

    MANAGED = "managed"
    UNLIMITED = "unlimited"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelLimits(_Strict):
    """The spec's ModelLimits for one (provider, model) pair; a field left out is not limited."""

    max_pinned_sessions: int | None = Field(default=None, ge=0)
    max_global_in_flight_request_slots: int | None = Field(default=None, ge=0)
    global_in_flight_request_slots_reserved_for_pinned_sessions: int = Field(default=0, ge=0)
    max_per_session_in_flight_request_slots: int | None = Field(default=None, ge=0)


class ModelEntry(_Strict):
    """A model a provider serves: its features (chat, completions, ... plus sub-features such as
    tools or vision), its limits (absent: an unlimited pair) and the provider's own name for it.
    `max_in_flight_per_endpoint` (affinity `pick` only; absent: no cap): the requests of this
    model one endpoint (replica) may carry at once, counted exactly over every proxy (the
    engine's slots, or a multiple of them); placement skips an endpoint at its cap, inside the
    pair's own limits, and a pair whose every endpoint is at its cap is full."""

    features: frozenset[str] = Field(min_length=1)
    limits: ModelLimits | None = None
    upstream_model: str | None = None
    max_in_flight_per_endpoint: int | None = Field(default=None, ge=1)


class Credentials(_Strict):
    """Where a provider's API key comes from: exactly one of `api_key_env` (an environment
    variable) or `api_key_file` (a file holding the key; surrounding whitespace is dropped),
    never the configuration file itself. The key is read once at start-up and sent as
    `<header>: <prefix><key>`: by default `authorization: Bearer <key>`; for an `api-key`
    header set `header: api-key` (its prefix then defaults to none)."""

    api_key_env: str | None = Field(default=None, min_length=1)
    api_key_file: str | None = Field(default=None, min_length=1)
    header: str = Field(default="authorization", pattern=r"^[a-z0-9][a-z0-9_-]*$")
    prefix: str | None = None

    def header_prefix(self) -> str:
        """The text before the key: `prefix`, else "Bearer " for authorization, else nothing."""
        if self.prefix is not None:
            return self.prefix
        return "Bearer " if self.header == "authorization" else ""


class HealthCheck(_Strict):
    """An active HTTP health check of a managed provider, run by every ext_proc instance: a GET
    of `url` every `interval_seconds` that must answer 2xx within `timeout_seconds`. After
    `failures_before_degraded` failures in a row the provider is marked degraded (every model),
    after `successes_before_healthy` successes in a row it is healthy again. With `affinity:
    pick` the check is sent to each endpoint (the URL's path and query against its `ip:port`) and
    takes only a failing endpoint out of placement (docs/routing-state.md "Endpoint health")."""

    url: str = Field(pattern=r"^https?://")
    interval_seconds: float = Field(default=5.0, gt=0)
    timeout_seconds: float = Field(default=1.0, gt=0)
    failures_before_degraded: int = Field(default=3, ge=1)
    successes_before_healthy: int = Field(default=2, ge=1)


class LoadSignal(_Strict):
    """One gauge of an engine's Prometheus endpoint: the sum of the samples named `metric` (per
    model with the gauge's `model_label`); over `threshold` the pair is saturated, until it falls
    to `recover_below` (default: the threshold)."""

    metric: str = Field(min_length=1)
    threshold: float
    recover_below: float | None = None

    @property
    def recovers_at(self) -> float:
        return self.threshold if self.recover_below is None else self.recover_below


# The engines' own saturation gauges (docs/operations.md "Real fleets"): requests waiting for a
# slot and the KV cache's use. (model label, signals); a preset's thresholds are starting points.
LOAD_PRESETS: dict[str, tuple[str | None, tuple[LoadSignal, ...]]] = {
    "vllm": ("model_name", (
        LoadSignal(metric="vllm:num_requests_waiting", threshold=8, recover_below=2),
        LoadSignal(metric="vllm:kv_cache_usage_perc", threshold=0.95, recover_below=0.85),
    )),
    "sglang": ("model_name", (
        LoadSignal(metric="sglang:num_queue_reqs", threshold=8, recover_below=2),
        LoadSignal(metric="sglang:token_usage", threshold=0.95, recover_below=0.85),
    )),
    "llamacpp": (None, (
        LoadSignal(metric="llamacpp:requests_deferred", threshold=2, recover_below=0),
    )),
}


# The engines' own count of the requests they hold, running and waiting (docs/routing-state.md
# "Endpoint placement"): on a provider with affinity `pick` each endpoint's sum is its engine
# reading, a load term of placement beside the router's exact count.
ENGINE_IN_FLIGHT: dict[str, tuple[str, ...]] = {
    "vllm": ("vllm:num_requests_running", "vllm:num_requests_waiting"),
    "sglang": ("sglang:num_running_reqs", "sglang:num_queue_reqs"),
    "llamacpp": ("llamacpp:requests_processing", "llamacpp:requests_deferred"),
}


class LoadGauge(_Strict):
    """Degrade a managed provider's pairs while its engine is saturated, read from its Prometheus
    endpoint `url` (text format) every `interval_seconds`, within `timeout_seconds`.

    The signals: those of `preset` (`vllm`, `sglang`, `llamacpp`: see LOAD_PRESETS), then
    `metric` with `threshold` and `recover_below` when given, then `signals`; a pair is saturated
    while any signal is over its threshold (each with its own hysteresis). With `model_label`
    (for example `model_name`; a preset sets it) a signal is read per model, from the samples
    whose label equals the model's upstream name; without, the sum of every sample counts for
    every model. `stale_after_seconds` (fail closed, as the llm-d endpoint picker does): when no
    reading succeeded for that long, the provider's pairs count as saturated until one does;
    None keeps today's fail-open behaviour (a flag lapses when readings stop).

    On a provider with affinity `pick` the gauge is read from each endpoint (the path of `url`
    against the endpoint's `ip:port`) and judges each endpoint instead of the pair: a saturated
    endpoint, or one whose reading is stale, leaves placement (its `load` flag) and only its
    sessions move; `stale_after_seconds` defaults there to 3 intervals (fail closed, as the
    issue that brought pick asks). Each reading's sum of `in_flight_metrics` (default: the
    preset's running and waiting requests, ENGINE_IN_FLIGHT) is the endpoint's engine count,
    which placement weighs as load when it exceeds the router's own count."""

    url: str = Field(pattern=r"^https?://")
    preset: Literal["vllm", "sglang", "llamacpp"] | None = None
    metric: str | None = Field(default=None, min_length=1)
    threshold: float | None = None
    recover_below: float | None = None
    signals: list[LoadSignal] = []
    model_label: str | None = None
    interval_seconds: float = Field(default=5.0, gt=0)
    timeout_seconds: float = Field(default=1.0, gt=0)
    stale_after_seconds: float | None = Field(default=None, gt=0)
    in_flight_metrics: list[str] | None = None

    def engine_in_flight(self) -> tuple[str, ...]:
        """The metrics whose sum is an engine's count of requests it holds: `in_flight_metrics`,
        else the preset's (ENGINE_IN_FLIGHT), else none."""
        if self.in_flight_metrics is not None:
            return tuple(self.in_flight_metrics)
        return ENGINE_IN_FLIGHT.get(self.preset, ()) if self.preset else ()

    def stale_after(self, picks: bool) -> float | None:
        """Seconds without a reading after which the gauge counts as saturated (None: never):
        `stale_after_seconds`, else on a pick provider 3 intervals."""
        if self.stale_after_seconds is None and picks:
            return 3 * self.interval_seconds
        return self.stale_after_seconds

    def all_signals(self) -> list[LoadSignal]:
        """Every signal, in the order of the class docstring."""
        found = list(LOAD_PRESETS[self.preset][1]) if self.preset else []
        if self.metric is not None and self.threshold is not None:
            found.append(LoadSignal(metric=self.metric, threshold=self.threshold, recover_below=self.recover_below))
        return found + list(self.signals)

    def label(self) -> str | None:
        """The model label: `model_label`, else the preset's."""
        if self.model_label is not None or self.preset is None:
            return self.model_label
        return LOAD_PRESETS[self.preset][0]


class PassiveHealth(_Strict):
    """Passive degradation: `failures` upstream failures (5xx answers, connection failures and
    resets before the response) of one managed (provider, model) within `window_seconds`, counted
    over every instance in Redis, degrade it for `cooldown_seconds`."""

    enabled: bool = True
    failures: int = Field(default=5, ge=1)
    window_seconds: float = Field(default=10.0, gt=0)
    cooldown_seconds: float = Field(default=30.0, gt=0)


class ConnectFailure(_Strict):
    """Immediate degradation: a managed (provider, model) whose connection Envoy saw refused or
    reset before the response headers is degraded at once (source `connect`) for `ttl_seconds`,
    unless a 2xx response of the pair or a healthy check of the provider clears it first."""

    enabled: bool = True
    ttl_seconds: float = Field(default=15.0, gt=0)


class DegradationSettings(_Strict):
    """Automatic degradation. A flag written by a health or load check lives
    `flag_ttl_intervals` check intervals unless the next check renews it, so a dead checker never
    pins a provider degraded."""

    passive: PassiveHealth = PassiveHealth()
    connect: ConnectFailure = ConnectFailure()
    flag_ttl_intervals: float = Field(default=3.0, ge=1)


_HEADER_NAME = r"^[a-z0-9][a-z0-9_.-]*$"
HeaderName = Annotated[str, Field(pattern=_HEADER_NAME)]


class PreferPreviousProvider(_Strict):
    """An option outside the spec, off by default: a session that has no pin (its pin expired
    between turns) tries the provider of its previous pin first when it pins again, where its
    prefix is most likely still cached. Only the order of the spec's candidates changes: the
    previous provider moves to the front of its own kind (managed providers still come before
    unlimited ones), it must be eligible (supports the request, not degraded), and the admission
    applies every limit as always. The memory is this process's own: at most `max_sessions`
    sessions (least recently routed forgotten first), each for `remember_seconds` after its
    last pinned request; another replica that never routed the session follows the spec."""

    enabled: bool = False
    remember_seconds: float = Field(default=3600.0, gt=0)
    max_sessions: int = Field(default=100_000, gt=0)


class PriorityClass(_Strict):
    """One priority class of the admission queue (docs/queue.md). `max_wait_ms` (milliseconds; 0:
    never waits, the spec) is how long a request of this class may wait for a slot of an own
    provider before the spec's next step (the third party, or the rejection);
    `max_wait_ms_by_model` overrides it per model. `max_depth`: the tickets of this class one
    (provider, model) queue holds at most (a request beyond it does not wait). With
    `use_reserved_slots` false the class never uses the slots reserved for pinned sessions."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9._-]+$")
    max_wait_ms: int = Field(default=0, ge=0, le=60_000)
    max_wait_ms_by_model: dict[str, Annotated[int, Field(ge=0, le=60_000)]] = {}
    max_depth: int = Field(default=256, ge=1, le=100_000)
    use_reserved_slots: bool = True

    def max_wait_ms_for(self, model: str) -> int:
        """The wait of this class for `model`, milliseconds."""
        return self.max_wait_ms_by_model.get(model, self.max_wait_ms)


DEFAULT_PRIORITY_CLASSES = (PriorityClass(name="interactive"), PriorityClass(name="batch", use_reserved_slots=False))


class AdmissionQueue(_Strict):
    """The admission queue shared by every proxy (docs/queue.md), off unless some class waits
    (`max_wait_ms` above 0). `classes` in strict priority order, the first served first (at most 8).
    A request's class: the value of the trusted header `class_header` when it names a class, else
    its identity's entry in `identity_classes` (an identity as sessions write it,
    `trusted_header:<value>` or `credential:<hash>`; body identities are never looked up), else
    `default_class`. A waiting request holds a ticket that expires `ticket_lease_ms` after its
    last renewal (milliseconds); its waiter tries for a slot at least every `poll_ms` (a backstop
    to the pub/sub wake-up), which renews it: `ticket_lease_ms` must be at least 3 x `poll_ms`."""

    classes: list[PriorityClass] = Field(default=list(DEFAULT_PRIORITY_CLASSES), min_length=1, max_length=8)
    default_class: str = "interactive"
    class_header: HeaderName | None = None
    identity_classes: dict[str, str] = {}
    ticket_lease_ms: int = Field(default=3000, gt=0)
    poll_ms: int = Field(default=500, gt=0)

    def enabled(self, model: str) -> bool:
        """Whether some class may wait for `model`: the queue is on for it."""
        return any(c.max_wait_ms_for(model) > 0 for c in self.classes)

    def longest_wait_ms(self) -> int:
        """The longest wait of any class for any model, milliseconds."""
        return max(max([c.max_wait_ms, *c.max_wait_ms_by_model.values()]) for c in self.classes)
class ThirdPartyShare(_Strict):
    """An option outside the spec, off by default (docs/operations.md "Third-party spend"): a cap
    on the share of one identity's requests that unlimited (third-party, paid) providers serve.
    Over the last `window_seconds`, per identity and model, an admission on an unlimited provider
    passes only while `unlimited <= max_share x all + burst`, this admission counted in both
    (`all`: the identity's admissions on every provider, `unlimited`: on unlimited ones). A refused
    admission is the spec's refusal for capacity: the next provider is tried, and with none left
    the request gets 429 `capacity_exceeded`. Checked and counted by the admission's own script
    (one Lua call, atomic); `burst` lets a light identity overflow a few requests."""

    max_share: float = Field(ge=0, le=1)
    window_seconds: float = Field(default=60.0, gt=0)
    burst: int = Field(default=0, ge=0)


class Placement(_Strict):
    """How the router places a request inside a provider with affinity `pick` when the session
    has no endpoint yet (a new session, a sessionless or offloaded request, or a pinned endpoint
    at its cap): each endpoint under its cap scores
    `prefix_weight x overlap - load_weight x in_flight`, the highest wins (docs/routing-state.md
    "Endpoint placement"). `overlap` (0 to 1): the share of the prompt's leading blocks that the
    endpoint served recently, from an approximate index per endpoint: the stable prompt prefix
    (extproc.openai_api.request) cut into blocks of `block_chars` bytes, at most `max_blocks`
    of them, each block's hash chained on the previous one's; the index keeps the latest
    `index_blocks_per_endpoint` hashes an endpoint served (LRU), for `index_ttl_seconds` after
    its last update. `in_flight`: the endpoint's exact count of running requests of the pair,
    or, with a `load` gauge on the provider, its engine's latest count of requests when higher.
    With the defaults a full prefix match is worth 4 requests in flight: a hot prefix stays on
    the endpoint that holds it until that endpoint carries 4 more requests than another one,
    then spreads (pure prefix affinity piles a hot prefix on one replica: SGLang #21199,
    AIBrix #1178).

    `dns_refresh_seconds`: how often the endpoints of a provider whose `endpoints` are one DNS
    name (a headless Service) are resolved again (seconds; Envoy's `dns_refresh_rate` of the
    provider's STRICT_DNS cluster, default 5 s as Envoy's). An address that appears is a new
    endpoint and moves no session; one that disappears moves only its own sessions; a failed
    or empty answer keeps the endpoints known (docs/operations.md "Real fleets")."""

    prefix_weight: float = Field(default=4.0, ge=0)
    load_weight: float = Field(default=1.0, gt=0)
    block_chars: int = Field(default=256, ge=16, le=65_536)
    max_blocks: int = Field(default=32, ge=1, le=256)
    index_blocks_per_endpoint: int = Field(default=4096, ge=1, le=1_000_000)
    index_ttl_seconds: float = Field(default=3600.0, gt=0)
    dns_refresh_seconds: float = Field(default=5.0, ge=0.1, le=3600)


class RoutingSettings(_Strict):
    """Options of the routing algorithm beyond the spec (each off by default). `placement`:
    the placement of requests inside providers with affinity `pick` (Placement)."""

    prefer_previous_provider: PreferPreviousProvider = PreferPreviousProvider()
    queue: AdmissionQueue = AdmissionQueue()
    third_party_share: ThirdPartyShare | None = None
    placement: Placement = Placement()


class TracingSettings(_Strict):
    """OpenTelemetry tracing (docs/operations.md "Tracing"), off while `otlp_endpoint` is None:
    a span per routed request, with the GenAI semantic conventions' attributes and the routing
    outcome, exported over OTLP/gRPC to `otlp_endpoint` (`http://host:4317`; `https://` for TLS).
    A client's `traceparent` is its parent; the span's own context goes to the provider in
    `traceparent`. `sample_ratio`: the share of traces started here that are recorded (a
    client's sampling decision is followed). The exporter's standard environment variables
    (`OTEL_EXPORTER_OTLP_HEADERS`, `OTEL_EXPORTER_OTLP_CERTIFICATE`, `OTEL_RESOURCE_ATTRIBUTES`)
    apply."""

    otlp_endpoint: Annotated[str | None, RESTART_ONLY] = Field(default=None, pattern=r"^https?://")
    sample_ratio: Annotated[float, RESTART_ONLY] = Field(default=1.0, ge=0, le=1)
    service_name: Annotated[str, RESTART_ONLY] = Field(default="iris-extproc", min_length=1)


class TokenUsageSettings(_Strict):
    """Token accounting (docs/operations.md "Third-party spend"): the usage a provider reports in
    its answers (`usage.prompt_tokens` / `completion_tokens`, or the Responses API's
    `input_tokens` / `output_tokens`; of a stream, its last chunk, sent when the client asks with
    `stream_options.include_usage`) is counted per provider and model. `providers`: whose answers
    are read, `unlimited` (third parties: the spend to watch), `all`, or `none`. Reading an answer
    costs a message to this server per body chunk; own engines export token counters of their own."""

    providers: Literal["unlimited", "all", "none"] = "unlimited"


# What tells who a client is, or where it is, to a third party: never sent to unlimited providers.
# `baggage` (W3C Baggage) carries whatever the client's services put in it, user and session ids
# among them.
DEFAULT_PRIVATE_HEADERS = (
    "cookie", "x-forwarded-for", "forwarded", "x-real-ip", "true-client-ip", "x-client-ip",
    "cf-connecting-ip", "x-envoy-external-address", "x-user-id", "baggage",
)


class AdaptationSettings(_Strict):
    """What requests lose before they leave: the client's own credential headers (every
    provider), and the headers that identify the client or where it connects from (unlimited
    providers: third parties). The session's trusted identity headers are removed before
    unlimited providers as well, whatever this list says.

    `restore_model_name`: an answer from a provider that names the model its own way
    (`upstream_model`) gets the client's model name back in its `"model"` fields, JSON and
    streamed (docs/endpoints.md "The model name in answers"); it costs the ext_proc server the
    answer's body (one more message for JSON, one per chunk for a stream), only for such pairs.
    False leaves the provider's name in answers and saves that cost."""

    client_credential_headers: list[HeaderName] = ["authorization", "api-key", "x-api-key"]
    private_headers: list[HeaderName] = list(DEFAULT_PRIVATE_HEADERS)
    restore_model_name: bool = True


class Affinity(str, enum.Enum):
    """How a session keeps its cache inside a provider whose cluster has several replicas.

    `session_hash` (a pool of engines behind one Envoy cluster): the ext_proc server sets
    `server.affinity_header` to an opaque key of the session and the route hashes on it over the
    cluster's consistent-hash load balancer (MAGLEV or RING_HASH), so each session stays on one
    replica and a replica that fails moves only its own sessions. `own_router` (a deployment with
    a router of its own: Dynamo, the llm-d endpoint picker, SGLang's or vLLM's router): the key
    goes in the header that router reads (`router_session_header`). `none`: nothing is sent.
    `pick` (a managed pool whose `endpoints` the router knows; its default): the router chooses
    the endpoint of every request itself, in the admission's own Redis script (a session's pin
    records its endpoint; new sessions and sessionless requests are placed by prefix overlap
    and load, `routing.placement`), and tells Envoy in the endpoint-picker protocol's header
    `x-gateway-destination-endpoint` (docs/operations.md "Real fleets")."""

    SESSION_HASH = "session_hash"
    OWN_ROUTER = "own_router"
    NONE = "none"
    PICK = "pick"


# The header each known router reads for session affinity (docs/operations.md "Real fleets"):
# NVIDIA Dynamo's frontend (with --router-session-affinity-ttl-secs), the llm-d endpoint picker's
# session-affinity scorer (strategy session_id, its default source), the SGLang model gateway
# (policy manual or consistent_hashing) and vllm-router (policy consistent_hash or
# sticky_least_loaded).
ROUTER_SESSION_HEADERS = {
    "dynamo": "x-dynamo-session-id",
    "llm-d": "x-session-id",
    "sglang": "x-smg-routing-key",
    "vllm-router": "x-session-id",
}


class Provider(_Strict):
    """One provider: a name, a kind, the Envoy cluster that reaches it, and its models.

    `endpoints`: the provider's replicas as `http(s)://host:port` URLs, or one DNS name that
    resolves to all of them (a headless Service); `iris-extproc envoy-config` renders the
    provider's cluster from them (the routing config is then the one source of both files).
    Envoy verifies an https endpoint's certificate chain against `tls_ca_file` (a PEM bundle
    on Envoy's host; default: the system's, /etc/ssl/certs/ca-certificates.crt) and its name
    against the endpoint's host, which it also sends as SNI.
    With affinity `pick` each URL is one endpoint, known by its `ip:port` as Envoy knows it
    (`pick_endpoints`: a host name is resolved once, when the config is loaded), except when
    `endpoints` is one URL whose host is a DNS name: then each address the name resolves to is
    an endpoint, resolved again every `routing.placement.dns_refresh_seconds`.
    `affinity` (default: `pick` for a managed provider with `endpoints`, unless it names a
    `sessionless_cluster`, which only a hashed pool has; `session_hash` for another managed
    provider; `none` for an unlimited one, which never receives a session key): see Affinity.
    `pick` is the default since it beat `session_hash` on both of `bench.real_engines`'s
    workloads (docs/benchmarks.md); a pool whose Envoy cluster hashes sets `session_hash`.
    `router_session_header`: with `own_router`, a preset (`dynamo`, `llm-d`, `sglang`,
    `vllm-router`) or the header's own name.
    `sessionless_cluster`: an Envoy cluster over the same replicas with `lb_policy:
    LEAST_REQUEST`, for the requests without a session (embeddings, for one); without it they go
    to `cluster`, where a consistent-hash balancer picks a replica at random.

    `forward_client_identity` (unlimited providers only; default false): whether a third party
    receives what says who the client is, as an own provider does. By default a request sent to
    an unlimited provider loses `adaptation.private_headers` (cookies, the client's address
    headers, including Envoy's `x-envoy-external-address`), the trusted identity headers, the
    session and agent session headers (`session.session_headers`,
    `session.agent_session_headers`) and the body's `user` and `safety_identifier`; true sends
    them on unchanged (for a third party under contract that needs them, for abuse reports for
    one). Own (managed) providers always receive them, and the client's credential headers are
    removed before every provider whatever this says."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9._-]+$")
    kind: ProviderKind
    cluster: str = Field(min_length=1, pattern=r"^[A-Za-z0-9._-]+$")
    models: dict[str, ModelEntry] = Field(min_length=1)
    credentials: Credentials | None = None
    health_check: HealthCheck | None = None
    load: LoadGauge | None = None
    endpoints: list[str] = []
    tls_ca_file: str | None = Field(default=None, min_length=1)
    affinity: Affinity | None = None
    router_session_header: str | None = Field(default=None, pattern=_HEADER_NAME)
    sessionless_cluster: str | None = Field(default=None, min_length=1, pattern=r"^[A-Za-z0-9._-]+$")
    forward_client_identity: bool = False

    @property
    def session_affinity(self) -> Affinity:
        """`affinity`, or its default for the provider's kind."""
        if self.affinity is not None:
            return self.affinity
        if self.kind is ProviderKind.UNLIMITED:
            return Affinity.NONE
        if self.endpoints and self.sessionless_cluster is None:
            return Affinity.PICK
        return Affinity.SESSION_HASH

    @property
    def picks(self) -> bool:
        """Whether the router picks this provider's endpoint (affinity `pick`)."""
        return self.session_affinity is Affinity.PICK

    def session_header(self, affinity_header: str) -> str | None:
        """The header that carries the session key to this provider (`affinity_header`: the
        config's `server.affinity_header`), or None when none is sent."""
        mode = self.session_affinity
        if mode in (Affinity.SESSION_HASH, Affinity.PICK):  # pick: the hash is Envoy's fallback policy
            return affinity_header
        if mode is Affinity.OWN_ROUTER and self.router_session_header is not None:
            return ROUTER_SESSION_HEADERS.get(self.router_session_header, self.router_session_header)
        return None

    def supports(self, model: str, feature: str, sub_features: frozenset[str] = frozenset()) -> bool:
        """The spec's provider.supports(model, feature): the model is served with the feature
        class and every requested sub-feature."""
        entry = self.models.get(model)
        return entry is not None and feature in entry.features and sub_features <= entry.features

    def limits(self, model: str) -> ModelLimits | None:
        """The pair's configured limits, or None for an unlimited pair."""
        entry = self.models.get(model)
        return entry.limits if entry else None


REDIS_NODE_PATTERN = r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):[0-9]{1,5}$"


class RedisClusterSettings(_Strict):
    """A Redis Cluster: one or more seed nodes (`host:port`); the client learns every other node
    and the slot map from them, and follows MOVED / ASK redirections itself."""

    nodes: list[str] = Field(min_length=1)


class RedisSentinelSettings(_Strict):
    """A primary with replicas watched by Redis Sentinel: the sentinels (`host:port`) and the
    service name they know the primary by (`sentinel monitor <service_name> ...`). The client asks
    the sentinels for the primary and asks again after a failover. `password_env`: the
    environment variable holding the sentinels' own password (their `requirepass`), if any."""

    sentinels: list[str] = Field(min_length=1)
    service_name: str = Field(min_length=1)
    password_env: str | None = Field(default=None, min_length=1)


class DurableAdmissions(_Strict):
    """Admissions acknowledged by `replicas` replicas before they are answered (docs/routing-state.md "Durable
    admissions"): after each admitting script the client sends `WAIT <replicas> <timeout_ms>` on
    the same connection. When the replicas do not acknowledge within `timeout_ms` (milliseconds)
    the admission still stands and is counted as not replicated (a metric and a log line)."""

    replicas: int = Field(default=1, ge=1)
    timeout_ms: int = Field(default=50, gt=0)


class RedisSettings(_Strict):
    """Where the shared routing state lives, and what happens while it is gone. Timeouts in
    seconds. `outage_policy` (docs/routing-state.md "When Redis is gone"): `degrade` sends new traffic to pairs
    without an in-flight limit only, `local_share` also lets each instance hold up to its share of
    a managed pair (every lease it holds there counts), `fail_closed` answers 503. The breaker
    opens after `breaker_failures_in_a_row` failed Redis calls in a row of one model (its hash
    tag's slot), or of the fleet's keys, for that scope only (a call that found the connection
    pool busy is load, not a failure, and does not count).
`epoch_grace_seconds`: after Redis lost its state (a new epoch), managed pairs take no new
    admission until this long after the epoch was written (Redis time), so that every instance
    has adopted its running leases first; None (default): 2 x max(probe_interval_seconds,
    instance_heartbeat_seconds) + 1 (3 s with the defaults).

    One topology: a standalone Redis at `url` (`redis://` or `rediss://` for TLS, with
    `user:password@` if wanted), a Redis Cluster (`cluster`), or a primary behind Sentinel
    (`sentinel`). `username` and `password_env` (an environment variable, never the password
    itself) authenticate to the data nodes of any topology. TLS (extproc.storage.tls, the same
    for both clients): on with `tls: true` or a `rediss://` URL (Cluster and Sentinel: `tls:
    true`), for every connection of the topology (each cluster node; the sentinels and the
    primary); the server's certificate is verified against `tls_ca_file` (PEM; else the system's
    certificates) and must name the host connected to; `tls_cert_file` and `tls_key_file` (PEM)
    are the client's certificate and key, for a Redis with `tls-auth-clients yes` (the key may sit
    in the certificate's file). A certificate not verified is refused at start (exit code 2),
    never taken for an outage. `durable_admissions` (off when None): WAIT for replicas after every
    admission (DurableAdmissions).

    `hot_path_client`: the client the routing state's scripts (admissions, renewals, releases,
    abandonments, the queue's) go over: `pipelined` (extproc.storage.pipelined: one pipelined
    connection per node, a fraction of redis-py's CPU per call; at most `max_connections` calls
    in flight, one more is refused at once with a 429) or `redis-py` (the connection pool; a
    call waits up to `socket_timeout_seconds` for a free connection). Everything else (health,
    degraded flags, registry, epoch, chains, fleet state) goes over redis-py either way
    (docs/routing-state.md "Which client carries which call")."""

    url: Annotated[str, RESTART_ONLY] = Field(default="redis://127.0.0.1:6379/0", pattern=r"^rediss?://")
    cluster: Annotated[RedisClusterSettings | None, RESTART_ONLY] = None
    sentinel: Annotated[RedisSentinelSettings | None, RESTART_ONLY] = None
    username: Annotated[str | None, RESTART_ONLY] = Field(default=None, min_length=1)
    password_env: Annotated[str | None, RESTART_ONLY] = Field(default=None, min_length=1)
    tls: Annotated[bool, RESTART_ONLY] = False
    tls_ca_file: Annotated[str | None, RESTART_ONLY] = Field(default=None, min_length=1)
    tls_cert_file: Annotated[str | None, RESTART_ONLY] = Field(default=None, min_length=1)
    tls_key_file: Annotated[str | None, RESTART_ONLY] = Field(default=None, min_length=1)
    key_prefix: Annotated[str, RESTART_ONLY] = Field(default="iris", pattern=r"^[A-Za-z0-9._:-]+$")
    socket_timeout_seconds: Annotated[float, RESTART_ONLY] = Field(default=0.5, gt=0)
    max_connections: Annotated[int, RESTART_ONLY] = Field(default=64, gt=0)
    housekeeping_grace_seconds: float = Field(default=60.0, ge=0)
    outage_policy: Literal["degrade", "local_share", "fail_closed"] = "degrade"
    breaker_failures_in_a_row: Annotated[int, RESTART_ONLY] = Field(default=3, ge=1)
    probe_interval_seconds: float = Field(default=0.5, gt=0)
    instance_heartbeat_seconds: Annotated[float, RESTART_ONLY] = Field(default=1.0, gt=0)
    durable_admissions: DurableAdmissions | None = None
    hot_path_client: Annotated[Literal["pipelined", "redis-py"], RESTART_ONLY] = "pipelined"
    epoch_grace_seconds: float | None = Field(default=None, gt=0)

    @property
    def uses_tls(self) -> bool:
        """Whether connections to Redis use TLS: `tls: true`, or a standalone `rediss://` URL."""
        standalone = self.cluster is None and self.sentinel is None
        return self.tls or (standalone and self.url.startswith("rediss://"))

    @property
    def epoch_grace(self) -> float:
        """The grace after a new epoch, seconds (see the class docstring)."""
        if self.epoch_grace_seconds is not None:
            return self.epoch_grace_seconds
        return 2 * max(self.probe_interval_seconds, self.instance_heartbeat_seconds) + 1


class IdentitySource(str, enum.Enum):
    """Where a client's identity may come from (docs/sessions.md "Identity and sessions").

    `trusted_header`: a header an authenticating filter (jwt_authn, ext_authz) sets, listed in
    `session.trusted_identity_headers`; envoy/envoy.yaml must strip the client's own copy.
    `credential`: a keyed hash of the client's credential (`adaptation.client_credential_headers`).
    `body`: the body's `safety_identifier`, else its `user` (client-chosen: weakest)."""

    TRUSTED_HEADER = "trusted_header"
    CREDENTIAL = "credential"
    BODY = "body"


class SessionSignal(str, enum.Enum):
    """What may say "this is one conversation", strongest first by default.

    `session_header`: `session.session_headers`; `prompt_cache_key`: the body field;
    `conversation`: the Responses API's conversation id; `previous_response_id`: the session of
    the response a Responses turn continues; `agent_headers`: `session.agent_session_headers`
    (Codex CLI, Claude Code, ...); `prefix`: the spec's hash of the stable prompt prefix."""

    SESSION_HEADER = "session_header"
    PROMPT_CACHE_KEY = "prompt_cache_key"
    CONVERSATION = "conversation"
    PREVIOUS_RESPONSE_ID = "previous_response_id"
    AGENT_HEADERS = "agent_headers"
    PREFIX = "prefix"


DEFAULT_AGENT_SESSION_HEADERS = (
    "x-claude-code-session-id",  # Claude Code
    "session-id", "session_id", "conversation_id", "thread-id",  # Codex CLI (newer, then older names)
    "x-session-affinity", "x-litellm-session-id", "x-dynamo-session-id",
)


class SessionSettings(_Strict):
    """Who the client is and which conversation a request belongs to (the spec's
    determine_session_id, with the session signals real clients send). The first identity source
    in `identity_sources` that is present wins (none: anonymous), then the first signal in
    `signals` that is present; the session id is a keyed hash of (identity, model, feature class,
    signal, value), keyed by the secret in the variable `secret_env` names: at least 32 random
    bytes, the same on every instance (`serve` refuses a placeholder, a shorter one or a repeated
    pattern: docs/operations.md "The session secret").

    `max_response_chains`: per model, the Responses chain records kept at most (each lives as long
    as its session's pin can), so Redis memory stays bounded whatever clients send, as pins are
    (`max_pinned_sessions_unlimited`); a response beyond the cap is not recorded, and a turn
    continuing it starts a new session. Null removes the bound.

    `background_response_ttl_seconds`: how long the chain record of a response that its provider
    reports as still running (status `queued` or `in_progress`: a `background: true` response)
    is kept without news of it; every answer that says it still runs (the creating answer, a poll,
    a cancel) starts it again, and an answer that says it ended gives the record the chain TTL
    (`pin_inactivity_timeout_seconds + lease_timeout_seconds`) from then on. Polls and lookups
    that the provider answers restart a record's TTL in every case (extproc.openai_api.chains)."""

    secret_env: Annotated[str, RESTART_ONLY] = "IRIS_SESSION_SECRET"
    identity_sources: list[IdentitySource] = Field(default=list(IdentitySource), min_length=0)
    trusted_identity_headers: list[HeaderName] = []
    signals: list[SessionSignal] = Field(default=list(SessionSignal), min_length=1)
    session_headers: list[HeaderName] = ["x-session-id"]
    agent_session_headers: list[HeaderName] = list(DEFAULT_AGENT_SESSION_HEADERS)
    completions_prefix_chars: int = Field(default=2048, gt=0)
    max_response_chains: int | None = Field(default=100_000, ge=1)
    background_response_ttl_seconds: float = Field(default=86_400, gt=0)


MAX_WORKERS = 64  # ext_proc worker processes of one server (consecutive ports)


class ServerSettings(_Strict):
    """The ext_proc gRPC server. Sizes in bytes, durations in seconds.

    Drain on SIGTERM (docs/operations.md "Draining"): the gRPC health service reports NOT_SERVING at once,
    the server keeps serving for `drain_delay_seconds` (default 3: envoy/envoy.yaml checks every
    1 s and needs 2 failures, plus one interval of margin) so that Envoy stops sending new
    streams, then takes no new stream and lets open ones finish within `drain_grace_seconds`.

    `routing_header` carries the chosen cluster to Envoy's route, `affinity_header` the session's
    opaque key to the route's hash policy (Affinity); Envoy strips a client's own copy of both.

    `workers`: ext_proc worker processes (`iris-extproc serve`; its `--workers` flag overrides it
    for one run). Worker i listens on `listen`'s port + i, so the ports `listen`'s port to that
    port + workers - 1 are all taken; the Envoy file's ext_proc cluster lists each as an endpoint
    (`iris-extproc check` says when it does not) and balances streams over them
    (docs/operations.md "Several workers")."""

    listen: Annotated[str, RESTART_ONLY] = "127.0.0.1:50051"
    workers: Annotated[int, RESTART_ONLY] = Field(default=1, ge=1, le=MAX_WORKERS)
    routing_header: Annotated[str, RESTART_ONLY] = "x-iris-cluster"
    affinity_header: Annotated[str, RESTART_ONLY] = Field(default="x-iris-affinity", pattern=_HEADER_NAME)
    max_body_bytes: int = Field(default=16 * 1024 * 1024, gt=0)
    drain_delay_seconds: float = Field(default=3.0, ge=0)
    drain_grace_seconds: float = Field(default=30.0, ge=0)
    retry_after_seconds: int = Field(default=1, ge=0)
    expose_routing_headers: bool = False
    degraded_refresh_seconds: Annotated[float, RESTART_ONLY] = Field(default=1.0, gt=0)
    decision_timeout_seconds: float = Field(default=2.0, gt=0)
    metrics_listen: Annotated[str | None, RESTART_ONLY] = None
    reload_poll_seconds: float = Field(default=1.0, ge=0)  # 0: reload on SIGHUP only

    def listen_port(self) -> int:
        """The port of `listen` (host:port, the host an IPv4 or IPv6 address or a name). Raises
        ValueError when `listen` names none (loading reports it as a problem of the file)."""
        _, sep, port = self.listen.rpartition(":")
        if not sep or not port.isdigit() or not 0 < int(port) <= 65535:
            raise ValueError(f"{self.listen!r} is not host:port with a port from 1 to 65535")
        return int(port)

    def worker_listen(self, index: int) -> str:
        """The address worker `index` (0 to workers - 1) listens on: `listen` with its port + index."""
        host, _, _ = self.listen.rpartition(":")
        return f"{host}:{self.listen_port() + index}"

    def worker_ports(self) -> list[int]:
        """The port of every worker, in order: `listen`'s port and the next workers - 1."""
        first = self.listen_port()
        return list(range(first, first + self.workers))


class PassthroughEndpoint(_Strict):
    """An engine endpoint beyond OpenAI's that the gateway routes (docs/endpoints.md
    "Passthrough endpoints"): `POST <path>` with a JSON body naming `model` goes to a provider
    whose model lists `feature` among its features, by the same routing rules as any request
    (limits, leases, degradation); its session comes from the explicit session signals only
    (a session header, `prompt_cache_key`, an agent's session header), keyed by `feature`, so it
    never moves a chat's pin. The body is passed on as sent (the model renamed to the pair's
    `upstream_model`)."""

    path: str = Field(pattern=r"^/[A-Za-z0-9._~-]+(/[A-Za-z0-9._~-]+)*$")
    feature: str = Field(pattern=r"^[a-z][a-z0-9_]*$")


# vLLM's (and SGLang's) endpoints beyond OpenAI's: a model opts in by listing the feature.
DEFAULT_PASSTHROUGH_ENDPOINTS = (
    PassthroughEndpoint(path="/tokenize", feature="tokenize"),
    PassthroughEndpoint(path="/detokenize", feature="detokenize"),
    PassthroughEndpoint(path="/v1/rerank", feature="rerank"),
    PassthroughEndpoint(path="/v1/score", feature="score"),
)


DEFAULT_MAX_PINNED_SESSIONS_UNLIMITED = 100_000


class Config(_Strict):
    """The whole gateway configuration. Durations in seconds.

    `max_pinned_sessions_unlimited`: the pin limit of every pair without a configured
    `max_pinned_sessions` (an unlimited provider's pairs, a managed pair without limits), so
    Redis memory stays bounded whatever clients send (docs/routing-state.md "Bounded routing state"); null
    removes the bound. A new session refused a pin only by this cap is routed as a request
    without a session (extproc.routing.router).

    `passthrough_endpoints`: the engine endpoints routed beside OpenAI's (PassthroughEndpoint);
    by default vLLM's `/tokenize`, `/detokenize`, `/v1/rerank` and `/v1/score`, each served only
    by the models that list its feature (`tokenize`, `detokenize`, `rerank`, `score`)."""

    providers: list[Provider] = Field(min_length=1)
    max_pinned_sessions_unlimited: int | None = Field(default=DEFAULT_MAX_PINNED_SESSIONS_UNLIMITED, ge=1)
    pin_inactivity_timeout_seconds: float = Field(default=300, gt=0)
    lease_timeout_seconds: float = Field(default=30, gt=0)
    max_routing_attempts: int = Field(default=10, ge=1)
    redis: RedisSettings = RedisSettings()
    session: SessionSettings = SessionSettings()
    server: ServerSettings = ServerSettings()
    adaptation: AdaptationSettings = AdaptationSettings()
    degradation: DegradationSettings = DegradationSettings()
    routing: RoutingSettings = RoutingSettings()
    passthrough_endpoints: list[PassthroughEndpoint] = list(DEFAULT_PASSTHROUGH_ENDPOINTS)

    def passthrough_features(self) -> frozenset[str]:
        """The features of `passthrough_endpoints`."""
        return frozenset(e.feature for e in self.passthrough_endpoints)
    tracing: TracingSettings = TracingSettings()
    token_usage: TokenUsageSettings = TokenUsageSettings()

    def providers_in_priority_order(self) -> list[Provider]:
        """The spec's all_providers_in_priority_order(): managed providers first, then unlimited
        ones, each group in the file's order."""
        managed = [p for p in self.providers if p.kind is ProviderKind.MANAGED]
        unlimited = [p for p in self.providers if p.kind is ProviderKind.UNLIMITED]
        return managed + unlimited

    def providers_for(self, model: str) -> list[Provider]:
        """The providers serving `model`, in priority order."""
        return [p for p in self.providers_in_priority_order() if model in p.models]

    def models(self) -> list[str]:
        """Every model some provider serves, in first-seen order."""
        return list(dict.fromkeys(m for p in self.providers for m in p.models))

    def pin_limit(self, provider: Provider, model: str) -> tuple[int | None, bool]:
        """The live pins the pair (provider, model) may hold: (limit or None for none, whether
        the limit is the `max_pinned_sessions_unlimited` cap rather than the pair's own)."""
        limits = provider.limits(model)
        if limits is not None and limits.max_pinned_sessions is not None:
            return limits.max_pinned_sessions, False
        return self.max_pinned_sessions_unlimited, self.max_pinned_sessions_unlimited is not None

    def provider(self, name: str) -> Provider:
        """The provider named `name`. Raises KeyError when there is none."""
        for p in self.providers:
            if p.name == name:
                return p
        raise KeyError(name)
