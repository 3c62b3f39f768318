"""The larger fleet run of issue 5, outside CI: 3 instances x 10,000 requests by default.

    python -m bench.fleet_soak [--instances 3] [--requests 30000] [--sessions 3000]

Prints what the CI test asserts, at scale: status counts, routing reasons, each own provider's
highest concurrency against its limit, sessions served on more than one pin, live leases left
after the load, and throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import tempfile
import time

import httpx
import redis

from tests.support.fleet import LoadPlan, pinned_providers_per_session, run_load
from tests.support.gateway import LIMITS, MODEL, gateway_config, start_gateway, wait_for_no_leases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--instances", type=int, default=3)
    parser.add_argument("--requests", type=int, default=30_000)
    parser.add_argument("--sessions", type=int, default=3_000)
    parser.add_argument("--concurrency", type=int, default=48)
    parser.add_argument("--abort-share", type=float, default=0.1)
    parser.add_argument("--pins", type=int, default=300, help="max_pinned_sessions of each own provider")
    parser.add_argument("--slots", type=int, default=12, help="max_global_in_flight_request_slots of each own provider")
    args = parser.parse_args()

    limits = {**LIMITS, "max_pinned_sessions": args.pins, "max_global_in_flight_request_slots": args.slots,
              "global_in_flight_request_slots_reserved_for_pinned_sessions": 2}
    providers = gateway_config()["providers"]
    for provider in providers[:2]:
        provider["models"][MODEL]["limits"] = limits
    gateway = start_gateway(tempfile.mkdtemp(prefix="iris-soak-"), instances=args.instances, providers=providers)
    try:
        plan = LoadPlan(
            requests=args.requests, sessions=args.sessions, concurrency=args.concurrency,
            stream_share=0.5, abort_share=args.abort_share,
        )
        started = time.monotonic()
        result = asyncio.run(run_load([i.url for i in gateway.running], plan))
        elapsed = time.monotonic() - started
        records = result.records
        print(f"requests            {len(records)} in {elapsed:.1f} s ({len(records) / elapsed:.0f} requests/s)")
        print(f"instances           {args.instances}, sessions {args.sessions}, concurrency {args.concurrency}")
        print(f"statuses            {dict(sorted(collections.Counter(r.status for r in records).items(), key=str))}")
        print(f"aborted mid-stream  {sum(r.abort for r in records)}")
        print(f"transport errors    {sum(1 for r in records if r.transport_error and not r.abort)} (aborts excluded)")
        print(f"reasons             {dict(collections.Counter(r.reason for r in records))}")
        print(f"providers           {dict(collections.Counter(r.provider for r in records))}")
        limit = args.slots
        for name in ("iris-1", "iris-2"):
            stats = httpx.get(f"{gateway.provider_url(name)}/stats", timeout=5).json()
            peak = stats["max_in_flight_by_model"].get(MODEL, 0)
            print(f"{name} peak in-flight {peak} (limit {limit}): {'ok' if peak <= limit else 'BREACH'}")
        multi = sum(1 for p in pinned_providers_per_session(records).values() if len(p) > 1)
        print(f"sessions on >1 pin  {multi}")
        left = wait_for_no_leases(redis.Redis.from_url(gateway.redis_url), within_seconds=1.0)
        print(f"live leases after   {left} (read from Redis within 1 s of the end)")
    finally:
        gateway.stop()


if __name__ == "__main__":
    main()
