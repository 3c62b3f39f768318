"""The Prometheus endpoint: this process's metrics (extproc.metrics) and the fleet's routing
state, read from Redis when Prometheus scrapes (`FleetCollector`, in the metrics server's thread,
cached for about a second). Every instance reports the same fleet-wide values: aggregate them with
`max`, never `sum`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client import REGISTRY, CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from extproc.metrics import MODEL, REDIS_BREAKER_OPEN, REDIS_ERRORS
from extproc.operations.fleet_state import CachedFleetState, FleetState
from extproc.routing.degraded import SOURCES
from extproc.storage.client import REDIS_FAILURES

log = logging.getLogger(__name__)

_PAIR = ["provider", MODEL]


class FleetCollector(Collector):
    """The fleet's routing state as gauges, read from Redis when Prometheus scrapes (see
    extproc.operations.fleet_state for the cost: one pipelined round trip, reused for about a second).
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
            if isinstance(exc, REDIS_FAILURES):
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
            GaugeMetricFamily(
                "iris_queue_depth", "Live tickets waiting in the pair's admission queue, by priority class (Redis)",
                labels=[*_PAIR, "priority"],
            ),
            GaugeMetricFamily("iris_fleet_state_read_seconds", "Duration of the last fleet-state read from Redis (seconds)"),
        ]

    def _fill(self, families: list[GaugeMetricFamily], state: FleetState) -> None:
        in_flight, limit, reserved, pins, pin_limit, degraded, instances, queue_depth, read_seconds = families
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
            for priority, depth in pair.queued.items():
                queue_depth.add_metric([*labels, priority], depth)
        instances.add_metric([], state.live_instances)
        read_seconds.add_metric([], self.fleet.last_read_seconds)


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
