"""routing.prefer_previous_provider (off by default): a session whose pin expired pins again on
its previous provider first, among the same eligible providers, within every limit (real Redis)."""

from __future__ import annotations

import asyncio

import pytest

from extproc.config import parse_config
from extproc.routing.degraded import DegradedFlags
from extproc.routing.previous_provider import PreviousProviders
from extproc.routing.router import Reason, Router, RoutingRequest
from extproc.routing.state import RoutingState
from tests.support.configs import small_config_data

PREFER = {"prefer_previous_provider": {"enabled": True, "remember_seconds": 600}}


def chat(session: str) -> RoutingRequest:
    return RoutingRequest("m", "chat", frozenset(), session)


def router_for(redis_client, redis_url, **overrides) -> Router:
    config = parse_config(small_config_data(redis_url, pin_inactivity_timeout_seconds=0.2, **overrides))
    return Router(config, RoutingState(redis_client, config), DegradedFlags(redis_client, config))


async def served_then_expired(router: Router, session: str, degraded: list[str]) -> str:
    """Route `session` once while `degraded` providers are degraded, release, clear the flags and
    wait (bounded) until its pin has expired; returns where it was served."""
    for name in degraded:
        await router.degraded.set(name, "m", "test", ttl_seconds=60)
    decision = await router.execute_request(chat(session))
    if decision.lease is not None:
        await router.state.release_request_lease(decision.lease, refresh_pin=True)
    for name in degraded:
        await router.degraded.clear(name, "m")
    for _ in range(100):
        if await router.state.get_pin("m", session) is None:
            break
        await asyncio.sleep(0.05)
    assert await router.state.get_pin("m", session) is None
    return decision.provider.name


@pytest.mark.parametrize("enabled, expected", [(False, "iris-1"), (True, "iris-2")])
async def test_an_expired_session_pins_again_on_its_previous_provider_only_when_enabled(
    redis_client, redis_url, enabled, expected
):
    router = router_for(redis_client, redis_url, **({"routing": PREFER} if enabled else {}))
    assert await served_then_expired(router, "s", degraded=["iris-1"]) == "iris-2"
    again = await router.execute_request(chat("s"))
    assert (again.provider.name, again.reason) == (expected, Reason.NEW_PIN)


async def test_the_preference_never_puts_an_unlimited_provider_before_a_managed_one(redis_client, redis_url):
    router = router_for(redis_client, redis_url, routing=PREFER)
    assert await served_then_expired(router, "s", degraded=["iris-1", "iris-2"]) == "tensorx"
    again = await router.execute_request(chat("s"))
    assert (again.provider.name, again.reason) == ("iris-1", Reason.NEW_PIN)


async def test_a_full_or_degraded_previous_provider_is_passed_over(redis_client, redis_url):
    router = router_for(redis_client, redis_url, routing=PREFER)
    assert await served_then_expired(router, "s", degraded=["iris-1"]) == "iris-2"
    await router.degraded.set("iris-2", "m", "test", ttl_seconds=60)
    degraded = await router.execute_request(chat("s"))
    assert (degraded.provider.name, degraded.reason) == ("iris-1", Reason.NEW_PIN)
    router2 = router_for(redis_client, redis_url, routing=PREFER)
    assert await served_then_expired(router2, "t", degraded=["iris-1"]) == "iris-2"
    for other in ("x", "y"):  # iris-2's two pins (its limit) go to other sessions
        await router2.state.try_admit_unpinned_session_request("iris-2", "m", other)
    full = await router2.execute_request(chat("t"))
    assert (full.provider.name, full.reason) == ("iris-1", Reason.NEW_PIN)


def test_previous_providers_forget_after_their_time_and_beyond_their_size():
    now = [0.0]
    memory = PreviousProviders(remember_seconds=10, max_sessions=2, clock=lambda: now[0])
    memory.remember("a", "iris-1")
    memory.remember("b", "iris-2")
    assert (memory.get("a"), memory.get("b")) == ("iris-1", "iris-2")
    memory.remember("c", "iris-1")  # over the size: the least recently routed (a) goes
    assert (memory.get("a"), memory.get("c"), len(memory)) == (None, "iris-1", 2)
    now[0] = 10.0
    assert memory.get("b") is None and memory.get("c") is None
