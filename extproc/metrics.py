"""Every metric of this process, defined here and nowhere else (prometheus-client). A leaf:
it imports nothing of the gateway. docs/operations.md ("Metrics") lists every name, type and label.

These are counters, gauges and a histogram of this process (decisions, rejections, decision time,
Redis errors, lease renewals, health checks...), updated on the event loop. The fleet's routing
state (in-flight leases and pins against the limits, degraded flags, live instances) is read from
Redis at scrape time by extproc.operations.exporter.

Labels: `provider` is the routing config's provider name and `kind` its kind (`managed`: our own,
`unlimited`: a third party); `gen_ai_request_model` the model the client asked for (OpenTelemetry
GenAI's `gen_ai.request.model`: a configured model name, never free text from a request). No user
or session label.

Several worker processes (`serve --workers N`) write these to prometheus-client's multiprocess
files (PROMETHEUS_MULTIPROC_DIR, extproc.operations.workers); each gauge says how its workers'
values combine (`multiprocess_mode`); counters and histograms are summed.
"""

from __future__ import annotations

import os
import platform
from importlib import metadata

from prometheus_client import Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.metrics import MetricWrapperBase

disable_created_metrics()  # no `_created` series beside every counter: half the series, nothing lost
if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # prometheus-client writes there from the first metric on
    os.makedirs(os.environ["PROMETHEUS_MULTIPROC_DIR"], exist_ok=True)

MODEL = "gen_ai_request_model"
KIND = "kind"

DECISIONS = Counter(
    "iris_routing_decisions_total", "Requests routed, by provider, its kind, model and reason", ["provider", KIND, MODEL, "reason"]
)
REJECTIONS = Counter(
    "iris_rejections_total", "Requests answered by the router itself, by the error code sent and model", ["code", MODEL]
)
OUTAGE_DECISIONS = Counter("iris_outage_decisions_total", "Decisions made without Redis under the outage policy")
LEASES_ADOPTED = Counter("iris_leases_adopted_total", "Local request leases adopted into Redis after an outage")
DECISIONS_ABANDONED = Counter(
    "iris_decisions_abandoned_total", "Decisions whose answer never arrived (hang-up, timeout, error): their ids were abandoned"
)
SESSION_SIGNALS = Counter("iris_session_signals_total", "Requests by the signal that chose their session", ["signal"])
CHAINS_RECORDED = Counter("iris_response_chains_recorded_total", "Responses API response ids recorded in Redis")
CHAINS_CAPPED = Counter(
    "iris_response_chains_capped_total", "Responses API response ids not recorded: the model's chain records were at session.max_response_chains"
)
RESPONSE_LOOKUPS = Counter(
    "iris_response_lookups_total",
    "Requests for a stored response by id routed to the provider storing it (no slot taken), by action",
    ["action"],
)
LOCAL_LEASES = Gauge(
    "iris_local_leases", "Request leases held in this process only (granted during a Redis outage, not yet adopted)",
    multiprocess_mode="livesum",
)
ADMISSIONS_NOT_REPLICATED = Counter(
    "iris_admissions_not_replicated_total",
    "Admissions answered without redis.durable_admissions.replicas replicas acknowledging them within timeout_ms",
)
LEASES_LOST = Counter("iris_leases_lost_total", "Request leases reported lost (the request was cancelled)")
LEASE_RENEWALS = Counter(
    "iris_lease_renewals_total",
    "Request lease renewals, by result: renewed, failed (a Redis error), adopted (missing in Redis, recorded again), lost",
    ["result"],
)
RELEASE_RETRIES = Counter("iris_lease_release_retries_total", "Lease releases retried after a Redis error")
REDIS_ERRORS = Counter("iris_redis_errors_total", "Redis commands that failed, by what this process was doing", ["operation"])
REDIS_BREAKER_OPEN = Gauge(
    "iris_redis_breaker_open",
    "1 while a scope of the Redis circuit breaker is open (a model's or the fleet's: its decisions use the outage policy)",
    multiprocess_mode="livemax",
)
DECISION_SECONDS = Histogram(
    "iris_decision_duration_seconds",
    "Time to decide a request's provider (seconds), Redis round trips included",
    buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.1, 0.5, 2.0),
)
CONFIG_RELOADS = Counter(
    "iris_config_reloads_total", "Reloads of the routing config (SIGHUP or a change of the file), by result: success, failure", ["result"]
)
CONFIG_LAST_SUCCESS = Gauge(
    "iris_config_last_reload_success_timestamp_seconds",
    "Unix time (seconds) the running routing config was loaded (start-up included); of several workers, the oldest",
    multiprocess_mode="livemin",
)
BUILD_INFO = Gauge(
    "iris_build_info", "1, labelled with the versions running: this package, Python, grpcio, redis-py",
    ["version", "python", "grpcio", "redis_py"], multiprocess_mode="livemax",
)


# Health, load and passive checks (extproc.operations.health).
HEALTH_CHECKS = Counter("iris_health_checks_total", "Active health checks, by provider and result", ["provider", "result"])
UPSTREAM_FAILURES = Counter(
    "iris_upstream_failures_total", "Upstream failures seen by the passive check, by provider and model", ["provider", MODEL]
)
DEGRADATIONS = Counter(
    "iris_automatic_degradations_total", "Times this instance marked a pair degraded, by source", ["provider", "source"]
)
FAILURES_DROPPED = Counter(
    "iris_upstream_failures_dropped_total",
    "Upstream failures not recorded because the passive check's queue was full",
)

# The routing core (extproc.routing).
PIN_CAP_REACHED = Counter(
    "iris_pin_cap_reached_total",
    "New pins refused by max_pinned_sessions_unlimited (the request was served without a pin), by provider, its kind and model",
    ["provider", KIND, MODEL],
)

# Supervised background loops (extproc.supervision).
RESTARTS = Counter(
    "iris_background_task_restarts_total",
    "Background task steps that raised and were restarted after a backoff, by task",
    ["task"],
)

# Series that exist from the start, at 0, so a dashboard shows 0 rather than "no data".
for _result in ("renewed", "failed", "adopted", "lost"):
    LEASE_RENEWALS.labels(_result)
for _operation in ("decision", "renew", "release", "heartbeat", "fleet_state"):
    REDIS_ERRORS.labels(_operation)
for _result in ("success", "failure"):
    CONFIG_RELOADS.labels(_result)


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return ""


BUILD_INFO.labels(_version("iris-extproc"), platform.python_version(), _version("grpcio"), _version("redis")).set(1)


_CHILDREN: dict[tuple[MetricWrapperBase, tuple[str, ...]], MetricWrapperBase] = {}


def child(metric: MetricWrapperBase, *values: str) -> MetricWrapperBase:
    """`metric.labels(*values)`, made once per label tuple and kept: prometheus-client validates
    the values and takes a lock on every `labels` call (about 3 us), a dict lookup here does
    not. For the per-request paths. The values must be bounded (configured names, fixed codes),
    as every label value must be; no metric here is ever `remove`d or `clear`ed, which would
    detach a kept child."""
    key = (metric, values)
    found = _CHILDREN.get(key)
    if found is None:
        found = _CHILDREN[key] = metric.labels(*values)
    return found


def model_label(model: str, configured: frozenset[str] | set[str]) -> str:
    """The `gen_ai_request_model` value for a request's model: itself when configured, else ""
    (a client must not be able to create label values)."""
    return model if model in configured else ""


# The admission queue (extproc.routing.queue, docs/queue.md). Its depth per pair and class is a
# fleet gauge read from Redis at scrape time (iris_queue_depth, extproc.operations.exporter).
QUEUE_WAIT_SECONDS = Histogram(
    "iris_queue_wait_seconds",
    "Time a request waited in the admission queue for an own slot (seconds), by the provider that served it "
    "(empty unless admitted), model, priority class and how the wait ended: admitted, timed_out, left",
    ["provider", MODEL, "priority", "outcome"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
QUEUE_OFFLOADS_AVOIDED = Counter(
    "iris_queue_offloads_avoided_total",
    "Requests an own provider served after they waited in the admission queue (without it: the third party or a rejection)",
    ["provider", MODEL, "priority"],
)
QUEUE_TIMEOUTS = Counter(
    "iris_queue_timeouts_total", "Waits in the admission queue that ended without an own slot (max_wait_ms passed)", [MODEL, "priority"]
)
QUEUE_SHED = Counter(
    "iris_queue_shed_total",
    "Places in a pair's admission queue refused because the class's queue there was at max_depth (one per pair)",
    [MODEL, "priority"],
)

# Third-party spend (extproc.protocol.stream, extproc.routing.router): docs/operations.md "Third-party spend".
TOKENS = Counter(
    "iris_tokens_total",
    "Tokens the providers reported in their answers' usage, by provider, its kind, model and gen_ai_token_type (input, output)",
    ["provider", "kind", MODEL, "gen_ai_token_type"],
)
USAGE_UNREPORTED = Counter(
    "iris_usage_unreported_total",
    "Successful answers read for token usage that reported none (a stream without stream_options.include_usage, a compressed body)",
    ["provider", MODEL],
)
THIRD_PARTY_SHARE_REFUSALS = Counter(
    "iris_third_party_share_refusals_total",
    "Admissions on an unlimited provider refused by routing.third_party_share (the identity's share was at its cap)",
    ["provider", MODEL],
)
