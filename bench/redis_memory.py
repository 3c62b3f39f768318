"""Redis memory per live pin and per live lease (docs/capacity.md): `INFO memory` used_memory
deltas over `--count` of each, on one model with one managed provider.

    python -m bench.redis_memory [--count 10000]

Steps, on a fresh Redis without persistence: `count` sessions pinned with no lease running
(admitted, then released: the pin stays live), then one lease on each of those pins, then
`count` temporary leases (no pin, the spec's admission without a pin). Each delta is divided
by `count`. The first step includes the one-off cost of the pair's pins zset, negligible at this
count. Zsets of more than 128 members are skiplists, so a pair's pins and leases keys cost more
per member than a session's one-member zset.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from bench.admission import MODEL, bench_config
from bench.common import load_average
from extproc.config import parse_config
from extproc.state import Result, RoutingState, connect
from irislab.processes import start_redis

BATCH = 1_000


async def used_memory(redis) -> int:
    return int((await redis.info("memory"))["used_memory"])


async def in_batches(count: int, call) -> list:
    out = []
    for start in range(0, count, BATCH):
        out += await asyncio.gather(*(call(i) for i in range(start, min(count, start + BATCH))))
    return out


async def measure(redis_url: str, count: int) -> dict[str, float]:
    """Bytes per live pin, per lease on a pin, per temporary lease (used_memory deltas / count)."""
    config = parse_config(bench_config(redis_url, count * 2))
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
    redis_process = start_redis(Path(tempfile.mkdtemp(prefix="iris-memory-")))
    try:
        figures = asyncio.run(measure(f"redis://127.0.0.1:{redis_process.port}/0", args.count))
    finally:
        redis_process.stop()
    print(f"{args.count} of each, load average {load_average():.2f}")
    for name, value in figures.items():
        unit = "bytes each (used_memory delta / count)" if not name.startswith("MEMORY") else "bytes"
        print(f"  {name:<48} {value:>10.0f} {unit}")


if __name__ == "__main__":
    main()
