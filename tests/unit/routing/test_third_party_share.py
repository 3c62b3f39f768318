"""routing.third_party_share (issue 22): a per-identity cap on the share of admissions that
unlimited providers take, checked and counted by the admission's own script (lua/lib.lua
share_admits, lua/admit_share.lua), against a real Redis; then what the router does with a refusal."""

from __future__ import annotations

import asyncio

import pytest

from extproc import metrics
from extproc.config import parse_config
from extproc.routing.degraded import DegradedFlags
from extproc.routing.router import Reason, Rejection, RejectionKind, Router, RoutingRequest
from extproc.routing.state import Result, RoutingState, new_id
from tests.support.configs import small_config_data

ALICE, BOB = "a1ice0000000000000000000000000000", "b0b00000000000000000000000000000"
T0 = 1_000_000_000
ADMITTED, REFUSED = Result.ADMITTED, Result.THIRD_PARTY_SHARE_REACHED


def share_state(redis_client, redis_url, hot_path, **share) -> RoutingState:
    config = parse_config(small_config_data(redis_url, routing={"third_party_share": {"window_seconds": 3600, **share}}))
    return RoutingState(redis_client, config, hot_path=hot_path)


async def counts(redis_client, state: RoutingState, identity: str, model: str = "m") -> tuple[int, int]:
    """(admissions, admissions on unlimited providers) in the identity's share zsets."""
    keys = state.keys
    return (await redis_client.zcard(keys.share_admissions(model, identity)),
            await redis_client.zcard(keys.share_unlimited_admissions(model, identity)))


async def own_admissions(state: RoutingState, identity: str, n: int) -> None:
    """`n` temporary admissions of `identity` on own providers (iris-1 has 3 unreserved slots, iris-2 3)."""
    for i in range(n):
        admission = await state.try_admit_request_without_pin("iris-1" if i < 3 else "iris-2", "m", share=identity)
        assert admission.result is ADMITTED


async def test_unlimited_admissions_stop_exactly_at_the_share_under_concurrency(redis_client, redis_url, hot_path):
    state = share_state(redis_client, redis_url, hot_path, max_share=0.5)
    await own_admissions(state, ALICE, 4)
    results = await asyncio.gather(*(
        state.try_admit_unpinned_session_request("tensorx", "m", f"s{i}", share=ALICE) for i in range(12)
    ))
    # unlimited <= 0.5 x all: u <= 0.5 x (4 + u), so 4 of the 12 pass, whichever come first.
    assert sorted(r.result.value for r in results) == sorted([ADMITTED.value] * 4 + [REFUSED.value] * 8)
    assert all(r.lease is None for r in results if r.result is REFUSED)
    assert await counts(redis_client, state, ALICE) == (8, 4)
    refused_sessions = [f"s{i}" for i, r in enumerate(results) if r.result is REFUSED]
    assert [await state.get_pin("m", s) for s in refused_sessions] == [None] * 8  # a refusal pins nothing


async def test_one_identitys_share_leaves_anothers_alone(redis_client, redis_url, hot_path):
    state = share_state(redis_client, redis_url, hot_path, max_share=0.5)
    await own_admissions(state, BOB, 2)
    alice = await state.try_admit_share("tensorx", "m", ALICE, lease_id=new_id())
    bobs = await asyncio.gather(*(state.try_admit_share("tensorx", "m", BOB, lease_id=new_id()) for _ in range(5)))
    assert alice is REFUSED  # no admission of her own yet: 1 > 0.5 x 1
    assert sorted(r.value for r in bobs) == sorted([ADMITTED.value] * 2 + [REFUSED.value] * 3)
    assert await counts(redis_client, state, ALICE) == (0, 0)
    assert await counts(redis_client, state, BOB) == (4, 2)


async def test_burst_lets_a_light_identity_overflow_that_many(redis_client, redis_url, hot_path):
    state = share_state(redis_client, redis_url, hot_path, max_share=0.0, burst=2)
    results = await asyncio.gather(*(state.try_admit_share("tensorx", "m", ALICE, lease_id=new_id()) for _ in range(6)))
    assert [r.value for r in results].count(ADMITTED.value) == 2


async def test_a_replayed_admission_counts_once(redis_client, redis_url, hot_path):
    state = share_state(redis_client, redis_url, hot_path, max_share=0.0, burst=1)
    lease = new_id()
    first = await state.try_admit_unpinned_session_request("tensorx", "m", "s", lease_id=lease, share=ALICE)
    again = await state.try_admit_unpinned_session_request("tensorx", "m", "s", lease_id=lease, share=ALICE)
    assert (first.result, again.result) == (ADMITTED, ADMITTED)
    assert await counts(redis_client, state, ALICE) == (1, 1)
    assert (await state.try_admit_unpinned_session_request("tensorx", "m", "t", share=ALICE)).result is REFUSED


async def test_an_admission_retried_onto_an_own_provider_leaves_the_unlimited_count(redis_client, redis_url, hot_path):
    state = share_state(redis_client, redis_url, hot_path, max_share=0.0, burst=1)
    lease = new_id()
    assert await state.try_admit_share("tensorx", "m", ALICE, lease_id=lease) is ADMITTED
    assert (await state.try_admit_request_without_pin("iris-1", "m", lease_id=lease, share=ALICE)).result is ADMITTED
    assert await counts(redis_client, state, ALICE) == (1, 0)
    assert await state.try_admit_share("tensorx", "m", ALICE, lease_id=new_id()) is ADMITTED


async def test_the_window_forgets_older_admissions(redis_client, redis_url, hot_path):
    state = share_state(redis_client, redis_url, hot_path, max_share=0.0, burst=1, window_seconds=60)
    assert await state.try_admit_share("tensorx", "m", ALICE, lease_id=new_id(), now_ms=T0) is ADMITTED
    assert await state.try_admit_share("tensorx", "m", ALICE, lease_id=new_id(), now_ms=T0 + 59_999) is REFUSED
    assert await state.try_admit_share("tensorx", "m", ALICE, lease_id=new_id(), now_ms=T0 + 60_000) is ADMITTED


async def test_pinned_and_repinned_admissions_count_against_the_share(redis_client, redis_url, hot_path):
    state = share_state(redis_client, redis_url, hot_path, max_share=0.0, burst=1)
    pinned = await state.try_admit_unpinned_session_request("tensorx", "m", "s", share=ALICE)
    assert pinned.result is ADMITTED
    on_pin = await state.try_admit_pinned_session_request("m", "s", share=ALICE)
    assert (on_pin.result, on_pin.pin) == (REFUSED, pinned.pin)
    own = await state.try_admit_unpinned_session_request("iris-1", "m", "t", share=ALICE)
    cas = await state.try_compare_and_swap_pin_and_admit_request(own.pin, "m", "t", "tensorx", share=ALICE)
    assert cas.admission.result is REFUSED
    assert (await state.get_pin("m", "t")).provider == "iris-1"  # the pin stays where it was


async def test_off_checks_and_stores_nothing(redis_client, state):
    results = [await state.try_admit_share("tensorx", "m", ALICE, lease_id=new_id()) for _ in range(3)]
    results += [(await state.try_admit_unpinned_session_request("tensorx", "m", f"s{i}", share=ALICE)).result for i in range(3)]
    assert results == [ADMITTED] * 6
    assert await redis_client.keys("*share*") == []


# ---- the router ---------------------------------------------------------------------------


def chat(session: str | None, identity: str = ALICE, model: str = "m") -> RoutingRequest:
    return RoutingRequest(model, "chat", frozenset(), session, share_key=identity)


@pytest.fixture
def capped(redis_client, redis_url, hot_path) -> Router:
    state = share_state(redis_client, redis_url, hot_path, max_share=0.0, burst=1)
    return Router(state.config, state, DegradedFlags(redis_client, state.config))


async def test_a_capped_pinned_session_is_offloaded_to_an_own_provider_and_keeps_its_pin(capped):
    first = await capped.state.try_admit_unpinned_session_request("tensorx", "m", "s", share=ALICE)
    await capped.state.release_request_lease(first.lease, refresh_pin=True)
    decision = await capped.execute_request(chat("s"))
    assert (decision.provider.name, decision.reason) == ("iris-1", Reason.OFFLOADED)
    assert (await capped.state.get_pin("m", "s")).id == first.pin.id


async def test_capped_without_room_of_our_own_is_a_capacity_rejection(capped):
    for _ in range(3):  # iris-1's unreserved slots; iris-2 does not serve embeddings
        assert (await capped.state.try_admit_request_without_pin("iris-1", "e")).result is ADMITTED
    refusals = metrics.THIRD_PARTY_SHARE_REFUSALS.labels("tensorx", "e")
    before = refusals._value.get()
    embeddings = RoutingRequest("e", "embeddings", frozenset(), None, share_key=ALICE)
    burst = await capped.execute_request(embeddings)
    assert (burst.provider.name, burst.reason, burst.lease) == ("tensorx", Reason.UNPINNED, None)
    rejection = await capped.execute_request(embeddings)
    assert isinstance(rejection, Rejection) and rejection.kind is RejectionKind.CAPACITY
    assert refusals._value.get() == before + 1


async def test_a_new_session_over_its_share_tries_every_provider_then_is_rejected(capped):
    # Fill every pin of iris-1 and iris-2 (2 each) with other identities' sessions.
    for i in range(4):
        assert (await capped.execute_request(chat(f"other{i}", identity=BOB))).provider.name.startswith("iris")
    assert (await capped.execute_request(chat("a1"))).provider.name == "tensorx"  # alice's burst
    rejection = await capped.execute_request(chat("a2"))
    assert isinstance(rejection, Rejection) and rejection.kind is RejectionKind.CAPACITY
