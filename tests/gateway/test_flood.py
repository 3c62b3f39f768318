"""Slow clients and connection floods through real Envoy on loopback (issue 15): slow headers,
slow bodies, idle connections, connections over the listener's limit, HTTP/2 stream floods and
rapid resets. Envoy ends every attack connection by itself (its limits and timeouts, shortened
here to seconds), legitimate requests sent meanwhile succeed, the memory of Envoy and of the
ext_proc server stays under the stated bound, and no lease is left.

The same attacks, larger: `python -m bench.flood`."""

from __future__ import annotations

import pytest

from irislab.flood import FloodPlan, envoy_yaml_with_limits, flood
from tests.support.gateway import MODEL, redis_client, start_gateway, wait_for_no_leases

# The stated bounds (docs/operations.md "Deployment: limits against hostile clients"), in KiB of RSS, for
# this small run: Envoy with one worker thread, the ext_proc server.
ENVOY_RSS_BOUND_KB = 256 * 1024
EXTPROC_RSS_BOUND_KB = 256 * 1024
CONNECTION_LIMIT = 120

PLAN = FloodPlan(
    idle_connections=40,
    slow_header_connections=10,
    slow_body_connections=10,
    h2_connections=2,
    h2_streams_per_connection=100,
    h2_rapid_resets=300,
    overflow_connections=CONNECTION_LIMIT + 30,
    legit_requests=20,
    trickle_interval_seconds=0.2,
    give_up_seconds=60,
)


@pytest.mark.slow
def test_hostile_clients_cost_bounded_memory_and_legitimate_requests_still_succeed(tmp_path):
    envoy_yaml = envoy_yaml_with_limits(
        tmp_path / "envoy-short-limits.yaml",
        connection_limit=CONNECTION_LIMIT, request_headers_timeout="1s", request_timeout="3s", idle_timeout="2s",
    )
    gateway = start_gateway(tmp_path, envoy_source=envoy_yaml)
    try:
        instance = gateway.running[0]
        pids = {"envoy": instance.envoy.pid, "extproc": instance.extproc.pid}
        report = flood(instance.listener_port, instance.admin_port, instance.url, MODEL, pids, PLAN)
        print(report.summary(), report.envoy_stats)
        assert report.legit_total == PLAN.legit_requests
        assert report.legit_ok == report.legit_total, report.legit_statuses
        # Envoy ended every attack connection itself: limits and timeouts, none held open.
        assert report.held == 0 and report.closed_by_envoy == report.connections_tried
        stats = report.envoy_stats
        assert sum(v for k, v in stats.items() if k.endswith("downstream_cx_overflow")) >= 30
        assert stats.get("http.openai.downstream_rq_header_timeout", 0) + stats.get("http.openai.downstream_rq_timeout", 0) > 0
        assert report.streams_refused > 0  # streams over max_concurrent_streams
        assert report.peak_rss_kb["envoy"] < ENVOY_RSS_BOUND_KB
        assert report.peak_rss_kb["extproc"] < EXTPROC_RSS_BOUND_KB
        assert instance.extproc.popen.poll() is None and instance.envoy.popen.poll() is None
        assert wait_for_no_leases(redis_client(gateway), within_seconds=30) == 0
    finally:
        gateway.stop()
