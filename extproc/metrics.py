"""Prometheus metrics of the ext_proc server (prometheus-client)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram, start_http_server

DECISIONS = Counter("iris_routing_decisions_total", "Requests routed, by provider and reason", ["provider", "reason"])
REJECTIONS = Counter("iris_rejections_total", "Requests answered by the router itself, by code", ["code"])
OUTAGE_DECISIONS = Counter("iris_outage_decisions_total", "Requests routed without Redis under the outage policy")
LEASES_ADOPTED = Counter("iris_leases_adopted_total", "Local request leases adopted into Redis after an outage")
DECISIONS_ABANDONED = Counter(
    "iris_decisions_abandoned_total", "Decisions whose answer never arrived (hang-up, timeout, error): their ids were abandoned"
)
SESSION_SIGNALS = Counter("iris_session_signals_total", "Requests by the signal that chose their session", ["signal"])
CHAINS_RECORDED = Counter("iris_response_chains_recorded_total", "Responses API response ids recorded in Redis")
LEASES_LOST = Counter("iris_leases_lost_total", "Request leases reported lost (the request was cancelled)")
DECISION_SECONDS = Histogram(
    "iris_decision_seconds",
    "Time to decide a request's provider (seconds), Redis round trips included",
    buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.1, 0.5, 2.0),
)


def start_metrics_server(listen: str) -> None:
    """Serve /metrics on `listen` ("host:port") from a background thread."""
    host, _, port = listen.rpartition(":")
    start_http_server(int(port), addr=host or "127.0.0.1")
