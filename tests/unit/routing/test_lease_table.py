"""The lease table (extproc.routing.lease_table) over a real Redis: renewal, release, loss only when
Redis saw a lease expire, adoption when Redis lost it, abandonment, pool exhaustion (redis-py's
pool, and the pipelined hot-path client's in-flight cap), the breaker. Tests taking `hot_path`
run once with the routing scripts over redis-py and once over the pipelined client."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from prometheus_client import REGISTRY

from extproc.config import parse_config
from extproc.routing.degraded import DegradedFlags
from extproc.routing.lease_table import Held, LeaseTable, Refusal
from extproc.routing.outage import InstanceRegistry, OutagePolicy, RedisBreaker
from extproc.routing.router import Router
from extproc.routing.state import RoutingState, connect
from extproc.storage.pipelined import open_pipelined
from irislab.processes import free_port, start_redis
from tests.support.configs import small_config_data
from tests.support.lease_tables import chat, live, make_table


async def wait_for(predicate, seconds: float = 5.0) -> bool:
    for _ in range(int(seconds / 0.02)):
        if await predicate():
            return True
        await asyncio.sleep(0.02)
    return False


async def test_renews_and_releases_once(redis_url, redis_client, hot_path):
    table = make_table(redis_client, redis_url, hot_path)
    await table.refresh_epoch()
    held = await table.decide(chat("s"))
    assert isinstance(held, Held)
    await asyncio.sleep(1.0)  # > 3 lease timeouts: only renewals keep it alive
    assert await live(redis_client, table) == 1
    table.end(held, succeeded=True)
    table.end(held, succeeded=True)
    await table.drain()
    assert not held.lost.is_set()
    assert await redis_client.zcard(table.state.keys.provider_leases("m", "iris-1")) == 0


async def test_a_lease_redis_saw_expire_whose_slot_was_taken_is_lost(redis_url, redis_client, hot_path):
    """Issue 29, item 0: an expired lease comes back only within the pair's limit; here the 4
    slots went to others while it was expired, so it is lost and its request cancelled."""
    table = make_table(redis_client, redis_url, hot_path)
    await table.refresh_epoch()
    held = await table.decide(chat("s"))
    seconds, _ = await redis_client.time()
    leases = table.state.keys.provider_leases("m", "iris-1")
    # The slots go to others first: a renewal between the two steps finds its lease live.
    await redis_client.zadd(leases, {f"other-{i}": seconds * 1000 + 60_000 for i in range(4)})  # the limit
    await redis_client.zadd(leases, {held.lease.id: seconds * 1000 - 1000}, xx=True)
    await asyncio.wait_for(held.lost.wait(), timeout=5)
    assert await live(redis_client, table) == 4  # the others', never the lost one beside them
    table.end(held, succeeded=True)
    await table.drain()


async def test_a_lease_redis_saw_expire_comes_back_within_the_limit(redis_url, redis_client, hot_path):
    """Issue 29, item 0: an expired lease whose pair still has room is admitted again (the
    frozen process, the stalled Redis, the stepped clock: nobody took its slot) and its request
    keeps running."""
    table = make_table(redis_client, redis_url, hot_path)
    await table.refresh_epoch()
    held = await table.decide(chat("s"))
    seconds, _ = await redis_client.time()
    await redis_client.zadd(table.state.keys.provider_leases("m", "iris-1"), {held.lease.id: seconds * 1000 - 1000}, xx=True)
    assert await wait_for(lambda: _is(live(redis_client, table), 1))
    await asyncio.sleep(0.5)  # more renewals, now of the lease admitted again
    assert not held.lost.is_set()
    assert await live(redis_client, table) == 1
    table.end(held, succeeded=True)
    await table.drain()
    assert await live(redis_client, table) == 0


async def test_a_lease_redis_lost_is_adopted_and_its_request_keeps_running(redis_url, redis_client, hot_path):
    table = make_table(redis_client, redis_url, hot_path)
    await table.refresh_epoch()
    held = await table.decide(chat("s"))
    await redis_client.flushall()  # as a restart without persistence would: the epoch goes too
    assert await wait_for(lambda: _is(live(redis_client, table), 1))
    await asyncio.sleep(0.5)  # more renewals, now of the adopted lease
    assert not held.lost.is_set()
    assert await live(redis_client, table) == 1
    table.end(held, succeeded=True)
    await table.drain()
    assert await live(redis_client, table) == 0


@pytest.mark.parametrize("client_kind", ["redis-py", "pipelined"])
async def test_a_decision_timed_out_on_a_stalled_redis_leaves_nothing_once_it_answers(tmp_path, client_kind):
    """Issue 10, item 1: the admissions sent to a Redis whose writes are paused (CLIENT PAUSE
    WRITE: the epoch read each decision makes first is answered, the admission script stalls)
    run when it resumes; the abandonment of their ids (queued when the decisions timed out into
    the outage path) ends them, whichever arrives first (the ids are tombstones)."""
    process = start_redis(tmp_path)
    url = f"redis://127.0.0.1:{process.port}/0"
    redis = connect(url, timeout_seconds=0.2)
    settings = {"url": url, "key_prefix": "t", "socket_timeout_seconds": 0.2}
    hot_path = None if client_kind == "redis-py" else open_pipelined(parse_config(small_config_data(url, redis=settings)).redis)
    try:
        table = make_table(redis, url, hot_path, redis=settings)
        await table.refresh_epoch()
        abandoned_before = REGISTRY.get_sample_value("iris_decisions_abandoned_total") or 0
        control = connect(url, timeout_seconds=2.0)
        await control.execute_command("CLIENT", "PAUSE", 1000, "WRITE")
        try:
            outcomes = await asyncio.gather(*(table.decide(chat(f"s{i}")) for i in range(5)))
        finally:
            await control.execute_command("CLIENT", "UNPAUSE")
            await control.aclose()
        assert all(isinstance(o, Held) and o.decision.provider.name == "tensorx" for o in outcomes)  # the outage path
        assert REGISTRY.get_sample_value("iris_decisions_abandoned_total") - abandoned_before == 5  # sent, then abandoned
        assert await wait_for(lambda: _is_zero(table.pending_abandonments))
        await asyncio.sleep(0.2)
        assert await live(redis, table, "iris-1") == 0
        assert [k for k in await redis.keys("*") if b":pin:" in k] == []
        for held in outcomes:
            table.end(held, succeeded=True)
        await table.drain()
    finally:
        if hot_path is not None:
            await hot_path.aclose()
        await redis.aclose()
        process.stop()


async def test_an_admission_read_with_a_changed_epoch_keeps_nothing(redis_url, redis_client, hot_path):
    """The epoch is read alongside the admission, not before it: when that read finds Redis lost
    its state (here the epoch key is gone, as after a flush), what the admission wrote is
    abandoned and the decision follows the epoch grace (unlimited pairs only)."""
    table = make_table(redis_client, redis_url, hot_path)
    await table.refresh_epoch()
    await redis_client.delete(table._epoch_key)
    outcome = await table.decide(chat("s"))
    assert isinstance(outcome, Held) and outcome.decision.provider.name == "tensorx"
    assert table.rebuilding
    assert await wait_for(lambda: _is_zero(table.pending_abandonments))
    for provider in ("iris-1", "iris-2"):
        assert await live(redis_client, table, provider) == 0  # abandoned: an expired record at most
    assert [k for k in await redis_client.keys("*") if b":pin:" in k] == []
    table.end(outcome, succeeded=True)
    await table.drain()


async def test_pool_exhaustion_is_overload_and_keeps_the_breaker_closed(redis_url, redis_client):
    busy = connect(redis_url, timeout_seconds=0.2, max_connections=1)
    table = make_table(busy, redis_url, redis={"url": redis_url, "key_prefix": "t", "socket_timeout_seconds": 0.2})
    await busy.ping()
    taken = await busy.connection_pool.get_connection()  # as a busy process's calls would hold it
    outcomes = [await table.decide(chat(f"s{i}")) for i in range(5)]
    assert outcomes == [Refusal.OVERLOADED] * 5
    assert not table.breaker.is_open
    await busy.connection_pool.release(taken)
    assert isinstance(await table.decide(chat("after")), Held)
    await table.drain()
    await busy.aclose()


async def test_the_pipelined_clients_in_flight_cap_is_overload_and_keeps_the_breaker_closed(redis_url, redis_client):
    """The pipelined client refuses a call beyond `max_in_flight` at once (InFlightCapReached):
    the decision answers 429 (Refusal.OVERLOADED), as redis-py's busy pool does, and the breaker
    does not count it. A BLPOP on the client holds its one slot, and its connection, meanwhile."""
    hot_path = open_pipelined(parse_config(small_config_data(redis_url)).redis, timeout_seconds=2, max_in_flight=1)
    table = make_table(redis_client, redis_url, hot_path)
    await table.refresh_epoch()
    holding = asyncio.ensure_future(hot_path.execute("BLPOP", "nothing", 1))
    await asyncio.sleep(0.05)
    outcomes = [await table.decide(chat(f"s{i}")) for i in range(5)]
    assert outcomes == [Refusal.OVERLOADED] * 5
    assert not table.breaker.is_open
    assert await holding is None
    after = await table.decide(chat("after"))
    assert isinstance(after, Held) and after.decision.provider.name == "iris-1"
    table.end(after, succeeded=True)
    await table.drain()
    await hot_path.aclose()


@pytest.mark.parametrize("client_kind", ["redis-py", "pipelined"])
async def test_a_routing_state_that_fails_opens_the_breaker(redis_url, redis_client, client_kind):
    """Decisions whose scripts cannot reach Redis (the client of the routing scripts points at a
    closed port) are failures, not overload: each falls back to the outage policy (an unpinned
    request to the unlimited tensorx), and the breaker opens after 3 in a row."""
    dead = f"redis://127.0.0.1:{free_port()}/0"
    if client_kind == "redis-py":
        scripts_client, hot_path = connect(dead, timeout_seconds=0.2), None
    else:
        scripts_client, hot_path = redis_client, open_pipelined(parse_config(small_config_data(dead)).redis, timeout_seconds=0.2)
    table = make_table(scripts_client, redis_url, hot_path)
    outcomes = [await table.decide(chat(f"s{i}")) for i in range(3)]
    assert all(isinstance(o, Held) and o.decision.provider.name == "tensorx" for o in outcomes)
    assert table.breaker.is_open
    for held in outcomes:
        table.end(held, succeeded=True)
    await table.drain()
    await (hot_path or scripts_client).aclose()


async def _is(awaitable, value) -> bool:
    return (await awaitable) == value


async def _is_zero(value) -> bool:
    return value == 0


async def test_a_dead_shard_holds_up_no_other_abandonment_and_its_own_give_up(redis_url, redis_client):
    """Abandonments that cannot reach their Redis (a dead shard: a closed port) are retried only
    until whatever they could have admitted has expired by itself (a lease timeout), and several
    are served at once: the abandonment of a live shard's lease is not queued behind them."""
    from extproc.routing.router import Ids

    table = make_table(redis_client, redis_url)
    table.retry_seconds = 0.05  # several retries within the lease timeout (0.3 s)
    await table.refresh_epoch()
    dead_state = RoutingState(connect(f"redis://127.0.0.1:{free_port()}/0", timeout_seconds=0.05), table.config)
    for i in range(8):
        table._abandon(chat(f"dead-{i}"), Ids.fresh(), dead_state)
    held = await table.decide(chat("live"))
    assert isinstance(held, Held) and await live(redis_client, table) == 1
    table._abandon(chat("live"), Ids(held.lease.id, Ids.fresh().pin_id), table.state)
    assert await wait_for(lambda: _none_live(redis_client, table), seconds=0.25)
    assert table.pending_abandonments > 0  # the live one went through while the dead ones still retry
    assert await wait_for(lambda: _no_pending(table), seconds=5)  # each gave up after a lease timeout (0.3 s)
    table._forget(held)
    await table.drain()


async def _none_live(redis_client, table) -> bool:
    return await live(redis_client, table) == 0


async def _no_pending(table) -> bool:
    return table.pending_abandonments == 0


async def test_a_decision_that_admitted_then_met_an_exhausted_pool_abandons_what_it_admitted(redis_url, redis_client):
    """A pinned admission that met a changed pin is released by the router; when that release
    finds this process's connections all busy, the decision fails as overloaded and what it
    admitted is abandoned all the same (issue 20: it was neither released nor abandoned)."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    config = parse_config(small_config_data(redis_url))  # 30 s leases: none expires by itself here
    state = RoutingState(redis_client, config)
    plain = Router(config, state, DegradedFlags(redis_client, config))
    table = LeaseTable(config, state, plain, OutagePolicy(config, plain, InstanceRegistry(redis_client, "t")), RedisBreaker(redis_client, 3))
    table.start()
    await table.refresh_epoch()

    class AdmitsThenFindsThePoolBusy(Router):
        async def execute_request(self, request, ids):
            await self.state.try_admit_unpinned_session_request("iris-1", request.model, request.session_id, lease_id=ids.lease_id,
                                                                pin_id=ids.pin_id)
            raise RedisConnectionError("no connection available") from TimeoutError()

    router = AdmitsThenFindsThePoolBusy(table.config, table.state, table.router.degraded)
    assert await table.decide(chat("s"), router=router) is Refusal.OVERLOADED
    assert await wait_for(lambda: _none_live(redis_client, table), seconds=5)
    await table.drain()


async def test_a_local_lease_no_config_serves_does_not_keep_the_breaker_open(redis_url, redis_client):
    """A reload during an outage can leave a local lease naming a provider that the state it was
    granted with lacks (issue 20): the recovery adopts it through the state that serves the pair,
    or forgets it when none does, and closes the breaker either way."""
    from extproc.routing.router import Decision, Reason
    from extproc.routing.state import Lease, new_id

    table = make_table(redis_client, redis_url)
    await table.refresh_epoch()
    newer = parse_config(small_config_data(redis_url, lease_timeout_seconds=0.3, providers=[
        *small_config_data(redis_url)["providers"],
        {"name": "iris-3", "kind": "managed", "cluster": "iris-3",
         "models": {"m": {"features": ["chat"], "limits": {"max_global_in_flight_request_slots": 4}}}},
    ]))
    newer_state = RoutingState(redis_client, newer)
    table.reconfigure(newer, newer_state, Router(newer, newer_state, DegradedFlags(redis_client, newer)))
    old_state = RoutingState(redis_client, parse_config(small_config_data(redis_url, lease_timeout_seconds=0.3)))
    table.breaker.trip(ConnectionError("outage"))
    served = table._hold(Decision(newer.provider("iris-3"), Reason.UNPINNED, Lease("m", "iris-3", new_id(), None, None, 0), None,
                                  refresh_pin_on_success=False), local=True, state=old_state)
    ghost = newer.provider("iris-3").model_copy(update={"name": "gone"})
    orphan = table._hold(Decision(ghost, Reason.UNPINNED, Lease("m", "gone", new_id(), None, None, 0), None,
                                  refresh_pin_on_success=False), local=True, state=old_state)
    assert table.local_leases == 2
    assert await table.recover() == 2
    assert not table.breaker.is_open and table.local_leases == 0
    assert await live(redis_client, table, "iris-3") == 1  # adopted through the state that serves iris-3
    table.end(served, succeeded=False)
    table.end(orphan, succeeded=False)
    await table.drain()


async def test_a_process_started_just_after_redis_lost_its_state_waits_out_the_grace(redis_url, redis_client):
    """Issue 20: a process that starts after Redis lost its state, and after a running process
    wrote the new epoch, takes no managed admission until the grace ends, as the running one."""
    running = make_table(redis_client, redis_url)
    await running.refresh_epoch()
    held = await running.decide(chat("s"))
    await redis_client.flushall()
    await running.refresh_epoch()  # the running process writes the new epoch, marked as after a loss
    started = make_table(redis_client, redis_url)
    await started.refresh_epoch()
    assert started.rebuilding
    outcome = await started.decide(chat("t"))
    assert isinstance(outcome, Held) and outcome.decision.provider.name == "tensorx"
    assert await wait_for(lambda: _is(live(redis_client, running), 1))  # the running lease, adopted
    for table, ended in ((running, held), (started, outcome)):
        table.end(ended, succeeded=True)
        await table.drain()


async def test_a_first_epoch_written_after_a_loss_is_marked_and_every_process_waits(redis_url, redis_client):
    """Issue 20: when a newly started process is the first to see the emptied Redis, it writes the
    epoch as a first state and admits; the first running process to see that epoch marks it as
    written after a loss, and the new process's next decision finds the change: it abandons what
    it admitted there and waits out the grace."""
    running = make_table(redis_client, redis_url)
    await running.refresh_epoch()
    held = await running.decide(chat("s"))
    await redis_client.flushall()
    started = make_table(redis_client, redis_url)
    await started.refresh_epoch()
    assert not started.rebuilding  # nothing tells it yet that Redis had a state before
    await running.refresh_epoch()
    assert running.rebuilding and running.epoch.endswith(":lost")
    outcome = await started.decide(chat("t"))
    assert started.rebuilding and started.epoch == running.epoch
    assert isinstance(outcome, Held) and outcome.decision.provider.name == "tensorx"
    assert await wait_for(lambda: _is_zero(started.pending_abandonments))
    assert await wait_for(lambda: _is(live(redis_client, running), 1))  # only the running lease
    for table, ended in ((running, held), (started, outcome)):
        table.end(ended, succeeded=True)
        await table.drain()


async def test_a_fleet_starting_on_a_new_redis_takes_no_grace(redis_url, redis_client):
    """A first epoch written by a process that knew no earlier state starts no grace."""
    tables = [make_table(redis_client, redis_url) for _ in range(2)]
    for table in tables:
        await table.refresh_epoch()
        assert not table.rebuilding
    outcomes = [await table.decide(chat(f"s{i}")) for i, table in enumerate(tables)]
    assert all(isinstance(o, Held) and o.decision.provider.name.startswith("iris") for o in outcomes)
    for table, held in zip(tables, outcomes):
        table.end(held, succeeded=True)
        await table.drain()



async def epoch_gets(redis_client, table: LeaseTable, decisions) -> Counter:
    """Run `decisions` (an async callable) under MONITOR and count the GETs of the epoch key by
    who sent them: "lua" (read inside a script) or "client" (a command of its own)."""
    marker = f"end-of-decisions-{id(table)}"
    counts: Counter = Counter()
    async with redis_client.monitor() as monitor:
        await decisions()
        await redis_client.echo(marker)
        while True:
            command = await asyncio.wait_for(monitor.next_command(), timeout=5)
            if marker in command["command"]:
                return counts
            if command["command"] == f"GET {table._epoch_key}":
                counts["lua" if command["client_type"] == "lua" else "client"] += 1


async def test_a_decision_whose_scripts_saw_the_known_epoch_sends_no_epoch_read(redis_url, redis_client, hot_path):
    """Issue 24: on a standalone Redis the admission script reads the epoch itself; a decision
    whose script saw the epoch this process knows sends no GET of its own (before: one per
    decision made one at a time)."""
    table = make_table(redis_client, redis_url, hot_path)
    await table.refresh_epoch()
    held: list = []

    async def decisions():
        for i in range(20):
            held.append(await table.decide(chat(None)))  # one script each: admit_without_pin on iris-1
            table.end(held[-1], succeeded=True)
            await table.releases_settled()  # released before the next decision: iris-1 never fills up

    counts = await epoch_gets(redis_client, table, decisions)
    assert all(isinstance(h, Held) and h.decision.provider.name == "iris-1" for h in held)
    assert counts == Counter({"lua": 20})  # one read inside each admission script, none apart
    assert not table.rebuilding
    await table.drain()


@pytest.mark.parametrize("loss", ["flushall", "new epoch"])
async def test_redis_losing_its_state_between_two_decisions_is_seen_by_the_next_one(redis_url, redis_client, hot_path, loss):
    """The next decision after Redis lost its state (a FLUSHALL, or another process having
    written a new epoch) sees it through its script's epoch, then takes today's path: the shared
    read writes or adopts the new epoch, what the decision admitted is abandoned, managed pairs
    wait out the grace (the decision goes to the unlimited tensorx) and the lease held before is
    adopted into the new epoch."""
    table = make_table(redis_client, redis_url, hot_path)
    await table.refresh_epoch()
    before = await table.decide(chat("a"))
    assert isinstance(before, Held) and before.decision.provider.name == "iris-1"
    old = table.epoch
    if loss == "flushall":
        await redis_client.flushall()
    else:
        seconds, _ = await redis_client.time()
        await redis_client.set(table._epoch_key, f"0123@{seconds * 1000}:lost")
    after = await table.decide(chat("b"))
    assert isinstance(after, Held) and after.decision.provider.name == "tensorx"
    assert table.rebuilding and table.epoch != old and table.epoch.endswith(":lost")
    assert (await redis_client.get(table._epoch_key)).decode() == table.epoch
    assert await wait_for(lambda: _is_zero(table.pending_abandonments))
    assert await wait_for(lambda: _is(live(redis_client, table), 1))  # only the lease held before, adopted
    assert await redis_client.exists(table.state.keys.pin("m", "b")) == 0
    for held in (before, after):
        table.end(held, succeeded=True)
    await table.drain()


async def test_a_decision_without_a_script_still_reads_the_epoch(redis_url, redis_client):
    """A decision that runs no script (a request without a session on the unlimited provider
    only: no lease, nothing admitted) learns the epoch by the shared read, as before."""
    table = make_table(redis_client, redis_url, providers=small_config_data(redis_url)["providers"][2:])
    await table.refresh_epoch()

    async def decision():
        table.end(await table.decide(chat(None)), succeeded=True)

    assert await epoch_gets(redis_client, table, decision) == Counter({"client": 1})
    await table.drain()
