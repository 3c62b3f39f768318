"""The spec's routing algorithm (extproc.routing.router) over a real Redis: one scenario per path."""

from __future__ import annotations

import asyncio

import pytest

from extproc.config import parse_config
from extproc.routing.degraded import DegradedFlags
from extproc.routing.router import Decision, Reason, Rejection, RejectionKind, Router, RoutingRequest
from extproc.routing.state import Result, RoutingState
from tests.support.configs import small_config_data


def chat(session: str | None, model: str = "m", sub_features=()) -> RoutingRequest:
    return RoutingRequest(model, "chat", frozenset(sub_features), session)


@pytest.fixture
def degraded(redis_client, small_config):
    return DegradedFlags(redis_client, small_config)


@pytest.fixture
def router(small_config, state, degraded):
    return Router(small_config, state, degraded)


async def release(router, decision: Decision, succeeded=True):
    if decision.lease:
        await router.state.release_request_lease(decision.lease, refresh_pin=decision.refresh_pin_on_success and succeeded)


async def test_new_session_pins_to_first_provider_and_stays(router):
    first = await router.execute_request(chat("s"))
    assert (first.provider.name, first.reason) == ("iris-1", Reason.NEW_PIN)
    await release(router, first)
    for _ in range(2):
        again = await router.execute_request(chat("s"))
        assert (again.provider.name, again.reason) == ("iris-1", Reason.PINNED)
        assert again.pin.id == first.pin.id
        await release(router, again)


async def test_pin_limit_sends_new_sessions_down_the_priority_list(router):
    names = [(await router.execute_request(chat(f"s{i}"))).provider.name for i in range(6)]
    # iris-1 and iris-2 take 2 pins each, then the unlimited third party
    assert names == ["iris-1", "iris-1", "iris-2", "iris-2", "tensorx", "tensorx"]


async def test_per_session_limit_offloads_and_keeps_the_pin(router):
    a = await router.execute_request(chat("s"))
    b = await router.execute_request(chat("s"))
    c = await router.execute_request(chat("s"))
    assert [a.reason, b.reason, c.reason] == [Reason.NEW_PIN, Reason.PINNED, Reason.OFFLOADED]
    assert c.provider.name == "iris-2" and c.pin is None and not c.refresh_pin_on_success
    await release(router, a)
    d = await router.execute_request(chat("s"))
    assert (d.provider.name, d.reason, d.pin.id) == ("iris-1", Reason.PINNED, a.pin.id)


async def test_global_limit_offloads(router, state):
    a = await router.execute_request(chat("a"))
    await router.execute_request(chat("b"))
    # fill iris-1's unreserved share with temporary leases: 3 of 4 slots are taken now
    assert (await state.try_admit_request_without_pin("iris-1", "m")).result is Result.ADMITTED
    # the reserved slot serves pinned session a
    pinned = await router.execute_request(chat("a"))
    assert (pinned.provider.name, pinned.reason) == ("iris-1", Reason.PINNED)
    # now full: session a is offloaded, its pin kept
    full = await router.execute_request(chat("b"))
    assert (full.provider.name, full.reason) == ("iris-2", Reason.OFFLOADED)
    assert (await state.get_pin("m", "a")).id == a.pin.id


async def test_reserved_slots_are_refused_to_new_sessions(router, state):
    await router.execute_request(chat("a"))
    assert (await state.try_admit_request_without_pin("iris-1", "m")).result is Result.ADMITTED
    assert (await state.try_admit_request_without_pin("iris-1", "m")).result is Result.ADMITTED
    new = await router.execute_request(chat("new"))
    assert new.provider.name == "iris-2"
    pinned = await router.execute_request(chat("a"))
    assert pinned.provider.name == "iris-1" and pinned.reason is Reason.PINNED


async def test_degraded_pinned_provider_is_left_by_compare_and_swap(router, degraded):
    first = await router.execute_request(chat("s"))
    await release(router, first)
    await degraded.set("iris-1", "m", "test", ttl_seconds=60)
    moved = await router.execute_request(chat("s"))
    assert (moved.provider.name, moved.reason) == ("iris-2", Reason.REPINNED)
    assert moved.pin.id != first.pin.id
    await degraded.clear("iris-1", "m")
    await release(router, moved)
    stays = await router.execute_request(chat("s"))
    assert (stays.provider.name, stays.reason) == ("iris-2", Reason.PINNED)


async def test_unsupported_feature_on_pin_repins(router):
    first = await router.execute_request(chat("s"))
    await release(router, first)
    # iris-2 lacks tools; iris-1 has them. Pin the session to iris-2 first by degrading iris-1.
    await router.degraded.set("iris-1", "m", "test", ttl_seconds=60)
    moved = await router.execute_request(chat("s"))
    await release(router, moved)
    await router.degraded.clear("iris-1", "m")
    with_tools = await router.execute_request(chat("s", sub_features=["tools"]))
    assert (with_tools.provider.name, with_tools.reason) == ("iris-1", Reason.REPINNED)


class RacingState(RoutingState):
    """Moves the pin behind the router's back once, right before its compare-and-swap."""

    moved = False

    async def try_compare_and_swap_pin_and_admit_request(self, expected_pin, model, session_id, provider, **kw):
        if not self.moved:
            self.moved = True
            await super().try_compare_and_swap_pin_and_admit_request(expected_pin, model, session_id, "tensorx")
        return await super().try_compare_and_swap_pin_and_admit_request(expected_pin, model, session_id, provider, **kw)


async def test_compare_and_swap_that_loses_the_race_retries(redis_client, small_config, degraded):
    state = RacingState(redis_client, small_config)
    router = Router(small_config, state, degraded)
    first = await router.execute_request(chat("s"))
    await release(router, first)
    await degraded.set("iris-1", "m", "test", ttl_seconds=60)
    decision = await router.execute_request(chat("s"))
    # The racing repin moved the session to tensorx; the retry finds that pin and uses it.
    assert (decision.provider.name, decision.reason) == ("tensorx", Reason.PINNED)


async def test_all_managed_full_goes_to_unlimited(router):
    for i in range(4):
        await router.execute_request(chat(f"s{i}"))
    decision = await router.execute_request(chat("x"))
    assert (decision.provider.name, decision.reason) == ("tensorx", Reason.NEW_PIN)
    assert decision.lease is not None  # pinned requests on unlimited pairs still get leases


async def test_unpinned_requests_on_unlimited_providers_take_no_lease(router, degraded):
    await degraded.set("iris-1", "e", "test", ttl_seconds=60)
    decision = await router.execute_request(RoutingRequest("e", "embeddings", frozenset(), None))
    assert (decision.provider.name, decision.reason, decision.lease) == ("tensorx", Reason.UNPINNED, None)


async def test_unpinned_requests_on_limited_providers_take_a_lease(router):
    decision = await router.execute_request(RoutingRequest("e", "embeddings", frozenset(), None))
    assert decision.provider.name == "iris-1" and decision.lease is not None and decision.pin is None


async def test_nothing_supports_the_model(router):
    rejection = await router.execute_request(chat("s", model="unknown"))
    assert isinstance(rejection, Rejection) and rejection.kind is RejectionKind.UNSUPPORTED
    tools = await router.execute_request(RoutingRequest("e", "embeddings", frozenset({"vision"}), None))
    assert tools.kind is RejectionKind.UNSUPPORTED


async def test_capacity_and_unavailable_rejections(redis_client, redis_url):
    data = small_config_data(redis_url)
    data["providers"] = data["providers"][:1]
    config = parse_config(data)
    degraded = DegradedFlags(redis_client, config)
    router = Router(config, RoutingState(redis_client, config), degraded)
    for i in range(2):
        assert isinstance(await router.execute_request(chat(f"s{i}")), Decision)
    full = await router.execute_request(chat("x"))
    assert full.kind is RejectionKind.CAPACITY
    await degraded.set("iris-1", "m", "test", ttl_seconds=60)
    down = await router.execute_request(chat("y"))
    assert down.kind is RejectionKind.UNAVAILABLE


async def test_degraded_flags_are_shared_through_redis(redis_client, small_config):
    writer = DegradedFlags(redis_client, small_config)
    reader = DegradedFlags(redis_client, small_config)
    await writer.set("iris-2", "m", "manual", ttl_seconds=60)
    assert not reader.is_degraded("iris-2", "m")
    await reader.refresh()
    assert reader.is_degraded("iris-2", "m")
    assert reader.reasons() == {("iris-2", "m"): "manual"}


async def test_concurrent_sessions_never_exceed_the_limits(redis_url, redis_client):
    data = small_config_data(redis_url)
    data["providers"] = [data["providers"][0], data["providers"][2]]
    config = parse_config(data)
    state = RoutingState(redis_client, config)
    router = Router(config, state, DegradedFlags(redis_client, config))
    limits = config.provider("iris-1").limits("m")
    in_flight: dict[str, int] = {}
    per_session: dict[str, int] = {}
    violations: list[str] = []

    async def one(i: int) -> None:
        session = f"s{i % 50}"
        decision = await router.execute_request(chat(session))
        name = decision.provider.name
        in_flight[name] = in_flight.get(name, 0) + 1
        if name == "iris-1":
            if in_flight[name] > limits.max_global_in_flight_request_slots:
                violations.append(f"global {in_flight[name]}")
            if decision.pin is not None:
                per_session[session] = per_session.get(session, 0) + 1
                if per_session[session] > limits.max_per_session_in_flight_request_slots:
                    violations.append(f"per-session {per_session[session]}")
        pin = await state.get_pin("m", session)
        if decision.pin is not None and pin is not None and pin.provider != decision.provider.name:
            violations.append("session pinned to two providers")
        await asyncio.sleep(0)
        in_flight[name] -= 1
        if name == "iris-1" and decision.pin is not None:
            per_session[session] -= 1
        await release(router, decision)

    for _ in range(3):
        await asyncio.gather(*(one(i) for i in range(200)))
        pins_key = state.keys.provider_pins("m", "iris-1")
        seconds, micros = await redis_client.time()
        now = seconds * 1000 + micros // 1000
        assert await redis_client.zcount(pins_key, f"({now}", "+inf") <= limits.max_pinned_sessions
        assert await redis_client.zcount(state.keys.provider_leases("m", "iris-1"), f"({now}", "+inf") == 0
    assert violations == []
