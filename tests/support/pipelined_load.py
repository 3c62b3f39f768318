"""Load over the pipelined hot-path client for its failover tests (tests/unit/storage): writers
that loop a script call on their keys and record every answer or Redis failure, and a wait on a
condition."""

from __future__ import annotations

import asyncio
from collections import Counter

from extproc.storage.client import REDIS_FAILURES, LuaScript
from extproc.storage.pipelined import PipelinedRedis

WRITE = LuaScript("redis.call('SET', KEYS[1], ARGV[1]) return ARGV[1]")


class Writers:
    """`per_key` looping writers of `b"x"` to each of `keys` through `client`; `outcomes` holds
    every reply (`b"x"`) or Redis failure (the exception) in the order they came, `answered`
    the replies per key."""

    def __init__(self, client: PipelinedRedis, keys: list[str], per_key: int = 4):
        self.client = client
        self.outcomes: list[object] = []
        self.answered: Counter[str] = Counter()
        self._stop = asyncio.Event()
        self._tasks = [asyncio.ensure_future(self._write(key)) for key in keys for _ in range(per_key)]

    async def _write(self, key: str) -> None:
        while not self._stop.is_set():
            try:
                self.outcomes.append(await self.client.evalsha(WRITE, [key], ["x"]))
                self.answered[key] += 1
            except REDIS_FAILURES as exc:
                self.outcomes.append(exc)
                await asyncio.sleep(0.01)

    def failures(self) -> int:
        return sum(1 for outcome in self.outcomes if isinstance(outcome, Exception))

    async def stop(self, within_seconds: float) -> None:
        """Stop every writer; raises TimeoutError when one is still waiting after `within_seconds`."""
        self._stop.set()
        async with asyncio.timeout(within_seconds):
            await asyncio.gather(*self._tasks)


async def until(predicate, what: str, attempts: int = 1000) -> None:
    """Poll `predicate` every 10 ms, up to `attempts` times; AssertionError naming `what` if it never holds."""
    for _ in range(attempts):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{what}: never")
