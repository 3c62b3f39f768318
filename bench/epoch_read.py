"""The cost of learning the epoch with every decision (extproc.routing.lease_table): decisions
through `LeaseTable.decide` (and their release) with the epoch read apart (a GET over redis-py,
shared by the decisions waiting on it: what every decision did before issue 24, and what it still
does on a Redis Cluster) against the epoch read inside the admission script (standalone and
Sentinel since issue 24), one at a time and 32 at once, with the routing scripts over redis-py
and over the pipelined client (the default).

    python -m bench.epoch_read [--decisions 3000] [--rounds 2]

Prints, per variant, the wall time per decision plus release and this process's CPU per decision
(time.process_time: Redis's own CPU is not in it), in microseconds. Redis is started here
without persistence; the client runs on the same machine.
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
from extproc.storage.pipelined import open_pipelined
from irislab.processes import start_redis
from tests.support.configs import small_config_data


async def run(url: str, client: str, in_script: bool, n: int, conc: int) -> tuple[float, float]:
    """(wall us, client CPU us) per decision plus release."""
    redis = connect(url, timeout_seconds=2.0)
    config = parse_config(small_config_data(url, lease_timeout_seconds=30))
    hot_path = open_pipelined(config.redis, timeout_seconds=2.0) if client == "pipelined" else None
    state = RoutingState(redis, config, hot_path=hot_path)
    state.epoch_in_script = in_script  # False: as on a Redis Cluster
    router = Router(config, state, DegradedFlags(redis, config))
    table = LeaseTable(config, state, router, OutagePolicy(config, router, InstanceRegistry(redis, "t")), RedisBreaker(redis, 3))
    table.start()
    await table.refresh_epoch()
    sem = asyncio.Semaphore(conc)

    async def one():
        async with sem:
            held = await table.decide(RoutingRequest("m", "chat", frozenset(), None))
            table.end(held, succeeded=True)

    wall, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(one() for _ in range(n)))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    await table.drain()
    if hot_path is not None:
        await hot_path.aclose()
    await redis.aclose()
    return wall / n * 1e6, cpu / n * 1e6


async def main(decisions: int, rounds: int) -> None:
    proc = start_redis(Path(tempfile.mkdtemp()))
    url = f"redis://127.0.0.1:{proc.port}/0"
    try:
        for client in ("redis-py", "pipelined"):
            for conc in (1, 32):
                for _ in range(rounds):
                    for in_script in (False, True):
                        wall, cpu = await run(url, client, in_script, decisions, conc)
                        where = "in script" if in_script else "apart    "
                        print(f"{client:9s} concurrency {conc:2d} epoch {where}: {wall:7.1f} us wall, {cpu:7.1f} us CPU per decision")
    finally:
        proc.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decisions", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    asyncio.run(main(args.decisions, args.rounds))
