"""Admission throughput of the routing core alone (no Envoy): decisions per second through
`Router.execute_request` and each script's server time from `INFO commandstats`, with the state
pre-loaded to 1k and to 100k live pins.

    python -m bench.admission [--pins 1000 100000] [--decisions 20000] [--concurrency 64]
                              [--wait-replicas 1 [--wait-timeout-ms 50]] [--pick 3 [--engine-readings]]

Each decision is a pinned session's request (the common path: one fused script call) followed
by its release, so every decision costs two round trips. Redis is started here without
persistence; the client runs on the same machine. With `--wait-replicas N` the Redis gets N
replicas (local processes, in sync before the run) and the config turns on
`redis.durable_admissions` (a WAIT after every admission, docs/routing-state.md "Durable admissions"), to
measure what it costs. With `--pick N` iris-1 has affinity pick over N endpoints (no cap): every
admission also places the request (its session's endpoint, the fallbacks scored by prefix
overlap and load) and teaches the endpoint's prefix index the prompt's blocks (one of 64 shared
prefixes of 4 KiB: 16 blocks), to compare redis-server CPU per decision with and without it.
`--engine-readings` (with `--pick`) records an engine reading for every endpoint first (as the
`load` gauge of a pick provider does), so each placement also parses them.
Latencies are per decision (admission only, the release not included).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path

from bench.common import cpu_seconds, load_average, summarize_ms
from extproc import metrics
from extproc.config import parse_config
from extproc.routing.degraded import DegradedFlags
from extproc.routing.endpoint_health import EndpointHealth
from extproc.routing.placement import deciding_with, prompt_blocks
from extproc.routing.router import Decision, Router, RoutingRequest
from extproc.routing.state import RoutingState, connect
from irislab.processes import start_redis
from irislab.redis_topologies import start_replica

MODEL = "m"
PRELOAD_BATCH = 2_000


def bench_config(redis_url: str, pins: int, wait_replicas: int = 0, wait_timeout_ms: int = 50, pick: int = 0) -> dict:
    limits = {
        "max_pinned_sessions": pins * 2,
        "max_global_in_flight_request_slots": pins * 2,
        "global_in_flight_request_slots_reserved_for_pinned_sessions": 0,
        "max_per_session_in_flight_request_slots": 4,
    }
    redis = {"url": redis_url, "key_prefix": "bench", "socket_timeout_seconds": 5, "max_connections": 128}
    if wait_replicas:
        redis["durable_admissions"] = {"replicas": wait_replicas, "timeout_ms": wait_timeout_ms}
    pool = {"name": "iris-1", "kind": "managed", "cluster": "iris-1", "models": {MODEL: {"features": ["chat"], "limits": limits}}}
    if pick:
        pool.update(affinity="pick", endpoints=[f"http://127.0.0.1:{9000 + i}" for i in range(pick)])
    return {
        "pin_inactivity_timeout_seconds": 3600,
        "redis": redis,
        "providers": [pool, {"name": "tensorx", "kind": "unlimited", "cluster": "tensorx", "models": {MODEL: {"features": ["chat"]}}}],
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


async def run(
    redis_url: str, pins: int, decisions: int, concurrency: int, wait_replicas: int = 0, wait_timeout_ms: int = 50,
    redis_pid: int | None = None, pick: int = 0, engine_readings: bool = False,
) -> None:
    """One run; with `redis_pid`, the redis-server's CPU time per decision is reported too: the
    shard's ceiling is one core's worth of them (Redis runs scripts on one thread)."""
    config = parse_config(bench_config(redis_url, pins, wait_replicas, wait_timeout_ms, pick))
    placement = config.routing.placement
    prefixes = [prompt_blocks(f"system prompt {i} ".encode() * 256, placement.block_chars, 16) for i in range(64)] if pick else [()]
    redis = connect(redis_url, timeout_seconds=5, max_connections=128)
    await redis.flushall()
    state = RoutingState(redis, config)
    router = Router(config, state, DegradedFlags(redis, config))
    await preload(state, pins)
    if pick and engine_readings:
        readings = {endpoint: float(i) for i, endpoint in enumerate(state.endpoints("iris-1"))}
        await EndpointHealth(redis, config.redis.key_prefix).write_readings("iris-1", MODEL, readings, 3600)
    await redis.config_resetstat()
    rng = random.Random(1)
    queue = [f"s{rng.randrange(pins)}" for _ in range(decisions)]
    latencies_ms: list[float] = []
    not_replicated_before = metrics.ADMISSIONS_NOT_REPLICATED._value.get()

    async def worker() -> None:
        while queue:
            session = queue.pop()
            asked = time.perf_counter()
            with deciding_with(prefixes[hash(session) % len(prefixes)]):
                decision = await router.execute_request(RoutingRequest(MODEL, "chat", frozenset(), session))
            latencies_ms.append((time.perf_counter() - asked) * 1000)
            assert isinstance(decision, Decision)
            await state.release_request_lease(decision.lease, refresh_pin=True)

    redis_cpu_before = cpu_seconds(redis_pid) if redis_pid else 0.0
    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    redis_cpu_us = (cpu_seconds(redis_pid) - redis_cpu_before) / decisions * 1e6 if redis_pid else None
    calls, usec = (await script_stats(redis))["evalsha"]
    latency = summarize_ms(latencies_ms)
    waits = (f", WAIT {wait_replicas} {wait_timeout_ms}" if wait_replicas else "") + (f", pick over {pick} endpoints" if pick else "")
    waits += " with engine readings" if pick and engine_readings else ""
    not_replicated = metrics.ADMISSIONS_NOT_REPLICATED._value.get() - not_replicated_before
    print(
        f"pins {pins:>7}{waits}: {decisions / elapsed:8.0f} decisions/s (each with its release), "
        f"{calls / decisions:.2f} script calls per decision, {usec:.1f} us server time per script call, "
        f"decision p50 {latency['p50_ms']:.2f} ms p99 {latency['p99_ms']:.2f} ms"
        + (f", {not_replicated:.0f} not replicated in time" if wait_replicas else "")
        + (f"; redis-server CPU {redis_cpu_us:.0f} us per decision (one core: {1e6 / redis_cpu_us:.0f} decisions/s)"
           if redis_cpu_us else "")
        + f"; load average {load_average():.2f}"
    )
    await redis.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pins", type=int, nargs="+", default=[1_000, 100_000])
    parser.add_argument("--decisions", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--wait-replicas", type=int, default=0, help="start this many replicas and WAIT for them on admissions")
    parser.add_argument("--wait-timeout-ms", type=int, default=50)
    parser.add_argument("--pick", type=int, default=0, help="iris-1 with affinity pick over this many endpoints")
    parser.add_argument("--engine-readings", action="store_true", help="with --pick: an engine reading recorded for every endpoint")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="iris-bench-"))
    redis_process = start_redis(work)
    replicas = [start_replica(work / f"replica-{i}", redis_process.port) for i in range(args.wait_replicas)]
    try:
        for pins in args.pins:
            asyncio.run(run(f"redis://127.0.0.1:{redis_process.port}/0", pins, args.decisions, args.concurrency,
                            args.wait_replicas, args.wait_timeout_ms, redis_process.pid, args.pick, args.engine_readings))
    finally:
        for replica in replicas:
            replica.stop()
        redis_process.stop()



if __name__ == "__main__":
    main()
