"""Batched renewals and releases (issue 24) over a real Redis: several leases of one model in one
script call (lua/renew.lua and lua/release.lua, variadic) leave exactly the state as many single
calls; the lease table renews every lease held in one call per sweep, cancels a lost one among
them, keeps renewing through a failed sweep, and releases what ends in one loop turn in one call.
Script calls are counted with `INFO commandstats` (cmdstat_evalsha)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from prometheus_client import REGISTRY
from redis.exceptions import ResponseError

from extproc.config import parse_config
from extproc.routing.degraded import DegradedFlags
from extproc.routing.lease_table import Held, LeaseTable
from extproc.routing.outage import InstanceRegistry, OutagePolicy, RedisBreaker
from extproc.routing.router import Router, RoutingRequest
from extproc.routing.state import MAX_LEASES_PER_CALL, Lease, QueueArgs, Result, RoutingState, connect
from extproc.storage.pipelined import open_pipelined
from irislab.processes import start_redis
from tests.support.configs import small_config_data

T0 = 1_000_000_000
LEASE_MS = 30_000
ROOMY = {
    "max_pinned_sessions": 50,
    "max_global_in_flight_request_slots": 4,
    "global_in_flight_request_slots_reserved_for_pinned_sessions": 1,
    "max_per_session_in_flight_request_slots": 4,
}
QUEUE = {"classes": [{"name": "interactive", "max_wait_ms": 1000}], "ticket_lease_ms": 3000, "poll_ms": 500}


def roomy_config(redis_url: str, **overrides):
    """Model m on iris-1 (50 pins, 4 slots, 1 reserved) and iris-2 (same), tensorx unlimited."""
    data = small_config_data(redis_url, **overrides)
    for provider in data["providers"]:
        if "limits" in provider["models"]["m"]:
            provider["models"]["m"]["limits"] = {**ROOMY, "max_global_in_flight_request_slots": 100}
    data["providers"][1]["models"]["m"]["limits"] = ROOMY  # iris-2: 4 slots, so a ticket queues there
    return parse_config(data)


async def snapshot(redis) -> dict:
    """Every key: its type, its content, and whether it has a TTL."""
    out = {}
    for key in sorted(await redis.keys("*")):
        kind = (await redis.type(key)).decode()
        if kind == "zset":
            content = await redis.zrange(key, 0, -1, withscores=True)
        elif kind == "hash":
            content = sorted((await redis.hgetall(key)).items())
        else:
            content = await redis.get(key)
        out[key] = (kind, content, await redis.pttl(key) > 0)
    return out


async def scenario(state: RoutingState) -> list[tuple[Lease, bool]]:
    """Leases of every kind on model m at T0, and a waiting ticket on iris-2 (full): two of one
    pinned session, pinned ones refreshed or not, temporary ones (the queue's hand-over), one
    expired, one never admitted, one on a provider the config lacks."""
    releases = []
    for i in range(4):
        admission = await state.try_admit_unpinned_session_request("iris-1", "m", f"s{i}", lease_id=f"P{i}", pin_id=f"pin{i}", now_ms=T0)
        assert admission.result is Result.ADMITTED
        releases.append((admission.lease, i % 2 == 0))
    second = await state.try_admit_pinned_session_request("m", "s0", lease_id="P0b", now_ms=T0 + 1)
    releases.append((second.lease, True))
    for i in range(3):
        temporary = await state.try_admit_request_without_pin("iris-2", "m", lease_id=f"T{i}", now_ms=T0)
        releases.append((temporary.lease, False))
    waiting = QueueArgs(0, True, "tenant", "W", "join", 8)
    assert (await state.try_admit_request_without_pin("iris-2", "m", lease_id="W", now_ms=T0 + 2, queue=waiting)).result is Result.QUEUED
    expired = await state.try_admit_unpinned_session_request("iris-1", "m", "old", lease_id="X", pin_id="pinX", now_ms=T0 - LEASE_MS)
    releases.append((expired.lease, True))
    releases.append((Lease("m", "iris-1", "never", None, None, 0), False))
    releases.append((Lease("m", "ghost", "G", None, None, 0), False))
    return releases


async def one_by_one(calls) -> list:
    out = []
    for call in calls:
        try:
            out.append(await call())
        except ResponseError as exc:
            out.append(type(exc))
    return out


def answers(batch: list) -> list:
    return [type(a) if isinstance(a, ResponseError) else a for a in batch]


@pytest.fixture
def qstate(redis_client, redis_url, hot_path) -> RoutingState:
    return RoutingState(redis_client, roomy_config(redis_url, routing={"queue": QUEUE}), hot_path=hot_path)


async def test_a_batched_release_leaves_the_state_of_single_releases(qstate, redis_client):
    now = T0 + 100
    releases = await scenario(qstate)
    singles = await one_by_one(lambda lease=lease, refresh=refresh: qstate.release_request_lease(lease, refresh, now_ms=now)
                               for lease, refresh in releases)
    after_singles = await snapshot(redis_client)
    await redis_client.flushall()
    releases = await scenario(qstate)
    batched = await qstate.release_request_leases(releases, now_ms=now)
    assert answers(batched) == singles
    assert await snapshot(redis_client) == after_singles
    results = [a.result for a in singles[:-1]]
    assert results.count(Result.RELEASED) == 8 and Result.LEASE_EXPIRED in results and Result.NOT_FOUND in results
    assert singles[-1] is ResponseError  # the unknown provider's, alone in its slot of the batch


async def test_a_batched_renewal_leaves_the_state_of_single_renewals(qstate, redis_client):
    now = T0 + 100
    leases = [lease for lease, _ in await scenario(qstate)]
    singles = await one_by_one(lambda lease=lease: qstate.renew_request_lease(lease, now_ms=now) for lease in leases)
    after_singles = await snapshot(redis_client)
    await redis_client.flushall()
    leases = [lease for lease, _ in await scenario(qstate)]
    batched = await qstate.renew_request_leases(leases, now_ms=now)
    assert answers(batched) == singles
    assert await snapshot(redis_client) == after_singles
    assert [a.result for a in singles[:-1]].count(Result.RENEWED) == 8


async def test_a_batch_takes_one_model_and_a_bounded_number_of_leases(qstate):
    other = Lease("e", "iris-1", "E", None, None, 0)
    with pytest.raises(ValueError):
        await qstate.renew_request_leases([Lease("m", "iris-1", "A", None, None, 0), other])
    with pytest.raises(ValueError):
        await qstate.release_request_leases([(other, False)] * (MAX_LEASES_PER_CALL + 1))


# ---- the lease table --------------------------------------------------------------------


def make_table(client, redis_url, hot_path=None, lease_timeout_seconds: float = 3.0, **overrides) -> LeaseTable:
    config = roomy_config(redis_url, lease_timeout_seconds=lease_timeout_seconds, **overrides)
    state = RoutingState(client, config, hot_path=hot_path)
    router = Router(config, state, DegradedFlags(client, config))
    table = LeaseTable(config, state, router, OutagePolicy(config, router, InstanceRegistry(client, "t")), RedisBreaker(client, 3))
    table.start()
    return table


async def evalsha_calls(redis) -> int:
    return int((await redis.info("commandstats")).get("cmdstat_evalsha", {}).get("calls", 0))


def renewals(result: str) -> float:
    return REGISTRY.get_sample_value("iris_lease_renewals_total", {"result": result}) or 0


async def wait_for(predicate, seconds: float = 10.0) -> bool:
    for _ in range(int(seconds / 0.02)):
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return False


async def hold(table: LeaseTable, n: int) -> list[Held]:
    helds = await asyncio.gather(*(table.decide(RoutingRequest("m", "chat", frozenset(), f"s{i}")) for i in range(n)))
    assert all(isinstance(h, Held) and h.lease is not None and not h.local for h in helds)
    return list(helds)


async def test_n_leases_renew_in_one_call_per_sweep_and_a_lost_one_among_them_is_cancelled(redis_url, redis_client, hot_path):
    table = make_table(redis_client, redis_url, hot_path)
    await table.state.load_scripts()
    await table.refresh_epoch()
    helds = await hold(table, 8)
    lost = helds[3]
    cancelled = []
    lost.on_lost = lambda: cancelled.append(lost)
    seconds, _ = await redis_client.time()
    leases = table.state.keys.provider_leases("m", "iris-1")
    await redis_client.zadd(leases, {lost.lease.id: seconds * 1000 - 1000}, xx=True)
    await redis_client.zadd(leases, {f"taken-{i}": seconds * 1000 + 60_000 for i in range(100)})  # its slot went to others
    before, renewed_before = await evalsha_calls(redis_client), renewals("renewed")
    assert await wait_for(lambda: renewals("renewed") - renewed_before >= 7)
    assert await wait_for(lost.lost.is_set) and cancelled == [lost]
    assert await evalsha_calls(redis_client) - before == 2  # 8 leases, one script call; the lost one's adoption refused
    assert not any(h.lost.is_set() for h in helds if h is not lost)
    for held in helds:
        table.end(held, succeeded=True)
    await table.drain()


@contextlib.asynccontextmanager
async def table_on_own_redis(tmp_path, hot_path, lease_timeout_seconds: float):
    """(a lease table with 4 leases held on a Redis of its own whose socket timeout is 0.1 s, a
    control client with a 2 s timeout, to pause that Redis); everything stopped afterwards."""
    process = start_redis(tmp_path)
    url = f"redis://127.0.0.1:{process.port}/0"
    settings = {"url": url, "key_prefix": "t", "socket_timeout_seconds": 0.1}
    redis = connect(url, timeout_seconds=0.1)
    client = None if hot_path is None else open_pipelined(roomy_config(url, redis=settings).redis)
    control = connect(url, timeout_seconds=2.0)
    try:
        table = make_table(redis, url, client, lease_timeout_seconds=lease_timeout_seconds, redis=settings)
        await table.state.load_scripts()
        await table.refresh_epoch()
        yield table, await hold(table, 4), control
    finally:
        await control.execute_command("CLIENT", "UNPAUSE")
        await control.aclose()
        if client is not None:
            await client.aclose()
        await redis.aclose()
        process.stop()


async def test_a_failed_sweep_keeps_the_requests_running_and_the_renewals_going(tmp_path, hot_path):
    """A sweep whose call Redis does not answer in time (CLIENT PAUSE WRITE: the renewal script
    stalls past the socket timeout) is a failed renewal of every lease in it, counted once by the
    breaker; the sweeps go on, the next answered ones renew (or adopt) every lease, none is lost."""
    async with table_on_own_redis(tmp_path, hot_path, lease_timeout_seconds=0.9) as (table, helds, control):
        failed_before = renewals("failed")
        seen_before = table.breaker.failures_seen
        await control.execute_command("CLIENT", "PAUSE", 400, "WRITE")
        assert await wait_for(lambda: renewals("failed") - failed_before >= 4)
        assert table.breaker.failures_seen - seen_before >= 1
        resumed = renewals("renewed") + renewals("adopted")
        assert await wait_for(lambda: renewals("renewed") + renewals("adopted") - resumed >= 8)  # two sweeps' worth
        assert not any(h.lost.is_set() for h in helds)
        seconds, micros = await control.time()
        now_ms = seconds * 1000 + micros // 1000
        assert await control.zcount(table.state.keys.provider_leases("m", "iris-1"), f"({now_ms}", "+inf") == 4
        for held in helds:
            table.end(held, succeeded=True)
        await table.drain()


async def test_k_releases_in_one_loop_turn_go_in_one_call(redis_url, redis_client, hot_path):
    table = make_table(redis_client, redis_url, hot_path, lease_timeout_seconds=30)
    await table.state.load_scripts()
    await table.refresh_epoch()
    helds = await hold(table, 8)
    before = await evalsha_calls(redis_client)
    for held in helds:  # one loop turn: nothing awaits in between
        table.end(held, succeeded=True)
    await table.drain()
    assert await evalsha_calls(redis_client) - before == 1
    assert await redis_client.zcard(table.state.keys.provider_leases("m", "iris-1")) == 0
    for held in helds:  # each pin refreshed and kept, as a single release with refresh does
        pin = await table.state.get_pin("m", held.decision.lease.session_id)
        assert pin is not None and pin.id == held.lease.pin_id


async def test_releases_that_met_a_stalled_redis_go_again_and_land(tmp_path, hot_path):
    """Releases whose call Redis does not answer in time (CLIENT PAUSE WRITE past the socket
    timeout) are each counted as retried and go again after `retry_seconds`; once Redis answers
    they land: no lease is left and none is pending."""
    async with table_on_own_redis(tmp_path, hot_path, lease_timeout_seconds=30) as (table, helds, control):
        retried_before = REGISTRY.get_sample_value("iris_lease_release_retries_total") or 0
        await control.execute_command("CLIENT", "PAUSE", 600, "WRITE")
        for held in helds:
            table.end(held, succeeded=True)
        assert table.pending_releases == 4
        assert await wait_for(lambda: REGISTRY.get_sample_value("iris_lease_release_retries_total") - retried_before >= 4)
        assert await wait_for(lambda: table.pending_releases == 0)
        assert await control.zcard(table.state.keys.provider_leases("m", "iris-1")) == 0
        await table.drain()


async def test_leases_of_two_configs_renew_in_their_own_calls_by_their_own_timeouts(redis_url, redis_client, hot_path):
    """Issue 20 item 1 with batches: after a reload that changed lease_timeout_seconds, each lease
    renews in a call of the config it was admitted under and is extended by that config's
    timeout, not the other's."""
    table = make_table(redis_client, redis_url, hot_path, lease_timeout_seconds=0.9)
    await table.refresh_epoch()
    [short] = await hold(table, 1)
    longer = roomy_config(redis_url, lease_timeout_seconds=3.0)
    state = RoutingState(redis_client, longer, hot_path=hot_path)
    table.reconfigure(longer, state, Router(longer, state, DegradedFlags(redis_client, longer)))
    [long] = await hold(table, 1)
    leases = table.state.keys.provider_leases("m", "iris-1")
    admitted_until = await redis_client.zscore(leases, long.lease.id)
    for _ in range(500):  # its first renewal, a third of 3 s after its admission (a 0.9 s one would not extend it)
        if await redis_client.zscore(leases, long.lease.id) > admitted_until:
            break
        await asyncio.sleep(0.02)
    seconds, micros = await redis_client.time()
    now_ms = seconds * 1000 + micros // 1000
    assert 0 < await redis_client.zscore(leases, short.lease.id) - now_ms <= 900
    assert 2000 < await redis_client.zscore(leases, long.lease.id) - now_ms <= 3000
    assert not short.lost.is_set() and not long.lost.is_set()
    for held in (short, long):
        table.end(held, succeeded=True)
    await table.drain()
    assert await redis_client.zcard(leases) == 0
