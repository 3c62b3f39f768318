"""The admission queue end to end (issue 23, docs/queue.md): two proxies (Envoy + ext_proc each)
share one Redis and the simulated providers. What providers observed (their in-flight peaks, the
order requests reached them) and what Redis holds afterwards (no ticket, no lease) are asserted;
counts, never durations.

The own provider's requests take about 140 ms (20 ms to the first token, 20 ms per token, 6
tokens); `max_wait_ms` is 2800 ms, the most Envoy's ext_proc message timeout (5 s) leaves beside
the decision timeout (2 s): many request lengths."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import aiohttp
import pytest
import redis

from extproc.openai_api.request import keyed_hash
from irislab.local_gateway import LocalGateway, ProviderSimulation
from tests.support.gateway import MODEL, clear_routing_state, live_leases, provider_stats, wait_for_no_leases, wait_until

SERIAL = "serial"  # one slot on iris-1: the order requests reach it is the order they were admitted in
OFF = "no-queue"  # the same limits as MODEL, the queue off: the control
PREFIX = "q"
MAX_WAIT_MS = 2800
TOKENS = 6
HOLD = 1000  # a holder's stream: 20 s, ended by the client once the queue is full, not by its length


def queue_config() -> dict:
    limits = {"max_pinned_sessions": 1000, "max_global_in_flight_request_slots": 2,
              "global_in_flight_request_slots_reserved_for_pinned_sessions": 0, "max_per_session_in_flight_request_slots": 1}
    return {
        "lease_timeout_seconds": 30,
        "redis": {"key_prefix": PREFIX},
        "session": {"trusted_identity_headers": ["x-user-id"]},
        "server": {"expose_routing_headers": True},
        "routing": {"queue": {
            "classes": [{"name": "interactive", "max_wait_ms": MAX_WAIT_MS, "max_wait_ms_by_model": {OFF: 0}},
                        {"name": "batch", "max_wait_ms": MAX_WAIT_MS, "max_wait_ms_by_model": {OFF: 0}, "use_reserved_slots": False}],
            "ticket_lease_ms": 900, "poll_ms": 300,
        }},
        "providers": [
            {"name": "iris-1", "kind": "managed", "cluster": "iris-1",
             "models": {MODEL: {"features": ["chat"], "limits": limits}, OFF: {"features": ["chat"], "limits": limits},
                        SERIAL: {"features": ["chat"], "limits": {**limits, "max_global_in_flight_request_slots": 1}}}},
            {"name": "tensorx", "kind": "unlimited", "cluster": "tensorx",
             "models": {MODEL: {"features": ["chat"]}, OFF: {"features": ["chat"]}, SERIAL: {"features": ["chat"]}}},
        ],
    }


def start(tmp_path) -> LocalGateway:
    sim = ProviderSimulation(ttft_ms=20, per_token_ms=20)
    gateway = LocalGateway(config_data=queue_config(), instances=2, simulations={"iris-1": sim, "tensorx": sim}, work_dir=tmp_path)
    gateway.__enter__()
    return gateway


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    gateway = start(tmp_path_factory.mktemp("queue"))
    yield gateway
    gateway.stop()


@pytest.fixture
def fresh(gateway):
    client = redis.Redis.from_url(gateway.redis_url)
    clear_routing_state(client)
    _reset_stats(gateway)
    yield gateway
    client.close()


class Client:
    """Chat requests through the gateway's instances; each records status, provider, reason."""

    def __init__(self, gateway: LocalGateway):
        self.urls = [i.url for i in gateway.running]
        self.http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Client:
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30), connector=aiohttp.TCPConnector(limit=200))
        return self

    async def __aexit__(self, *exc) -> None:
        await self.http.close()

    async def send(self, user: str, instance: int = 0, model: str = MODEL, tokens: int = TOKENS, session: str | None = None,
                   stream: bool = False) -> dict:
        body = {"model": model, "max_tokens": tokens, "stream": stream,
                "messages": [{"role": "user", "content": f"conversation {session or user} asks something"}]}
        record = {"user": user, "instance": instance, "sent": time.monotonic()}
        try:
            async with self.http.post(f"{self.urls[instance]}/v1/chat/completions", json=body, headers={"x-user-id": user}) as response:
                record["headers_at"] = time.monotonic()
                record["status"] = response.status
                record["provider"] = response.headers.get("x-iris-provider")
                record["reason"] = response.headers.get("x-iris-route-reason")
                await response.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            record["status"], record["error"] = None, type(exc).__name__
        record["done"] = time.monotonic()
        return record


def tickets(gateway: LocalGateway, model: str = MODEL) -> int:
    return redis.Redis.from_url(gateway.redis_url).zcard(f"{{{PREFIX}:{model}}}:tickets")


def queued_users(gateway: LocalGateway, users: list[str], model: str) -> list[str]:
    """The users of the tickets in iris-1's queue of `model`, in the queue's order, read from Redis
    (a ticket's tenant is the first 16 characters of its identity's keyed hash:
    extproc.openai_api.sessions.SessionKeys.tenant)."""
    client = redis.Redis.from_url(gateway.redis_url)
    by_tenant = {keyed_hash(gateway.secret.encode(), b"identity", f"trusted_header:{u}".encode())[:16]: u for u in users}
    order = []
    for ticket in client.zrange(f"{{{PREFIX}:{model}}}:queue:iris-1", 0, -1):
        record = client.hget(f"{{{PREFIX}:{model}}}:queue-state", b"t:" + ticket).decode()
        order.append(by_tenant[record.rsplit("|", 1)[1]])
    return order


def in_flight(gateway: LocalGateway, model: str) -> int:
    return provider_stats(gateway, "iris-1")["in_flight_by_model"].get(model, 0)


def peak(gateway: LocalGateway, model: str) -> int:
    return provider_stats(gateway, "iris-1")["max_in_flight_by_model"].get(model, 0)


def _reset_stats(gateway: LocalGateway) -> None:
    import httpx

    for name in ("iris-1", "tensorx"):
        httpx.post(f"{gateway.provider_url(name)}/stats/reset", timeout=5)


def nothing_left(gateway: LocalGateway, models=(MODEL, SERIAL, OFF)) -> bool:
    """No live lease, and no ticket of any model in Redis."""
    client = redis.Redis.from_url(gateway.redis_url)
    return wait_for_no_leases(client, within_seconds=5.0) == 0 and wait_until(
        lambda: sum(client.zcard(f"{{{PREFIX}:{m}}}:tickets") for m in models) == 0, within_seconds=5.0) is True


async def hang_up(request: asyncio.Task) -> None:
    """The client of `request` (a `Client.send`) closes its connection now: its lease is released."""
    request.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await request


async def _until(predicate, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if await asyncio.to_thread(predicate):
            return True
        await asyncio.sleep(0.02)
    return False


def test_a_burst_above_own_capacity_waits_for_own_slots(fresh):
    """Eight requests at once over two proxies, two own slots: each waits for a slot a request
    before it frees, none goes to the third party, the own provider never holds more than its
    limit. The same burst on a model whose queue is off sends most of it to the third party."""
    gateway = fresh

    async def burst(model: str) -> list[dict]:
        async with Client(gateway) as client:
            return await asyncio.gather(*(client.send(f"{model}-u{i}", instance=i % 2, model=model) for i in range(8)))

    queued = asyncio.run(burst(MODEL))
    assert [r["status"] for r in queued] == [200] * 8
    assert [r["provider"] for r in queued] == ["iris-1"] * 8, [(r["provider"], r["reason"]) for r in queued]
    assert peak(gateway, MODEL) <= 2
    control = asyncio.run(burst(OFF))
    assert sum(r["provider"] == "tensorx" for r in control) >= 4, [r["provider"] for r in control]
    assert peak(gateway, OFF) <= 2
    assert nothing_left(gateway)


def test_across_two_proxies_the_slot_goes_in_the_queues_order(fresh):
    """One own slot, held by a long stream; six requests join the queue one after the other,
    alternately through each proxy. The queue in Redis holds them in that order, and that is the
    order in which they reach the provider once the slot frees (the stream's client hangs up):
    no newcomer of either proxy passes a waiter."""
    gateway = fresh
    users = [f"w{i}" for i in range(6)]

    async def scenario() -> tuple[list[str], list[dict]]:
        async with Client(gateway) as client:
            holder = asyncio.create_task(client.send("holder", model=SERIAL, tokens=HOLD, stream=True))
            assert await _until(lambda: in_flight(gateway, SERIAL) == 1)
            waiters = []
            for i, user in enumerate(users):
                waiters.append(asyncio.create_task(client.send(user, instance=i % 2, model=SERIAL)))
                assert await _until(lambda: tickets(gateway, SERIAL) == i + 1)
            order = await asyncio.to_thread(queued_users, gateway, users, SERIAL)
            await hang_up(holder)
            return order, await asyncio.gather(*waiters)

    order, records = asyncio.run(scenario())
    assert order == users
    assert [(r["status"], r["provider"]) for r in records] == [(200, "iris-1")] * 6
    seen = [h.get("x-user-id") for h in provider_stats(gateway, "iris-1")["last_request_headers"]]
    assert [u for u in seen if u in users] == users
    assert peak(gateway, SERIAL) == 1
    assert nothing_left(gateway)


def test_two_tenants_with_demand_ten_to_one_share_the_slots_fairly(fresh):
    """Tenant a keeps twenty requests going, tenant b two, over both proxies and one pinned
    session per client, against two own slots: while both wait, each gets at least 40 % of the
    own provider's service (first come, first served would give b about 2 in 22)."""
    gateway = fresh
    served: list[dict] = []
    enough = 48

    async def scenario() -> None:
        async with Client(gateway) as client:
            stop = asyncio.Event()

            async def worker(user: str, index: int) -> None:
                turn = 0
                while not stop.is_set():
                    record = await client.send(user, instance=index % 2, session=f"{user}-{index}")
                    turn += 1
                    if record.get("provider") == "iris-1":
                        served.append(record)
                        if len(served) >= enough:
                            stop.set()

            workers = [worker("tenant-a", i) for i in range(20)] + [worker("tenant-b", i) for i in range(2)]
            await asyncio.gather(*workers)

    asyncio.run(scenario())
    window = sorted(served, key=lambda r: r["headers_at"])[8:enough]  # once both tenants wait
    shares = {user: sum(r["user"] == user for r in window) / len(window) for user in ("tenant-a", "tenant-b")}
    assert min(shares.values()) >= 0.4, shares
    assert peak(gateway, MODEL) <= 2
    assert nothing_left(gateway)


def test_a_proxy_killed_with_queued_requests_leaves_no_ghost_ahead_of_live_waiters(tmp_path):
    """Two long streams hold both own slots; six requests wait, three on each proxy, alternately.
    One proxy's ext_proc server is SIGKILLed and the streams' clients hang up: the dead proxy's
    tickets stop counting when their lease ends (900 ms), so every waiter of the other proxy is
    served by the own provider, within its wait, and Redis keeps no ticket and no lease."""
    gateway = start(tmp_path)
    try:
        async def scenario() -> list[dict]:
            async with Client(gateway) as client:
                holders = [asyncio.create_task(client.send(f"holder{i}", instance=1, tokens=HOLD, stream=True)) for i in range(2)]
                assert await _until(lambda: in_flight(gateway, MODEL) == 2)
                waiters = []
                for i in range(6):
                    waiters.append(asyncio.create_task(client.send(f"w{i}", instance=i % 2)))
                    assert await _until(lambda: tickets(gateway) == i + 1)
                gateway.running[0].extproc.kill()
                for holder in holders:
                    await hang_up(holder)
                return await asyncio.gather(*waiters)

        records = asyncio.run(scenario())
        survivors = [r for r in records if r["instance"] == 1]
        assert [(r["status"], r["provider"]) for r in survivors] == [(200, "iris-1")] * 3
        victims = [r for r in records if r["instance"] == 0]
        assert all(r["status"] != 200 for r in victims)  # answered with an error: its ext_proc is gone
        assert peak(gateway, MODEL) <= 2
        assert nothing_left(gateway)
    finally:
        gateway.stop()


def test_a_redis_restart_with_a_full_queue_answers_every_waiter_and_loses_no_slot(tmp_path):
    """Two long streams hold both own slots and six requests wait, over both proxies, when Redis
    restarts empty. Every waiter is answered (the outage policy sends it to the third party),
    the streams finish, Redis keeps no ticket and no lease, and once shared routing is back both
    own slots serve again."""
    gateway = start(tmp_path)
    try:
        async def scenario() -> tuple[list[dict], list[dict]]:
            async with Client(gateway) as client:
                holders = [asyncio.create_task(client.send(f"holder{i}", instance=i % 2, tokens=200, stream=True)) for i in range(2)]
                assert await _until(lambda: in_flight(gateway, MODEL) == 2)
                waiters = []
                for i in range(6):
                    waiters.append(asyncio.create_task(client.send(f"w{i}", instance=i % 2)))
                    assert await _until(lambda: tickets(gateway) == i + 1)
                await asyncio.to_thread(gateway.stop_redis)
                await asyncio.to_thread(gateway.start_redis_again)
                return await asyncio.gather(*holders), await asyncio.gather(*waiters)

        holders, waiters = asyncio.run(scenario())
        assert [r["status"] for r in holders] == [200, 200]
        assert [r["status"] for r in waiters] == [200] * 6, [(r["status"], r.get("error")) for r in waiters]
        assert peak(gateway, MODEL) <= 2
        assert nothing_left(gateway)

        async def both_slots() -> list[dict]:
            async with Client(gateway) as client:
                return await asyncio.gather(*(client.send(f"after{i}", instance=i % 2, tokens=20) for i in range(2)))

        # After the epoch grace the own provider admits again, both slots, without waiting for anything.
        assert wait_until(lambda: all(r["provider"] == "iris-1" for r in asyncio.run(both_slots())), within_seconds=15, interval_seconds=0.5)
        assert nothing_left(gateway)
    finally:
        gateway.stop()


def test_a_pinned_request_of_a_class_that_does_not_wait_is_offloaded_while_a_wake_up_is_late(tmp_path):
    """Issue 29 item 2, end to end. Session S (the batch class: the defaults, it never waits and
    never uses reserved slots) is pinned to iris-1; two long streams hold iris-1's two slots; an
    interactive request waits in its queue on the second proxy, whose ext_proc then freezes
    (SIGSTOP: its wake-up comes late). One stream's client hangs up: a slot is free and the
    waiter's ticket, still live, heads the queue. S's next request, on the first proxy, is
    offloaded to the third party with its pin kept (the spec's execute_pinned_request), not
    answered 503 "routing did not settle" as before; its next turn is back on its pin. iris-1
    never holds more than its two slots and Redis keeps no ticket and no lease."""
    config = queue_config()
    config["routing"]["queue"].update({
        "classes": [{"name": "interactive", "max_wait_ms": MAX_WAIT_MS}, {"name": "batch", "use_reserved_slots": False}],
        "identity_classes": {"trusted_header:batch-user": "batch"},
        # A ticket outlives the freeze's few seconds: the waiter still heads the queue when S asks.
        "ticket_lease_ms": 9000, "poll_ms": 3000,
    })
    sim = ProviderSimulation(ttft_ms=20, per_token_ms=20)
    gateway = LocalGateway(config_data=config, instances=2, simulations={"iris-1": sim, "tensorx": sim}, work_dir=tmp_path)
    gateway.__enter__()
    frozen = gateway.running[1].extproc.popen.pid
    try:
        async def scenario() -> tuple[dict, dict, dict]:
            async with Client(gateway) as client:
                first = await client.send("batch-user", session="S")
                assert (first["status"], first["provider"], first["reason"]) == (200, "iris-1", "new_pin"), first
                holders = [asyncio.create_task(client.send(f"holder{i}", tokens=HOLD, stream=True)) for i in range(2)]
                assert await _until(lambda: in_flight(gateway, MODEL) == 2)
                waiter = asyncio.create_task(client.send("waiter", instance=1))
                assert await _until(lambda: tickets(gateway) == 1)
                os.kill(frozen, signal.SIGSTOP)
                try:
                    await hang_up(holders[0])
                    assert await _until(lambda: _live_leases(gateway) == 1)
                    assert tickets(gateway) == 1  # the waiter has not taken the free slot
                    pinned = await client.send("batch-user", session="S")
                    assert tickets(gateway) == 1
                finally:
                    os.kill(frozen, signal.SIGCONT)
                await waiter
                await hang_up(holders[1])
                again = await client.send("batch-user", session="S")
                return first, pinned, again

        first, pinned, again = asyncio.run(scenario())
        assert (pinned["status"], pinned["provider"], pinned["reason"]) == (200, "tensorx", "offloaded"), pinned
        assert (again["status"], again["provider"], again["reason"]) == (200, "iris-1", "pinned"), again
        assert peak(gateway, MODEL) <= 2
        assert nothing_left(gateway)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(frozen, signal.SIGCONT)
        gateway.stop()


def _live_leases(gateway: LocalGateway) -> int:
    return live_leases(redis.Redis.from_url(gateway.redis_url))
