"""Issue 29, the routing core: how the lease table settles a renewal's answer and an adoption,
over a real Redis (faults made with CLIENT PAUSE WRITE, a changed epoch, ACLs).

1. An adoption answered together with a renewal: the renewal was sent under the old epoch, the
   adoption behind it on the same pipelined connection; Redis answers the renewal LEASE_LOST and
   the adoption ADMITTED in one read. The renewal is judged by the lease's state when it was
   sent: the adoption decides, and the request keeps running (before: 3 of 8 trials cancelled a
   request whose lease Redis held live).
The suspected faults of the same review, each confirmed or ruled out: a local lease whose
adoption timed out on the client but landed (confirmed, fixed); a forward step of the Redis
host's clock (confirmed, fixed by item 0's rule; a Redis under libfaketime); an abandonment given
up after the lease timeout (ruled out: the pin it leaves is any admission's).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from extproc.config import RedisSettings
from extproc.routing.lease_table import Held
from extproc.routing.state import RoutingState, connect
from extproc.storage.pipelined import open_pipelined
from irislab.processes import free_port, start_redis
from tests.support.lease_tables import chat, live, make_table


async def until(predicate, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.005)
    return False


async def test_an_adoption_answered_with_a_renewal_keeps_the_request(redis_url, redis_client, hot_path):
    fast = {"url": redis_url, "key_prefix": "t", "probe_interval_seconds": 0.05, "instance_heartbeat_seconds": 0.05,
            "epoch_grace_seconds": 0.1}
    table = make_table(redis_client, redis_url, hot_path, lease_timeout=30, redis=fast)  # no renewal of its own meanwhile
    cancelled = 0
    for trial in range(8):
        await table.refresh_epoch()
        assert await until(lambda: not table.rebuilding, 2)  # the last trial's epoch grace
        held = await table.decide(chat(f"s{trial}"))
        assert isinstance(held, Held)
        # Redis loses its state and another instance writes the next epoch.
        seconds, micros = await redis_client.time()
        await redis_client.flushall()
        await redis_client.set(table._epoch_key, f"{os.urandom(8).hex()}@{seconds * 1000 + micros // 1000}:lost")
        await redis_client.execute_command("CLIENT", "PAUSE", 350, "WRITE")  # under the 5 s call deadline
        held.renew_at = time.monotonic()
        table._sweep()  # the renewal sweep sends this lease's renewal: it waits behind the pause
        assert held.renewing
        await table.refresh_epoch()  # the heartbeat sees the new epoch: the adoption goes behind the renewal
        assert await until(lambda: held.adopting, 1)
        assert await until(lambda: not held.renewing and not held.adopting, 5)
        await asyncio.sleep(0.05)
        cancelled += held.lost.is_set()
        assert await live(redis_client, table) == 1  # Redis holds the lease live either way
        table.end(held, succeeded=True)
        await table.releases_settled()
    assert cancelled == 0
    await table.drain()


async def test_a_local_lease_whose_adoption_timed_out_but_landed_is_released_when_its_request_ended(redis_url, redis_client):
    """Issue 29, suspected (confirmed): a local lease's adoption (the recovery's) times out on the
    client while Redis holds it behind a write pause; its request ends meanwhile; the adoption
    lands when Redis resumes. The lease is released once it lands (before: never, it counted
    for a whole lease timeout)."""
    from extproc.routing.router import Decision, Reason
    from extproc.routing.state import Lease, new_id

    hot_path = open_pipelined(RedisSettings(url=redis_url), timeout_seconds=0.2)
    table = make_table(redis_client, redis_url, hot_path, lease_timeout=30)
    await table.state.load_scripts()  # as at start: the adoption is one EVALSHA
    await table.refresh_epoch()
    table.breaker.trip(ConnectionError("outage"))
    held = table._hold(Decision(table.config.provider("iris-1"), Reason.UNPINNED, Lease("m", "iris-1", new_id(), None, None, 0), None,
                                refresh_pin_on_success=False), local=True, state=table.state)
    await redis_client.execute_command("CLIENT", "PAUSE", 1000, "WRITE")
    recovery = asyncio.create_task(table.recover())
    assert await until(lambda: held.adopting, 1)
    table.end(held, succeeded=True)  # the request ends while its adoption is on its way
    await recovery  # timed out on the client (the adoption waits in Redis): the model's scope stays open
    assert table.breaker.open_for("m")
    # Redis resumes: the adoption lands, then the release sent behind it
    assert await _wait(lambda: _is(live(redis_client, table), 0), 3)
    assert await redis_client.zscore(table.state.keys.provider_leases("m", "iris-1"), held.lease.id) is None  # released
    await table.drain()
    await hot_path.aclose()


async def test_renewals_answered_end_the_models_run_of_failures(redis_url, redis_client):
    """Review of issue 29's fixes, item 5: a model with a long stream and no decision meanwhile
    meets three isolated renewal timeouts (a write pause each), each followed by a renewal Redis
    answers. The answered renewals end the model's run of failures, so its scope stays closed
    (before: only decisions, chain lookups and the heartbeat reset it, and the third isolated
    timeout opened the scope)."""
    hot_path = open_pipelined(RedisSettings(url=redis_url), timeout_seconds=0.2)
    table = make_table(redis_client, redis_url, hot_path, lease_timeout=30)
    await table.refresh_epoch()
    held = await table.decide(chat("long-stream"))
    assert isinstance(held, Held)

    async def renewal() -> None:
        held.renew_at = time.monotonic()
        table._sweep()
        assert held.renewing
        assert await until(lambda: not held.renewing, 5)

    for _ in range(table.breaker.failures_in_a_row):
        await redis_client.execute_command("CLIENT", "PAUSE", 500, "WRITE")
        await renewal()  # times out on the client (0.2 s) behind the pause
        assert held.unconfirmed
        await redis_client.set("t:pause-over", 1)  # a write: answered once the pause is over
        await renewal()  # answered: RENEWED
        assert not held.unconfirmed
    assert table.breaker.failures["m"] == 0
    assert not table.breaker.open_for("m")
    assert not held.lost.is_set()
    table.end(held, succeeded=True)
    await table.releases_settled()
    assert await live(redis_client, table) == 0
    await table.drain()
    await hot_path.aclose()


async def test_a_local_lease_whose_adoption_timed_out_is_released_when_its_request_ends_later(redis_url, redis_client):
    """Review of issue 29's fixes, item 4: as above, but the request ends AFTER the adoption
    timed out on the client and before Redis, resuming, applies it. The lease is released at the
    request's end all the same (before: the lease, local and no longer adopting, was dropped at
    the end, and the landed adoption counted for a whole lease timeout)."""
    from extproc.routing.router import Decision, Reason
    from extproc.routing.state import Lease, new_id

    hot_path = open_pipelined(RedisSettings(url=redis_url), timeout_seconds=0.2)
    table = make_table(redis_client, redis_url, hot_path, lease_timeout=30)
    await table.state.load_scripts()
    await table.refresh_epoch()
    table.breaker.trip(ConnectionError("outage"))
    held = table._hold(Decision(table.config.provider("iris-1"), Reason.UNPINNED, Lease("m", "iris-1", new_id(), None, None, 0), None,
                                refresh_pin_on_success=False), local=True, state=table.state)
    await redis_client.execute_command("CLIENT", "PAUSE", 1000, "WRITE")
    await table.recover()  # the adoption times out on the client (0.2 s) and waits in Redis
    assert held.local and not held.adopting
    assert table.breaker.open_for("m")
    table.end(held, succeeded=True)  # the request ends now, before the pause is over
    await redis_client.set("t:pause-over", 1)  # a write: answered once the pause is over
    assert await _wait(lambda: _is(live(redis_client, table), 0), 3)
    await table.releases_settled()
    assert await redis_client.zscore(table.state.keys.provider_leases("m", "iris-1"), held.lease.id) is None  # released
    await table.drain()
    await hot_path.aclose()


async def _is(awaitable, value) -> bool:
    return (await awaitable) == value


async def _wait(predicate, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if await predicate():
            return True
        await asyncio.sleep(0.01)
    return False


def faketime_env(offset_file) -> dict[str, str]:
    """The environment that runs a process under libfaketime (the library the `libfaketime`
    package bundles), its wall clock `offset_file`'s offset ("+60": 60 s ahead), read at every
    call; its monotonic clock stays real. Skips the test when the package is missing."""
    libfaketime = pytest.importorskip("libfaketime")
    library = Path(libfaketime.__file__).parent / "vendor" / "libfaketime" / "src" / "libfaketime.so.1"
    if not library.exists():
        pytest.skip(f"libfaketime ships no {library}")
    return {**os.environ, "LD_PRELOAD": str(library), "FAKETIME_TIMESTAMP_FILE": str(offset_file),
            "FAKETIME_NO_CACHE": "1", "DONT_FAKE_MONOTONIC": "1"}


async def test_a_forward_step_of_the_redis_clock_keeps_running_requests_within_the_limits(tmp_path):
    """Issue 29, suspected (confirmed, and decided): the routing scripts take Redis's TIME, so a
    forward step of the Redis host's clock larger than a lease's remaining time expires every
    lease at once, under the same epoch. Each comes back at its next renewal through an adoption
    within the pair's limits (none was taken here), so the running requests keep running (before:
    every one was cancelled as lost)."""
    offset = tmp_path / "offset"
    offset.write_text("+0\n")
    server = start_redis(tmp_path, env=faketime_env(offset))
    url = f"redis://127.0.0.1:{server.port}/0"
    client = connect(url, timeout_seconds=5)
    try:
        table = make_table(client, url, None, lease_timeout=3)
        await table.refresh_epoch()
        held = [await table.decide(chat(f"s{i}")) for i in range(3)]
        assert all(isinstance(h, Held) and h.decision.provider.name in ("iris-1", "iris-2") for h in held)
        before, _ = await client.time()
        offset.write_text("+60\n")  # the host's clock steps a minute ahead: every lease expired in Redis
        after, _ = await client.time()
        assert after - before >= 60
        await asyncio.sleep(2.5)  # every lease's next renewal has come (every third of 3 s)
        assert not any(h.lost.is_set() for h in held)
        assert await live(client, table, "iris-1") + await live(client, table, "iris-2") == 3
        for h in held:
            table.end(h, succeeded=True)
        await table.drain()
        assert await live(client, table, "iris-1") + await live(client, table, "iris-2") == 0
    finally:
        await client.aclose()
        server.stop()


async def test_an_abandonment_given_up_leaves_only_the_pin_any_admission_makes(redis_url, redis_client):
    """Issue 29, suspected (ruled out as a leak, kept on purpose): an abandonment that cannot reach
    Redis for a lease timeout is given up, and the pin its decision made stays. That pin is what
    every admission of a new session makes (the spec's create_pin: an inactivity deadline, not
    refreshed unless a request succeeds): it ends by that deadline like the pin of a session whose
    only request failed, and its session's next request is admitted on it. Abandoning later could
    end a pin the session has used since (its later admissions share the pin's id), so it is not
    retried past the lease timeout. The lease itself expires by itself within the lease timeout."""
    from extproc.routing.router import Ids

    table = make_table(redis_client, redis_url, None, lease_timeout=0.3, pin_inactivity_timeout_seconds=1.5)
    table.retry_seconds = 0.05
    await table.refresh_epoch()
    held = await table.decide(chat("s"))
    assert isinstance(held, Held) and held.lease.pin_id is not None
    table._forget(held)  # its answer never arrived: the table holds nothing, the abandonment goes
    dead = RoutingState(connect(f"redis://127.0.0.1:{free_port()}/0", timeout_seconds=0.05), table.config)
    table._abandon(chat("s"), Ids(held.lease.id, held.lease.pin_id), dead)  # as if Redis were unreachable
    assert await _wait(lambda: _true(table.pending_abandonments == 0), 5)  # given up after the lease timeout
    pin = await redis_client.hgetall(table.state.keys.pin("m", "s"))
    assert pin[b"id"].decode() == held.lease.pin_id  # the pin stays: its deadline is its creation's
    assert int(pin[b"expiry"]) == int(pin[b"deadline"])  # no lease holds it: the lease expired by itself
    assert await _wait(lambda: _is(live(redis_client, table, held.decision.provider.name), 0), 1)  # it expires by itself
    again = await table.decide(chat("s"))  # the session's next request is admitted on it
    assert isinstance(again, Held) and again.lease.pin_id == held.lease.pin_id
    table.end(again, succeeded=False)  # a failed request does not refresh it either
    await table.releases_settled()
    seconds, micros = await redis_client.time()
    await asyncio.sleep(max(0.0, (int(pin[b"deadline"]) - (seconds * 1000 + micros // 1000)) / 1000) + 0.1)
    seconds, micros = await redis_client.time()
    pins = table.state.keys.provider_pins("m", held.decision.provider.name)
    assert await redis_client.zcount(pins, f"({seconds * 1000 + micros // 1000}", "+inf") == 0  # ended by its inactivity deadline
    await table.drain()


async def _true(value: bool) -> bool:
    return value
