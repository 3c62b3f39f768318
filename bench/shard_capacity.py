"""What one live pin and one live lease cost a Redis shard (docs/capacity.md): memory, from
`INFO memory` used_memory deltas (less the clients' buffers) over `--count` of each, and redis-server CPU per lease renewal,
on one model with one managed provider.

    python -m bench.shard_capacity [--count 10000]

Steps, on a fresh Redis without persistence: `count` sessions pinned with no lease running
(admitted, then released: the pin stays live), then one lease on each of those pins, then
`count` temporary leases (no pin, the spec's admission without a pin). Each delta is divided
by `count`. Then every lease on a pin is renewed once (`--count` renewals, 64 at a time) and the
redis-server's CPU time (/proc) is divided by `count`. The first step includes the one-off cost of the pair's pins zset, negligible at this
count. Zsets of more than 128 members are skiplists, so a pair's pins and leases keys cost more
per member than a session's one-member zset.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from bench.admission import MODEL, bench_config
from bench.common import cpu_seconds, load_average
from extproc.config import parse_config
from extproc.routing.state import Result, RoutingState, connect
from irislab.processes import start_redis

BATCH = 1_000


async def used_memory(redis) -> int:
    """used_memory less the clients' buffers (mem_clients_normal): the pool's connections come
    and go with the load, the data stays."""
    info = await redis.info("memory")
    return int(info["used_memory"]) - int(info["mem_clients_normal"])


async def in_batches(count: int, call, batch: int = BATCH) -> list:
    out = []
    for start in range(0, count, batch):
        out += await asyncio.gather(*(call(i) for i in range(start, min(count, start + batch))))
    return out


async def measure(redis_url: str, count: int, redis_pid: int) -> dict[str, float]:
    """Bytes per live pin, per lease on a pin, per temporary lease (used_memory deltas / count),
    MEMORY USAGE of sample keys (bytes), redis-server CPU per renewal (us)."""
    data = bench_config(redis_url, count * 2)
    data["lease_timeout_seconds"] = 3600  # no lease expires while a large count is being made
    config = parse_config(data)
    redis = connect(redis_url, timeout_seconds=5, max_connections=64)
    await redis.flushall()
    state = RoutingState(redis, config)
    await state.load_scripts()
    out = {}
    base = await used_memory(redis)
    admissions = await in_batches(count, lambda i: state.try_admit_unpinned_session_request("iris-1", MODEL, f"s{i}"))
    assert all(a.result is Result.ADMITTED for a in admissions)
    await in_batches(count, lambda i: state.release_request_lease(admissions[i].lease, refresh_pin=True))
    pinned = await used_memory(redis)
    out["pin"] = (pinned - base) / count
    leases = await in_batches(count, lambda i: state.try_admit_pinned_session_request(MODEL, f"s{i}"))
    assert all(a.result is Result.ADMITTED for a in leases)
    leased = await used_memory(redis)
    out["lease on a pin"] = (leased - pinned) / count
    temporary = await in_batches(count, lambda i: state.try_admit_request_without_pin("iris-1", MODEL))
    assert all(a.result is Result.ADMITTED for a in temporary)
    out["temporary lease"] = (await used_memory(redis) - leased) / count
    cpu_before = cpu_seconds(redis_pid)
    renewed = await in_batches(count, lambda i: state.renew_request_lease(leases[i].lease), batch=64)
    assert all(r.result is Result.RENEWED for r in renewed)
    out["renewal CPU"] = (cpu_seconds(redis_pid) - cpu_before) / count * 1e6
    sample = {
        "pin hash": await redis.memory_usage(state.keys.pin(MODEL, "s0")),
        "session-leases zset (1 lease)": await redis.memory_usage(state.keys.session_leases(MODEL, "s0")),
        f"pair pins zset ({count} pins)": await redis.memory_usage(state.keys.provider_pins(MODEL, "iris-1"), samples=0),
        f"pair leases zset ({2 * count} leases)": await redis.memory_usage(state.keys.provider_leases(MODEL, "iris-1"), samples=0),
    }
    await redis.aclose()
    return {**out, **{f"MEMORY USAGE {k}": v for k, v in sample.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=10_000)
    args = parser.parse_args()
    redis_process = start_redis(Path(tempfile.mkdtemp(prefix="iris-shard-")))
    try:
        figures = asyncio.run(measure(f"redis://127.0.0.1:{redis_process.port}/0", args.count, redis_process.pid))
    finally:
        redis_process.stop()
    print(f"{args.count} of each, load average {load_average():.2f}")
    for name, value in figures.items():
        unit = "us of redis-server CPU each" if name == "renewal CPU" else (
            "bytes" if name.startswith("MEMORY") else "bytes each (used_memory delta / count)")
        print(f"  {name:<48} {value:>10.0f} {unit}")


if __name__ == "__main__":
    main()
