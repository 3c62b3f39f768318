"""The Prometheus endpoint: this process's metrics (extproc.metrics) and the fleet's routing
state, read from Redis when Prometheus scrapes (`FleetCollector`, in the metrics server's thread,
cached for about a second). Every instance reports the same fleet-wide values: aggregate them with
`max`, never `sum`.

With PROMETHEUS_MULTIPROC_DIR set (`serve --workers N` sets it: extproc.operations.workers) the
processes of one server write their metrics to files there and one endpoint serves them all
(prometheus-client's MultiProcessCollector: counters and histograms summed over the workers, each
gauge combined as its `multiprocess_mode` says), with the fleet collector of the one process that
serves it, so each decision is counted once and each fleet gauge read once per scrape. The gauges
read from a function at scrape time in a single process (`track_process_gauges`) are written to
the files once a second instead.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable, Iterator

from prometheus_client import REGISTRY, CollectorRegistry, multiprocess, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from extproc.metrics import KIND, LOCAL_LEASES, MODEL, REDIS_BREAKER_OPEN, REDIS_ERRORS
from extproc.operations.fleet_state import CachedFleetState, FleetState
from extproc.operations.ports import ListenError
from extproc.routing.degraded import SOURCES
from extproc.storage.client import REDIS_FAILURES

log = logging.getLogger(__name__)

_PAIR = ["provider", KIND, MODEL]
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
SAMPLE_SECONDS = 1.0  # how often a worker writes its function-read gauges to its multiprocess files


def multiprocess_dir() -> str | None:
    """The multiprocess directory this process writes its metrics to (PROMETHEUS_MULTIPROC_DIR,
    read by prometheus-client when it is first imported), or None: metrics live in memory."""
    return os.environ.get(MULTIPROC_DIR_ENV) or None


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
            labels = [pair.provider, pair.kind, pair.model]
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


def track_process_gauges(breaker_open: Callable[[], bool], local_leases: Callable[[], int]) -> Callable[[], Awaitable[None]] | None:
    """Report this process's Redis breaker state and local lease count. In memory they are read
    at scrape time and None is returned; with multiprocess files the step returned writes them
    there, for `run_every(..., SAMPLE_SECONDS)` (a scrape may see them up to that old)."""
    if multiprocess_dir() is None:
        REDIS_BREAKER_OPEN.set_function(lambda: 1.0 if breaker_open() else 0.0)
        LOCAL_LEASES.set_function(local_leases)
        return None

    async def sample() -> None:
        REDIS_BREAKER_OPEN.set(1.0 if breaker_open() else 0.0)
        LOCAL_LEASES.set(local_leases())

    return sample


def metrics_registry(fleet: CachedFleetState | None = None) -> CollectorRegistry:
    """What /metrics serves: this process's registry (the default one, with prometheus-client's
    `process_*` and `python_*` series), or with multiprocess files a registry merging every
    process's files (no `process_*`/`python_*`: prometheus-client does not merge those); plus the
    fleet collector when `fleet` is given."""
    directory = multiprocess_dir()
    if directory is None:
        registry = REGISTRY
    else:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=directory)
    if fleet is not None:
        registry.register(FleetCollector(fleet))
    return registry


def start_metrics_server(listen: str, registry: CollectorRegistry):
    """Serve `registry` (see `metrics_registry`) on http://`listen`/metrics ("host:port") from a
    background thread. Returns prometheus-client's (server, thread); `server.shutdown()` stops it.
    Raises ports.ListenError when `listen` cannot be bound (taken, or not an address of this host)."""
    host, _, port = listen.rpartition(":")
    try:
        return start_http_server(int(port), addr=host.strip("[]") or "127.0.0.1", registry=registry)
    except OSError as exc:
        raise ListenError(f"cannot serve metrics on {listen} ({exc.strerror or exc})") from None
