"""The cost of the epoch read every decision makes with its admission (extproc.routing.lease_table):
decisions through `LeaseTable.decide` (and their release) with the read and without it, one at
a time and 32 at once (the concurrent ones share one read in flight).

    python -m bench.epoch_read [--decisions 3000]

Redis is started here without persistence; the client runs on the same machine.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from extproc.config import parse_config
from extproc.routing.degraded import DegradedFlags
from extproc.routing.lease_table import LeaseTable
from extproc.routing.outage import InstanceRegistry, OutagePolicy, RedisBreaker
from extproc.routing.router import Router, RoutingRequest
from extproc.routing.state import RoutingState, connect
from irislab.processes import start_redis
from tests.conftest import small_config_data


async def run(url, skip_read, n, conc):
    redis = connect(url, timeout_seconds=2.0)
    config = parse_config(small_config_data(url, lease_timeout_seconds=30))
    state = RoutingState(redis, config)
    router = Router(config, state, DegradedFlags(redis, config))
    table = LeaseTable(config, state, router, OutagePolicy(config, router, InstanceRegistry(redis, "t")), RedisBreaker(redis, 3))
    table.start()
    await table.refresh_epoch()
    if skip_read:
        def already_read() -> asyncio.Future:
            read = asyncio.get_running_loop().create_future()
            read.set_result(None)
            return read

        table._epoch_read_shared = already_read
    sem = asyncio.Semaphore(conc)

    async def one(i):
        async with sem:
            held = await table.decide(RoutingRequest("m", "chat", frozenset(), None))
            table.end(held, succeeded=True)
    t = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    dt = time.perf_counter() - t
    await table.drain()
    await redis.aclose()
    return dt / n * 1e6


async def main(decisions: int) -> None:
    proc = start_redis(Path(tempfile.mkdtemp()))
    url = f"redis://127.0.0.1:{proc.port}/0"
    try:
        for conc in (1, 32):
            for skip in (True, False, True, False):
                us = await run(url, skip, decisions, conc)
                print(f"concurrency {conc:2d} epoch read {'off' if skip else 'on '}: {us:7.1f} us per decision")
    finally:
        proc.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decisions", type=int, default=3000)
    asyncio.run(main(parser.parse_args().decisions))
