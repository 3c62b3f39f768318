"""The admission queue's gate (lua/queue.lua) in the routing scripts, against a real Redis with
explicit times (ms): no barging, strict priority, fairness between tenants, no ghost tickets,
depth bounds, reserved slots, wake-ups, and nothing left behind (docs/queue.md)."""

from __future__ import annotations

import asyncio

import pytest

from extproc.config import parse_config
from extproc.routing.state import QueueArgs, Result, RoutingState
from tests.support.configs import small_config_data

T0 = 1_000_000_000
TICKET_MS = 3000
INTERACTIVE, BATCH = 0, 1
QUEUE = {
    "classes": [
        {"name": "interactive", "max_wait_ms": 1000, "max_depth": 3},
        {"name": "batch", "max_wait_ms": 1000, "use_reserved_slots": False},
    ],
    "ticket_lease_ms": TICKET_MS,
    "poll_ms": 500,
}


@pytest.fixture
def qstate(redis_client, redis_url, hot_path) -> RoutingState:
    return RoutingState(redis_client, parse_config(small_config_data(redis_url, routing={"queue": QUEUE})), hot_path=hot_path)


def args(ticket: str = "", mode: str = "join", tenant: str = "a", rank: int = INTERACTIVE, reserved: bool | None = None) -> QueueArgs:
    may_reserve = rank == INTERACTIVE if reserved is None else reserved
    return QueueArgs(rank, may_reserve, tenant, ticket, mode, 3 if rank == INTERACTIVE else 256)


async def temporary(state, lease: str, now: int, queue: QueueArgs | None = None, provider: str = "iris-1"):
    admission = await state.try_admit_request_without_pin(provider, "m", lease_id=lease, now_ms=now, queue=queue)
    return admission.result


async def fill_unreserved(state, now: int | None = T0) -> list:
    """iris-1: 4 slots, 1 reserved: three temporary leases leave only the reserved slot."""
    held = []
    for i in range(3):
        admission = await state.try_admit_request_without_pin("iris-1", "m", lease_id=f"L{i}", now_ms=now)
        assert admission.result is Result.ADMITTED
        held.append(admission.lease)
    return held


async def queue_order(redis, state, provider: str = "iris-1", reserved: bool = False) -> list[str]:
    key = state.keys.reserved_queue("m", provider) if reserved else state.keys.queue("m", provider)
    return [m.decode() for m in await redis.zrange(key, 0, -1)]


async def ticket_records(redis, state) -> list[bytes]:
    return [f for f in await redis.hkeys(state.keys.queue_state("m")) if f.startswith(b"t:")]


async def test_a_freed_slot_goes_to_the_head_not_to_a_newcomer(qstate):
    leases = await fill_unreserved(qstate)
    assert await temporary(qstate, "T1", T0, args("T1")) is Result.QUEUED
    await qstate.release_request_lease(leases[0], refresh_pin=False, now_ms=T0 + 10)
    # A newcomer of the same class arriving as the slot frees finds the waiter ahead of it.
    assert await temporary(qstate, "N", T0 + 11, args("N", mode="none")) is Result.UNRESERVED_IN_FLIGHT_REQUEST_LIMIT_REACHED
    assert await temporary(qstate, "N", T0 + 11, args("N")) is Result.QUEUED
    assert await temporary(qstate, "N", T0 + 12, args("N", mode="wait")) is Result.QUEUED
    assert await temporary(qstate, "T1", T0 + 12, args("T1", mode="wait")) is Result.ADMITTED
    assert await queue_order(qstate.redis, qstate) == ["N"]


async def test_a_newcomer_without_a_ticket_is_admitted_when_nobody_waits(qstate, redis_client):
    assert await temporary(qstate, "N", T0, args("N", mode="none")) is Result.ADMITTED
    assert await temporary(qstate, "J", T0, args("J")) is Result.ADMITTED
    assert await redis_client.exists(qstate.keys.tickets("m"), qstate.keys.queue("m", "iris-1")) == 0


async def test_strict_priority_between_classes(qstate):
    leases = await fill_unreserved(qstate)
    assert await temporary(qstate, "B1", T0, args("B1", rank=BATCH)) is Result.QUEUED
    assert await temporary(qstate, "I1", T0 + 1, args("I1")) is Result.QUEUED
    assert await queue_order(qstate.redis, qstate) == ["I1", "B1"]
    await qstate.release_request_lease(leases[0], refresh_pin=False, now_ms=T0 + 10)
    assert await temporary(qstate, "B1", T0 + 11, args("B1", mode="wait", rank=BATCH)) is Result.QUEUED
    assert await temporary(qstate, "I1", T0 + 11, args("I1", mode="wait")) is Result.ADMITTED


async def test_a_higher_class_newcomer_passes_lower_class_waiters(qstate):
    leases = await fill_unreserved(qstate)
    assert await temporary(qstate, "B1", T0, args("B1", rank=BATCH)) is Result.QUEUED
    await qstate.release_request_lease(leases[0], refresh_pin=False, now_ms=T0 + 10)
    assert await temporary(qstate, "I", T0 + 11, args("I", mode="none")) is Result.ADMITTED
    assert await queue_order(qstate.redis, qstate) == ["B1"]


async def test_tenants_share_the_queue_fairly(qstate):
    await fill_unreserved(qstate)
    for i in range(4):
        assert await temporary(qstate, f"a{i}", T0 + i, args(f"a{i}", tenant="a", rank=BATCH)) is Result.QUEUED
    for i in range(2):
        assert await temporary(qstate, f"b{i}", T0 + 10 + i, args(f"b{i}", tenant="b", rank=BATCH)) is Result.QUEUED
    # Start-time fair queueing: b's first ticket is served second, not fifth.
    assert await queue_order(qstate.redis, qstate) == ["a0", "b0", "a1", "b1", "a2", "a3"]


async def test_a_tenant_served_just_now_goes_behind_one_that_waits(qstate):
    leases = await fill_unreserved(qstate)
    assert await temporary(qstate, "a0", T0, args("a0", tenant="a", rank=BATCH)) is Result.QUEUED
    assert await temporary(qstate, "a1", T0, args("a1", tenant="a", rank=BATCH)) is Result.QUEUED
    assert await temporary(qstate, "b0", T0, args("b0", tenant="b", rank=BATCH)) is Result.QUEUED
    await qstate.release_request_lease(leases[0], refresh_pin=False, now_ms=T0 + 10)
    assert await temporary(qstate, "a0", T0 + 11, args("a0", mode="wait", tenant="a", rank=BATCH)) is Result.ADMITTED
    # b, now at the head, arrived before a's next ticket: a's next one goes behind b0 and a1.
    assert await temporary(qstate, "a2", T0 + 12, args("a2", tenant="a", rank=BATCH)) is Result.QUEUED
    assert await queue_order(qstate.redis, qstate) == ["b0", "a1", "a2"]


async def test_an_expired_ticket_never_stands_ahead_of_a_live_one(qstate, redis_client):
    leases = await fill_unreserved(qstate)
    assert await temporary(qstate, "ghost", T0, args("ghost")) is Result.QUEUED
    assert await temporary(qstate, "live", T0 + 1000, args("live")) is Result.QUEUED
    assert await temporary(qstate, "live", T0 + 2500, args("live", mode="wait")) is Result.QUEUED  # renews it
    await qstate.release_request_lease(leases[0], refresh_pin=False, now_ms=T0 + TICKET_MS + 500)
    assert await temporary(qstate, "live", T0 + TICKET_MS + 501, args("live", mode="wait")) is Result.ADMITTED
    assert await temporary(qstate, "ghost", T0 + TICKET_MS + 502, args("ghost", mode="wait")) is Result.TICKET_LOST
    assert await redis_client.zcard(qstate.keys.tickets("m")) == 0
    assert await ticket_records(redis_client, qstate) == []


async def test_the_depth_of_a_class_is_bounded(qstate):
    await fill_unreserved(qstate)
    for i in range(3):
        assert await temporary(qstate, f"t{i}", T0, args(f"t{i}", tenant=f"x{i}")) is Result.QUEUED
    assert await temporary(qstate, "t3", T0, args("t3", tenant="x3")) is Result.UNRESERVED_IN_FLIGHT_REQUEST_LIMIT_REACHED
    assert await temporary(qstate, "b", T0, args("b", rank=BATCH)) is Result.QUEUED  # another class, another bound


async def test_a_reserved_slot_goes_to_the_first_pinned_waiter(qstate, redis_client):
    # iris-1: 4 slots, 1 reserved. Sessions s and s2 pinned, one temporary lease, then s takes the
    # reserved slot on its pin: full.
    for session, lease in (("s", "P0"), ("s2", "Q0")):
        assert (await qstate.try_admit_unpinned_session_request("iris-1", "m", session, lease_id=lease, now_ms=T0)).result is Result.ADMITTED
    temporary_lease = (await qstate.try_admit_request_without_pin("iris-1", "m", lease_id="L0", now_ms=T0)).lease
    assert (await qstate.try_admit_pinned_session_request("m", "s", lease_id="P1", now_ms=T0)).result is Result.ADMITTED
    # An unpinned ticket heads the queue; a pinned waiter queues behind it.
    assert await temporary(qstate, "U", T0 + 1, args("U")) is Result.QUEUED
    on_pin = await qstate.try_admit_pinned_session_request("m", "s2", lease_id="Q1", now_ms=T0 + 2, queue=args("Q1", tenant="q"))
    assert on_pin.result is Result.QUEUED
    assert await queue_order(redis_client, qstate) == ["U", "Q1"]
    assert await queue_order(redis_client, qstate, reserved=True) == ["Q1"]
    # One slot frees: only the reserved one is free (3 of 4 in flight), which U may not use.
    await qstate.release_request_lease(temporary_lease, refresh_pin=False, now_ms=T0 + 10)
    assert await temporary(qstate, "U", T0 + 11, args("U", mode="wait")) is Result.QUEUED
    on_pin = await qstate.try_admit_pinned_session_request(
        "m", "s2", lease_id="Q1", now_ms=T0 + 12, queue=args("Q1", mode="wait", tenant="q"))
    assert on_pin.result is Result.ADMITTED
    assert await queue_order(redis_client, qstate) == ["U"]


async def test_batch_never_uses_the_reserved_slots(qstate):
    pinned = await qstate.try_admit_unpinned_session_request("iris-1", "m", "s", lease_id="P0", now_ms=T0)
    assert pinned.result is Result.ADMITTED
    for i in range(2):
        assert (await qstate.try_admit_request_without_pin("iris-1", "m", lease_id=f"L{i}", now_ms=T0)).result is Result.ADMITTED
    batch = args("P1", mode="none", rank=BATCH)
    refused = await qstate.try_admit_pinned_session_request("m", "s", lease_id="P1", now_ms=T0 + 1, queue=batch)
    assert refused.result is Result.GLOBAL_IN_FLIGHT_REQUEST_LIMIT_REACHED
    interactive = await qstate.try_admit_pinned_session_request("m", "s", lease_id="P2", now_ms=T0 + 1, queue=args("P2", mode="none"))
    assert interactive.result is Result.ADMITTED


async def test_a_pin_limit_at_the_head_leaves_the_queue_blocking_nobody(qstate, redis_client):
    # iris-1: 2 temporary leases and a pinned session fill its 3 unreserved slots; pins 1 of 2.
    temporaries = [(await qstate.try_admit_request_without_pin("iris-1", "m", lease_id=f"L{i}", now_ms=T0)).lease for i in range(2)]
    assert (await qstate.try_admit_unpinned_session_request("iris-1", "m", "s1", lease_id="S1", now_ms=T0)).result is Result.ADMITTED
    new = await qstate.try_admit_unpinned_session_request("iris-1", "m", "s2", lease_id="S2", now_ms=T0 + 1, queue=args("S2"))
    assert new.result is Result.QUEUED
    assert await temporary(qstate, "T", T0 + 2, args("T", tenant="t")) is Result.QUEUED
    await redis_client.zadd(qstate.keys.provider_pins("m", "iris-1"), {"another-pin": T0 + 10**6})  # pins now 2 of 2
    await qstate.release_request_lease(temporaries[0], refresh_pin=False, now_ms=T0 + 10)
    again = await qstate.try_admit_unpinned_session_request("iris-1", "m", "s2", lease_id="S2", now_ms=T0 + 11, queue=args("S2", "wait"))
    assert again.result is Result.PIN_LIMIT_REACHED
    assert await queue_order(redis_client, qstate) == ["T"]
    assert await temporary(qstate, "T", T0 + 12, args("T", mode="wait", tenant="t")) is Result.ADMITTED


async def test_release_abandon_and_leave_publish_and_remove_tickets(qstate, redis_client):
    pubsub = redis_client.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe(qstate.keys.queue_wake("m"))
    try:
        leases = await fill_unreserved(qstate)
        for ticket in ("T1", "T2", "T3"):
            assert await temporary(qstate, ticket, T0, args(ticket, tenant=ticket)) is Result.QUEUED
        await qstate.release_request_lease(leases[0], refresh_pin=False, now_ms=T0 + 10)
        assert await next_message(pubsub) == "iris-1 T1 -"
        await qstate.abandon_request("m", None, "T1", "unused-pin", now_ms=T0 + 11)  # a client hung up while queued
        assert await next_message(pubsub) == "iris-1 T2 -"
        assert await queue_order(redis_client, qstate) == ["T2", "T3"]
        left = await qstate.leave_queue("m", args("T3", mode="none"), now_ms=T0 + 12)
        assert left.result is Result.RELEASED
        assert await queue_order(redis_client, qstate) == ["T2"]
        assert (await qstate.leave_queue("m", args("T3", mode="none"), now_ms=T0 + 13)).result is Result.NOT_FOUND
        assert await temporary(qstate, "T2", T0 + 14, args("T2", mode="wait")) is Result.ADMITTED
        assert await redis_client.zcard(qstate.keys.tickets("m")) == 0
        assert await ticket_records(redis_client, qstate) == []
        assert await redis_client.exists(qstate.keys.queue("m", "iris-1"), qstate.keys.reserved_queue("m", "iris-1")) == 0
    finally:
        await pubsub.aclose()


async def next_message(pubsub) -> str:
    for _ in range(100):
        message = await pubsub.get_message(timeout=0.05)
        if message is not None:
            return message["data"].decode()
    raise AssertionError("no wake-up published")


async def test_with_the_queue_off_nothing_of_it_is_written(state, redis_client):
    assert not state.queue_enabled("m")
    await fill_unreserved(state)
    refused = await state.try_admit_request_without_pin("iris-1", "m", lease_id="x", now_ms=T0)
    assert refused.result is Result.UNRESERVED_IN_FLIGHT_REQUEST_LIMIT_REACHED
    assert await redis_client.keys("*queue*") == [] and await redis_client.keys("*tickets*") == []


async def test_concurrent_waiters_never_exceed_the_limit(qstate, redis_client):
    """Many tickets attempting at once, over Redis time: every admission is within the limit and
    the queue's head is the one admitted each time."""
    leases = await fill_unreserved(qstate, now=None)
    tickets = [f"w{i}" for i in range(3)]
    for t in tickets:
        assert await temporary(qstate, t, None, args(t, tenant=t)) is Result.QUEUED
    order = await queue_order(redis_client, qstate)
    admitted = []
    for lease in leases:
        await qstate.release_request_lease(lease, refresh_pin=False)
        results = await asyncio.gather(*(temporary(qstate, t, None, args(t, mode="wait", tenant=t)) for t in order if t not in admitted))
        winners = [t for t, r in zip([t for t in order if t not in admitted], results) if r is Result.ADMITTED]
        assert len(winners) == 1
        admitted += winners
    assert admitted == order


async def test_fairness_holds_after_a_long_uptime(qstate, redis_client):
    """Issue 29, suspected (confirmed): after about 2^30 tickets of a class without the queue ever
    idling (its state never expired), rounds reached their cap and the arrival counter wrapped
    (seq mod 2^20): tenants were served in arrival order, and a ticket arriving after the wrap
    went ahead of those before it in its round. The waiting tickets are renumbered in their order
    when the counter wraps or a round nears the cap: the order is a fresh queue's."""
    await _fair_order_after(qstate, redis_client, round_served=2**30 - 3)


async def test_fairness_holds_across_the_arrival_counters_wrap(qstate, redis_client):
    await _fair_order_after(qstate, redis_client, round_served=5)


async def _fair_order_after(qstate, redis_client, round_served: int) -> None:
    """Tenants a (4 tickets) and b (2) queue once the class has served `round_served` rounds and
    the arrival counter is 3 short of 2^20: the order is a fresh queue's."""
    state_key = qstate.keys.queue_state("m")
    await redis_client.hset(state_key, mapping={"v:1": round_served, "seq": 2**20 - 3})  # as after long uptime
    await fill_unreserved(qstate)
    for i in range(4):
        assert await temporary(qstate, f"a{i}", T0 + i, args(f"a{i}", tenant="a", rank=BATCH)) is Result.QUEUED
    for i in range(2):
        assert await temporary(qstate, f"b{i}", T0 + 10 + i, args(f"b{i}", tenant="b", rank=BATCH)) is Result.QUEUED
    assert await queue_order(qstate.redis, qstate) == ["a0", "b0", "a1", "b1", "a2", "a3"]
    assert int(await redis_client.hget(state_key, "seq")) < 2**20


@pytest.mark.parametrize(("rank", "mode"), [(BATCH, "none"), (INTERACTIVE, "none"), (BATCH, "join")])
async def test_a_pinned_admission_the_gate_refuses_finds_the_pair_full(qstate, redis_client, rank, mode):
    """Issue 29 item 2: a free unreserved slot of iris-1 and a ticket waiting for it: a pinned
    admission that may not take it (no ticket: its class does not wait or its proxy drains; or a
    batch ticket that does not head the queue) gets the answer the spec gives a pin at capacity,
    GLOBAL_IN_FLIGHT_REQUEST_LIMIT_REACHED, on which the router offloads it with the pin kept;
    never UNRESERVED_IN_FLIGHT_REQUEST_LIMIT_REACHED, which no pinned admission gets."""
    pinned = await qstate.try_admit_unpinned_session_request("iris-1", "m", "s", lease_id="P0", now_ms=T0)
    await qstate.release_request_lease(pinned.lease, refresh_pin=False, now_ms=T0)
    leases = await fill_unreserved(qstate)
    assert await temporary(qstate, "W", T0 + 1, args("W")) is Result.QUEUED
    await qstate.release_request_lease(leases[0], refresh_pin=False, now_ms=T0 + 2)
    queue = args("P1", mode=mode, rank=rank, tenant="s")
    refused = await qstate.try_admit_pinned_session_request("m", "s", lease_id="P1", now_ms=T0 + 3, queue=queue)
    expected = Result.QUEUED if mode == "join" else Result.GLOBAL_IN_FLIGHT_REQUEST_LIMIT_REACHED
    assert (refused.result, refused.pin.id) == (expected, pinned.pin.id)
    assert await queue_order(redis_client, qstate) == (["W", "P1"] if mode == "join" else ["W"])
