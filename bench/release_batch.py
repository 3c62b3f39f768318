"""Releases and renewals one script call each against batched (issue 24): client and Redis CPU per
lease at 32 concurrent.

Each round holds `--concurrency` leases of pinned sessions (one model, so one hash tag) and then
renews them all, or releases them all (with the pin refresh a successful request asks for):
`single` is one RoutingState call per lease, all at once (`renew_request_lease` /
`release_request_lease`, as the lease table did before issue 24); `batched` is what the lease
table does now: the renewals of a sweep in one `renew_request_leases` call, the releases of one
loop turn handed to the table's release batcher (one `release_request_leases` call; a round ends
when its calls do, and no lease may be left in Redis). Both over
redis-py and over the pipelined client (packed, the gateway's default).

Figures per lease, in microseconds: this process's CPU (time.process_time, the admissions
between rounds not counted), redis-server's CPU (/proc), and the wall time of the round. Redis is
started here without persistence. The lowest of `--rounds` runs is shown per cell.

    python -m bench.release_batch [--concurrency 32] [--leases 3200] [--rounds 3] [--loop uvloop|asyncio]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from bench.common import MODEL, cpu_seconds, load_average, print_table, roomy_config
from extproc.config import RedisSettings, parse_config
from extproc.routing.lease_table import _ReleaseBatcher
from extproc.routing.state import Lease, Result, RoutingState
from extproc.storage.client import connect
from extproc.storage.pipelined import open_pipelined
from irislab.processes import start_redis

CLIENTS = ("redis-py", "pipelined")
MODES = ("single", "batched")
OPERATIONS = ("renewal", "release")


async def hold(state: RoutingState, sessions: list[str]) -> list[Lease]:
    """One lease per session (a pinned admission after the first)."""
    admissions = await asyncio.gather(*(state.get_pin_and_try_admit(MODEL, s, ["iris-1"]) for s in sessions))
    leases = [a.lease for _, a in admissions]
    if any(lease is None for lease in leases):
        raise RuntimeError("an admission was refused: the bench's config should have room")
    return leases


async def renew(state: RoutingState, leases: list[Lease], mode: str) -> list:
    if mode == "single":
        return await asyncio.gather(*(state.renew_request_lease(lease) for lease in leases))
    return await state.renew_request_leases(leases)


async def release(state: RoutingState, batcher: _ReleaseBatcher, leases: list[Lease], mode: str) -> None:
    if mode == "single":
        answers = await asyncio.gather(*(state.release_request_lease(lease, refresh_pin=True) for lease in leases))
        if any(a.result is not Result.RELEASED for a in answers):
            raise RuntimeError(f"unexpected answers: {sorted({a.result.value for a in answers})}")
        return
    give_up_at = time.monotonic() + 30
    for lease in leases:
        batcher.submit(state, lease, True, give_up_at)
    await batcher.settled()
    if batcher.unsettled:
        raise RuntimeError(f"{batcher.unsettled} releases not answered")


async def measure(url: str, redis_pid: int, client: str, mode: str, operation: str, concurrency: int, leases: int) -> dict:
    """{client, server, wall}: microseconds per lease renewed or released."""
    config = parse_config({**roomy_config(), "redis": {"url": url, "key_prefix": "bench"}})
    redis = connect(url, timeout_seconds=2.0)
    hot_path = None if client == "redis-py" else open_pipelined(RedisSettings(url=url), timeout_seconds=2.0, max_in_flight=1024)
    state = RoutingState(redis, config, hot_path=hot_path)
    await state.load_scripts()
    batcher = _ReleaseBatcher(retry_seconds=0.5)
    sessions = [f"{client}-{mode}-{operation}-{i}" for i in range(concurrency)]
    rounds = max(1, leases // concurrency)
    client_cpu = server_cpu = wall = 0.0
    held = await hold(state, sessions)
    for _ in range(rounds + 1):  # the first round warms up, uncounted
        if operation == "release":
            held = await hold(state, sessions)
        started, server_started, wall_started = time.process_time(), cpu_seconds(redis_pid), time.perf_counter()
        if operation == "renewal":
            answers = await renew(state, held, mode)
        else:
            await release(state, batcher, held, mode)
        if _ > 0:
            client_cpu += time.process_time() - started
            server_cpu += cpu_seconds(redis_pid) - server_started
            wall += time.perf_counter() - wall_started
        if operation == "renewal" and any(a.result is not Result.RENEWED for a in answers):
            raise RuntimeError(f"unexpected answers: {sorted({a.result.value for a in answers})}")
        if operation == "release" and any(await redis.zmscore(state.keys.provider_leases(MODEL, "iris-1"), [h.id for h in held])):
            raise RuntimeError("a lease is left after its release")
    if operation == "renewal":
        await asyncio.gather(*(state.release_request_lease(lease, refresh_pin=False) for lease in held))
    if hot_path is not None:
        await hot_path.aclose()
    await redis.aclose()
    count = rounds * concurrency
    return {"client": client_cpu / count * 1e6, "server": server_cpu / count * 1e6, "wall": wall / count * 1e6}


def _ratio(batched: float, single: float) -> str:
    """batched / single, or "n/a" when single measured 0 (redis-server's CPU ticks every 10 ms)."""
    return f"{batched / single:.2f}x" if single > 0 else "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=32, help="leases renewed or released at once")
    parser.add_argument("--leases", type=int, default=3200, help="leases renewed or released per cell and run")
    parser.add_argument("--rounds", type=int, default=3, help="runs per cell; the lowest is shown")
    parser.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop", help="event loop (the gateway runs uvloop)")
    options = parser.parse_args()
    run = asyncio.run
    if options.loop == "uvloop":
        import uvloop

        run = uvloop.run
    print(f"load average before: {load_average():.2f}")
    with tempfile.TemporaryDirectory() as tmp:
        process = start_redis(Path(tmp))
        url = f"redis://127.0.0.1:{process.port}/0"
        try:
            best: dict[tuple[str, str, str], dict] = {}
            for _ in range(options.rounds):
                for operation in OPERATIONS:
                    for client in CLIENTS:
                        for mode in MODES:
                            figures = run(measure(url, process.pid, client, mode, operation, options.concurrency, options.leases))
                            cell = (operation, client, mode)
                            best[cell] = {k: min(v, best.get(cell, figures)[k]) for k, v in figures.items()}
        finally:
            process.stop()
    rows = []
    for operation in OPERATIONS:
        for client in CLIENTS:
            single, batched = best[(operation, client, "single")], best[(operation, client, "batched")]
            rows.append([
                operation, client,
                *(f"{single[k]:.0f} -> {batched[k]:.0f} ({_ratio(batched[k], single[k])})" for k in ("client", "server", "wall")),
            ])
    print_table(
        f"us per lease, single -> batched, {options.concurrency} at once (lowest of {options.rounds} runs, {options.loop})",
        ["operation", "client", "client CPU", "redis-server CPU", "wall"], rows,
    )
    print(f"load average after: {load_average():.2f}")


if __name__ == "__main__":
    main()
