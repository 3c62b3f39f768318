"""Admission throughput of the routing core alone (no Envoy): decisions per second through
`Router.execute_request` and each script's server time from `INFO commandstats`, with the state
pre-loaded to 1k and to 100k live pins.

    python -m bench.admission [--pins 1000 100000] [--decisions 20000] [--concurrency 64]

Each decision is a pinned session's request (the common path: one fused script call) followed
by its release, so every decision costs two round trips. Redis is started here without
persistence; the client runs on the same machine.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path

from extproc.config import parse_config
from extproc.degraded import DegradedFlags
from extproc.routing import Decision, Router, RoutingRequest
from extproc.state import RoutingState, connect
from irislab.processes import start_redis

MODEL = "m"
PRELOAD_BATCH = 2_000


def bench_config(redis_url: str, pins: int) -> dict:
    limits = {
        "max_pinned_sessions": pins * 2,
        "max_global_in_flight_request_slots": pins * 2,
        "global_in_flight_request_slots_reserved_for_pinned_sessions": 0,
        "max_per_session_in_flight_request_slots": 4,
    }
    return {
        "pin_inactivity_timeout_seconds": 3600,
        "redis": {"url": redis_url, "key_prefix": "bench", "socket_timeout_seconds": 5, "max_connections": 128},
        "providers": [
            {"name": "iris-1", "kind": "managed", "cluster": "iris-1", "models": {MODEL: {"features": ["chat"], "limits": limits}}},
            {"name": "tensorx", "kind": "unlimited", "cluster": "tensorx", "models": {MODEL: {"features": ["chat"]}}},
        ],
    }


async def preload(state: RoutingState, pins: int) -> None:
    """`pins` sessions pinned to iris-1, their first lease released (the pin stays live)."""
    for start in range(0, pins, PRELOAD_BATCH):
        batch = range(start, min(pins, start + PRELOAD_BATCH))
        admissions = await asyncio.gather(
            *(state.try_admit_unpinned_session_request("iris-1", MODEL, f"s{i}") for i in batch)
        )
        await asyncio.gather(*(state.release_request_lease(a.lease, refresh_pin=True) for a in admissions))


async def script_stats(redis) -> dict[str, tuple[int, float]]:
    """evalsha calls and microseconds per call, as INFO commandstats counts them."""
    info = await redis.info("commandstats")
    stats = info.get("cmdstat_evalsha", {"calls": 0, "usec_per_call": 0.0})
    return {"evalsha": (int(stats["calls"]), float(stats["usec_per_call"]))}


async def run(redis_url: str, pins: int, decisions: int, concurrency: int) -> None:
    config = parse_config(bench_config(redis_url, pins))
    redis = connect(redis_url, timeout_seconds=5, max_connections=128)
    await redis.flushall()
    state = RoutingState(redis, config)
    router = Router(config, state, DegradedFlags(redis, config))
    await preload(state, pins)
    await redis.config_resetstat()
    rng = random.Random(1)
    queue = [f"s{rng.randrange(pins)}" for _ in range(decisions)]

    async def worker() -> None:
        while queue:
            session = queue.pop()
            decision = await router.execute_request(RoutingRequest(MODEL, "chat", frozenset(), session))
            assert isinstance(decision, Decision)
            await state.release_request_lease(decision.lease, refresh_pin=True)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    calls, usec = (await script_stats(redis))["evalsha"]
    print(
        f"pins {pins:>7}: {decisions / elapsed:8.0f} decisions/s (each with its release), "
        f"{calls / decisions:.2f} script calls per decision, {usec:.1f} us server time per script call"
    )
    await redis.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pins", type=int, nargs="+", default=[1_000, 100_000])
    parser.add_argument("--decisions", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args()
    redis_process = start_redis(Path(tempfile.mkdtemp(prefix="iris-bench-")))
    try:
        for pins in args.pins:
            asyncio.run(run(f"redis://127.0.0.1:{redis_process.port}/0", pins, args.decisions, args.concurrency))
    finally:
        redis_process.stop()


if __name__ == "__main__":
    main()
