"""The larger flood run of issue 15, outside CI: hostile clients against one gateway instance
(Envoy with one worker) while legitimate requests keep being sent.

    python -m bench.flood [--idle 800] [--slow 100] [--h2 20] [--streams 500] [--resets 5000]
                          [--legit 200] [--connection-limit 1024]

envoy/envoy.yaml runs with its own limits, except the timeouts, shortened so the run takes
about a minute (request headers 2 s, request 5 s, idle 5 s; the file's are 10 s, 60 s, 60 s).
Prints connections and streams tried, what Envoy did with them (its counters), the peak RSS
of Envoy and of the ext_proc server, the legitimate requests' success rate and leases left.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from irislab.flood import FloodPlan, envoy_yaml_with_limits, flood
from tests.support.gateway import MODEL, redis_client, start_gateway, wait_for_no_leases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--idle", type=int, default=800, help="idle connections")
    parser.add_argument("--slow", type=int, default=100, help="slow-header and slow-body connections, each")
    parser.add_argument("--h2", type=int, default=20, help="HTTP/2 connections flooding streams")
    parser.add_argument("--streams", type=int, default=500, help="streams opened on each of them")
    parser.add_argument("--resets", type=int, default=5000, help="HEADERS + RST_STREAM pairs on one more connection")
    parser.add_argument("--legit", type=int, default=200, help="legitimate requests sent meanwhile")
    parser.add_argument("--connection-limit", type=int, default=1024)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="iris-flood-"))
    envoy_yaml = envoy_yaml_with_limits(
        work / "envoy-flood.yaml", connection_limit=args.connection_limit,
        request_headers_timeout="2s", request_timeout="5s", idle_timeout="5s",
    )
    gateway = start_gateway(work, envoy_source=envoy_yaml)
    try:
        instance = gateway.running[0]
        plan = FloodPlan(
            idle_connections=args.idle, slow_header_connections=args.slow, slow_body_connections=args.slow,
            h2_connections=args.h2, h2_streams_per_connection=args.streams, h2_rapid_resets=args.resets,
            overflow_connections=args.connection_limit + 200, legit_requests=args.legit,
            trickle_interval_seconds=0.5, give_up_seconds=120,
        )
        pids = {"envoy": instance.envoy.pid, "extproc": instance.extproc.pid}
        report = flood(instance.listener_port, instance.admin_port, instance.url, MODEL, pids, plan)
        print(report.summary())
        print(f"legitimate statuses {report.legit_statuses}")
        for name, value in sorted(report.envoy_stats.items()):
            if value and not name.startswith(("http.admin", "listener.admin")):
                print(f"  {name} {value}")
        print(f"live leases left    {wait_for_no_leases(redis_client(gateway), within_seconds=30)}")
    finally:
        gateway.stop()


if __name__ == "__main__":
    main()
