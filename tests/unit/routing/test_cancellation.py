"""Cancellation reaches the gateway on every Python it supports (3.11, 3.12, 3.13; `./dev test`
runs this file on each). On 3.11 redis-py's send path can swallow a cancellation that lands while
a command is sent (CPython gh-86296): the decision timeout, a lost lease ending its stream and
the drain would then wait for Redis. Every Redis call a request's task awaits runs in a task of
its own (extproc.storage.client.in_own_task). The pipelined hot-path client (config
`redis.hot_path_client`, extproc.storage.pipelined) has no `wait_for` in its send path: the
decision timeout cuts its calls short too. Redis is made to stall with CLIENT PAUSE WRITE."""

from __future__ import annotations

import asyncio
import sys

import pytest
import redis

from extproc.config import parse_config
from extproc.routing.degraded import DegradedFlags
from extproc.routing.lease_table import Held, LeaseTable
from extproc.routing.outage import InstanceRegistry, OutagePolicy, RedisBreaker
from extproc.routing.router import Router, RoutingRequest
from extproc.routing.state import Result, RoutingState
from extproc.storage.client import in_own_task
from extproc.storage.pipelined import open_pipelined
from tests.support.configs import small_config_data

PAUSE_MS = 3000


def paused(redis_url: str) -> redis.Redis:
    """A second client that stalls every write for PAUSE_MS (scripts count as writes)."""
    client = redis.Redis.from_url(redis_url)
    client.execute_command("CLIENT", "PAUSE", PAUSE_MS, "WRITE")
    return client


async def test_the_decision_timeout_cuts_decisions_short(redis_client, redis_url, hot_path):
    """Forty decisions with a 0.1 ms bound, shorter than a Redis round trip: they time out and
    fall back to the outage policy (a new session to the unlimited tensorx). On 3.11 without a task
    of their own, the timeout's cancellation is swallowed in redis-py's send and every decision
    ran to its end (40 of 40 admitted on iris-1, issue 20 item 4). What an abandoned decision
    admitted late is abandoned: no live lease is left."""
    # 0.1 ms: a decision whose script saw the known epoch is one pipelined round trip (issue 24,
    # no epoch read of its own), 0.25-0.3 ms here, which a 0.3 ms bound no longer cuts short.
    data = small_config_data(redis_url, server={"decision_timeout_seconds": 0.0001})
    data["redis"]["breaker_failures_in_a_row"] = 1000  # every decision goes to Redis, none short-circuits
    limits = {"max_pinned_sessions": 100, "max_global_in_flight_request_slots": 100}
    data["providers"][0]["models"]["m"]["limits"] = limits
    config = parse_config(data)
    state = RoutingState(redis_client, config, hot_path=hot_path)
    await state.load_scripts()
    router = Router(config, state, DegradedFlags(redis_client, config))
    breaker = RedisBreaker(redis_client, config.redis.breaker_failures_in_a_row)
    table = LeaseTable(config, state, router, OutagePolicy(config, router, InstanceRegistry(redis_client, "t")), breaker)
    table.start()
    await table.refresh_epoch()
    outcomes = [await table.decide(RoutingRequest("m", "chat", frozenset(), f"session-{i}")) for i in range(40)]
    cut_short = sum(1 for o in outcomes if isinstance(o, Held) and o.decision.provider.name == "tensorx")
    assert cut_short >= 30, [o.decision.provider.name if isinstance(o, Held) else o for o in outcomes]
    for held in outcomes:
        if isinstance(held, Held):
            table.end(held, succeeded=False)
    await table.drain()
    seconds, micros = await redis_client.time()
    now_ms = seconds * 1000 + micros // 1000
    assert await redis_client.zcount("{t:m}:leases:iris-1", f"({now_ms}", "+inf") == 0


async def test_a_cancelled_call_raises_at_once_and_still_lands(redis_client, redis_url):
    await redis_client.set("warm", "1")
    unpause = paused(redis_url)
    try:
        call = asyncio.ensure_future(in_own_task(redis_client.set("written", "yes")))
        await asyncio.sleep(0.05)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert await redis_client.get("written") is None  # cancelled in the caller while Redis still stalls
    finally:
        unpause.execute_command("CLIENT", "UNPAUSE")
    for _ in range(200):
        if await redis_client.get("written") == b"yes":
            break
        await asyncio.sleep(0.01)
    assert await redis_client.get("written") == b"yes"  # the command itself ran on


async def test_a_cancelled_script_call_on_the_pipelined_client_raises_at_once_and_still_lands(redis_client, redis_url, small_config):
    """A routing script over the pipelined client, without a task of its own, cancelled while
    Redis stalls: the caller gets CancelledError at once (Redis still paused), the script runs
    when Redis resumes, and the connection's replies stay in order for the next call."""
    hot_path = open_pipelined(small_config.redis, timeout_seconds=5)
    state = RoutingState(redis_client, small_config, hot_path=hot_path)
    try:
        assert (await state.try_admit_request_without_pin("iris-1", "m", lease_id="warm")).result is Result.ADMITTED
        unpause = paused(redis_url)
        try:
            call = asyncio.ensure_future(state.try_admit_request_without_pin("iris-1", "m", lease_id="cancelled"))
            await asyncio.sleep(0.05)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            leases = state.keys.provider_leases("m", "iris-1")
            assert await redis_client.zscore(leases, "cancelled") is None  # cancelled while Redis still stalls
        finally:
            unpause.execute_command("CLIENT", "UNPAUSE")
        assert (await state.try_admit_request_without_pin("iris-1", "m", lease_id="next")).lease.id == "next"
        assert await redis_client.zscore(leases, "cancelled") is not None  # the script itself ran on
    finally:
        await hot_path.aclose()


def test_this_python_is_one_the_package_supports():
    assert (3, 11) <= sys.version_info[:2] <= (3, 13)
