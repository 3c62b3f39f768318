"""Prometheus metrics of the ext_proc server (prometheus-client). The README's "Metrics" table
lists every name, type and label.

Two kinds:
- counters and a histogram of this process (decisions, rejections, decision time, Redis errors,
  lease renewals...), updated on the event loop;
- the fleet's routing state (in-flight leases and pins against the limits, degraded flags, live
  instances) read from Redis at scrape time by `FleetCollector`, in the metrics server's thread,
  cached for about a second. Every instance reports the same fleet-wide values: aggregate them
  with `max`, never `sum`.

Labels: `provider` is the routing config's provider name; `gen_ai_request_model` the model the
client asked for (OpenTelemetry GenAI's `gen_ai.request.model`: a configured model name, never
free text from a request). No user or session label.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from redis.exceptions import RedisError

from extproc.degraded import SOURCES
from extproc.fleet_state import CachedFleetState, FleetState

log = logging.getLogger(__name__)

disable_created_metrics()  # no `_created` series beside every counter: half the series, nothing lost

MODEL = "gen_ai_request_model"

DECISIONS = Counter(
    "iris_routing_decisions_total", "Requests routed, by provider, model and reason", ["provider", MODEL, "reason"]
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
LOCAL_LEASES = Gauge("iris_local_leases", "Request leases held in this process only (granted during a Redis outage, not yet adopted)")
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
REDIS_BREAKER_OPEN = Gauge("iris_redis_breaker_open", "1 while the Redis circuit breaker is open (decisions use the outage policy)")
DECISION_SECONDS = Histogram(
    "iris_decision_duration_seconds",
    "Time to decide a request's provider (seconds), Redis round trips included",
    buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.1, 0.5, 2.0),
)
CONFIG_RELOADS = Counter(
    "iris_config_reloads_total", "Reloads of the routing config (SIGHUP or a change of the file), by result: success, failure", ["result"]
)
CONFIG_LAST_SUCCESS = Gauge(
    "iris_config_last_reload_success_timestamp_seconds", "Unix time (seconds) the running routing config was loaded (start-up included)"
)

_PAIR = ["provider", MODEL]

# Series that exist from the start, at 0, so a dashboard shows 0 rather than "no data".
for _result in ("renewed", "failed", "adopted", "lost"):
    LEASE_RENEWALS.labels(_result)
for _operation in ("decision", "renew", "release", "heartbeat", "fleet_state"):
    REDIS_ERRORS.labels(_operation)
for _result in ("success", "failure"):
    CONFIG_RELOADS.labels(_result)


class FleetCollector(Collector):
    """The fleet's routing state as gauges, read from Redis when Prometheus scrapes (see
    extproc.fleet_state for the cost: one pipelined round trip, reused for about a second).
    A failed read yields `iris_fleet_state_up 0` and counts a Redis error; the scrape itself
    never fails."""

    def __init__(self, fleet: CachedFleetState):
        self.fleet = fleet

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(self._families())

    def collect(self) -> Iterator[GaugeMetricFamily]:
        families = self._families()
        up = GaugeMetricFamily("iris_fleet_state_up", "1 when the last read of the fleet state from Redis succeeded")
        try:
            state = self.fleet.get()
        except Exception as exc:  # noqa: BLE001 (a scrape never fails: it says up 0)
            log.warning("fleet state not read for metrics: %s", exc)
            if isinstance(exc, RedisError):
                REDIS_ERRORS.labels("fleet_state").inc()
            up.add_metric([], 0)
            return iter([up])
        up.add_metric([], 1)
        self._fill(families, state)
        return iter([*families, up])

    def _families(self) -> list[GaugeMetricFamily]:
        return [
            GaugeMetricFamily("iris_in_flight_requests", "Live request leases of the pair, fleet-wide (Redis)", labels=_PAIR),
            GaugeMetricFamily("iris_in_flight_request_limit", "The pair's max_global_in_flight_request_slots", labels=_PAIR),
            GaugeMetricFamily(
                "iris_in_flight_request_reserved_slots",
                "The pair's global_in_flight_request_slots_reserved_for_pinned_sessions",
                labels=_PAIR,
            ),
            GaugeMetricFamily("iris_pinned_sessions", "Live pins of the pair, fleet-wide (Redis)", labels=_PAIR),
            GaugeMetricFamily(
                "iris_pinned_session_limit",
                "The pair's pin limit: max_pinned_sessions, or max_pinned_sessions_unlimited for a pair without one",
                labels=_PAIR,
            ),
            GaugeMetricFamily(
                "iris_degraded", "1 while the pair's degraded flag of `source` holds (managed pairs only)", labels=[*_PAIR, "source"]
            ),
            GaugeMetricFamily("iris_live_instances", "Proxy instances whose heartbeat holds in Redis"),
            GaugeMetricFamily("iris_fleet_state_read_seconds", "Duration of the last fleet-state read from Redis (seconds)"),
        ]

    def _fill(self, families: list[GaugeMetricFamily], state: FleetState) -> None:
        in_flight, limit, reserved, pins, pin_limit, degraded, instances, read_seconds = families
        for pair in state.pairs:
            labels = [pair.provider, pair.model]
            in_flight.add_metric(labels, pair.in_flight)
            pins.add_metric(labels, pair.pins)
            if pair.in_flight_limit is not None:
                limit.add_metric(labels, pair.in_flight_limit)
                reserved.add_metric(labels, pair.reserved_for_pinned)
            if pair.pin_limit is not None:
                pin_limit.add_metric(labels, pair.pin_limit)
            if pair.kind == "managed":
                held = {flag.source for flag in pair.flags}
                for source in SOURCES:
                    degraded.add_metric([*labels, source], 1 if source in held else 0)
        instances.add_metric([], state.live_instances)
        read_seconds.add_metric([], self.fleet.last_read_seconds)


def model_label(model: str, configured: frozenset[str] | set[str]) -> str:
    """The `gen_ai_request_model` value for a request's model: itself when configured, else ""
    (a client must not be able to create label values)."""
    return model if model in configured else ""


def start_metrics_server(
    listen: str, fleet: CachedFleetState | None = None, breaker_open: Callable[[], bool] | None = None,
    registry: CollectorRegistry = REGISTRY,
):
    """Serve /metrics on `listen` ("host:port") from a background thread, with the fleet
    collector when `fleet` is given and the breaker gauge read from `breaker_open`. Returns
    prometheus-client's (server, thread); `server.shutdown()` stops it."""
    if fleet is not None:
        registry.register(FleetCollector(fleet))
    if breaker_open is not None:
        REDIS_BREAKER_OPEN.set_function(lambda: 1.0 if breaker_open() else 0.0)
    host, _, port = listen.rpartition(":")
    return start_http_server(int(port), addr=host or "127.0.0.1", registry=registry)
