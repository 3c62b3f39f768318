"""Client CPU per admission plus release: redis-py against the pipelined client
(extproc.storage.pipelined), on the gateway's own scripts and arguments.

Each pair is the admission a new session makes (`get_pin_and_admit`: EVALSHA with the session's
3 keys, the model's 2 keys per provider and its limits, a fresh lease and pin id) and its
`release`, as extproc.routing.state builds them (keys and arguments built per call in every
variant; replies not decoded). Workers run pairs one after the other, 1 and 32 at once.
Variants: `redis-py` (storage.client.connect and LuaScript, as the gateway calls today),
`pipelined` (PipelinedRedis.evalsha with the same lists) and `pipelined+packed` (the model's
constant keys and arguments as Packed segments, encoded once).

`--path state` measures the same pairs through the wired code instead: RoutingState's
`get_pin_and_try_admit` and `release_request_lease` (keys and arguments built, replies decoded)
with the state's scripts over redis-py (`redis.hot_path_client: redis-py`), over the pipelined
client with the constants encoded per call, and over it with them packed (the gateway's default).

The figure is this process's CPU time (time.process_time) per pair, in microseconds, so Redis's
own CPU is not in it. Redis is started here without persistence.

    python -m bench.redis_client [--pairs 4000] [--loop uvloop|asyncio] [--path scripts|state]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from bench.common import MODEL, print_table, roomy_config
from extproc.config import RedisSettings, parse_config
from extproc.routing.state import SHARE_OFF, RoutingState, new_id
from extproc.storage.client import connect
from extproc.storage.pipelined import Packed, PipelinedRedis, open_pipelined
from irislab.processes import start_redis

VARIANTS = ("redis-py", "pipelined", "pipelined+packed")


class Shapes:
    """The admission's and the release's keys and arguments for one session, built per call as
    RoutingState._call builds them (`packed`: the model's constants as Packed segments)."""

    def __init__(self, state: RoutingState, session: str, packed: bool):
        keys = state.keys
        self.session_keys = [keys.pin(MODEL, session), keys.session_leases(MODEL, session),
                             keys.session_earlier_leases(MODEL, session)]
        # The model's constants, then the share section off, the queue section off, the epoch
        # flag off, no pick pair and no prompt blocks, as RoutingState._call lays them out
        # (lua/lib.lua, lua/queue.lua).
        model_keys, model_args = state._model_keys[MODEL], [*state._model_args[MODEL], *SHARE_OFF, "0", "0", "0", "0"]
        self.model_keys = [Packed(model_keys)] if packed else model_keys
        self.model_args = [Packed(model_args)] if packed else model_args

    def admission(self, lease: str, pin: str) -> tuple[list, list]:
        return [*self.session_keys, *self.model_keys], ["", *self.model_args, lease, pin, "iris-1"]

    def release(self, lease: str, pin: str) -> tuple[list, list]:
        return [*self.session_keys, *self.model_keys], ["", *self.model_args, "iris-1", lease, pin, "1"]


async def worker(call, state: RoutingState, shapes: Shapes, pairs: int, check: bool = False) -> None:
    """`pairs` admissions and releases; `check`: each must be ADMITTED, then RELEASED."""
    admit, release = state._scripts["get_pin_and_admit"], state._scripts["release"]
    for _ in range(pairs):
        lease, pin = new_id(), new_id()
        admitted = await call(admit, *shapes.admission(lease, pin))
        released = await call(release, *shapes.release(lease, pin))
        if check and (admitted[0], released[0]) != (b"ADMITTED", b"RELEASED"):
            raise RuntimeError(f"unexpected replies {admitted[0]!r}, {released[0]!r}")


async def state_worker(state: RoutingState, session: str, pairs: int, check: bool = False) -> None:
    """`pairs` admissions and releases through RoutingState (the gateway's calls for a session
    that is pinned after its first pair); `check`: each must be ADMITTED, then RELEASED."""
    for _ in range(pairs):
        _, admission = await state.get_pin_and_try_admit(MODEL, session, ["iris-1"])
        released = await state.release_request_lease(admission.lease, refresh_pin=True)
        if check and (admission.result.value, released.result.value) != ("ADMITTED", "RELEASED"):
            raise RuntimeError(f"unexpected results {admission.result}, {released.result}")


async def measure_state(url: str, variant: str, concurrency: int, pairs: int) -> float:
    """Client CPU microseconds per admission plus release through RoutingState."""
    config = parse_config({**roomy_config(), "redis": {"url": url, "key_prefix": "bench"}})
    redis = connect(url, timeout_seconds=2.0)
    hot_path = None
    if variant != "redis-py":
        hot_path = open_pipelined(RedisSettings(url=url), timeout_seconds=2.0, max_in_flight=1024)
    state = RoutingState(redis, config, hot_path=hot_path, packed=variant == "pipelined+packed")
    sessions = [f"state-{variant}-{concurrency}-{i}" for i in range(concurrency)]
    per_worker = max(1, pairs // concurrency)
    await asyncio.gather(*(state_worker(state, s, 5, check=True) for s in sessions))  # connected, scripts cached, pinned
    started = time.process_time()
    await asyncio.gather(*(state_worker(state, s, per_worker) for s in sessions))
    cpu = time.process_time() - started
    if hot_path is not None:
        await hot_path.aclose()
    await redis.aclose()
    return cpu / (per_worker * concurrency) * 1e6


async def measure(url: str, variant: str, concurrency: int, pairs: int) -> float:
    """Client CPU microseconds per admission plus release."""
    config = parse_config({**roomy_config(), "redis": {"url": url, "key_prefix": "bench"}})
    if variant == "redis-py":
        client = connect(url, timeout_seconds=2.0)

        async def call(script, keys, args):
            return await script(client, keys, args)
    else:
        client: PipelinedRedis = open_pipelined(RedisSettings(url=url), timeout_seconds=2.0, max_in_flight=1024)

        async def call(script, keys, args):
            return await client.evalsha(script, keys, args)
    state = RoutingState(connect(url), config)
    packed = variant == "pipelined+packed"
    shapes = [Shapes(state, f"bench-{variant}-{i}", packed) for i in range(concurrency)]
    per_worker = max(1, pairs // concurrency)
    await asyncio.gather(*(worker(call, state, s, 5, check=True) for s in shapes))  # connected, scripts cached
    started = time.process_time()
    await asyncio.gather(*(worker(call, state, s, per_worker) for s in shapes))
    cpu = time.process_time() - started
    await client.aclose()
    await state.redis.aclose()
    return cpu / (per_worker * concurrency) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=4000, help="admission + release pairs per run")
    parser.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop", help="event loop (the gateway runs uvloop)")
    parser.add_argument("--rounds", type=int, default=3, help="runs per cell; the lowest is shown")
    parser.add_argument("--path", choices=["scripts", "state"], default="scripts",
                        help="the scripts called directly, or through RoutingState (the wired code)")
    options = parser.parse_args()
    run = asyncio.run
    if options.loop == "uvloop":
        import uvloop

        run = uvloop.run
    how = measure_state if options.path == "state" else measure
    with tempfile.TemporaryDirectory() as folder:
        redis = start_redis(Path(folder))
        try:
            url = f"redis://127.0.0.1:{redis.port}/0"
            rows = []
            for variant in VARIANTS:
                cells = [min(run(how(url, variant, c, options.pairs)) for _ in range(options.rounds)) for c in (1, 32)]
                rows.append([variant, *(round(c) for c in cells)])
        finally:
            redis.stop()
    print_table(f"client CPU per admission + release, us ({options.path}, {options.loop}, {options.pairs} pairs, "
                f"lowest of {options.rounds})",
                ["client", "1 at a time", "32 at once"], rows)


if __name__ == "__main__":
    main()
