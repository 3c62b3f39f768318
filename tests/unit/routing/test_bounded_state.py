"""Bounded routing state (issue 15): pairs without a pin limit hold at most
`max_pinned_sessions_unlimited` live pins; sessions beyond the cap are served without a pin;
Redis memory per pin stays under the figure docs/routing-state.md states."""

from __future__ import annotations

import hashlib

from extproc.config import parse_config
from extproc.routing.degraded import DegradedFlags
from extproc.routing.router import Reason, Router, RoutingRequest
from extproc.routing.state import RoutingState
from tests.model_based.model import routing as R
from tests.model_based.model import state as S

# docs/routing-state.md "Bounded routing state": at most this many bytes of Redis memory per idle pin (its
# hash and its member of the pins zset, with 64-hex session ids as in production); measured
# about 450 B with `python -m bench.pin_memory` (redis 6.2, 100k pins).
BYTES_PER_PIN_BOUND = 512


def unlimited_config(redis_url: str, cap: int):
    return parse_config({
        "providers": [
            {"name": "iris-1", "kind": "managed", "cluster": "iris-1",
             "models": {"m": {"features": ["chat"], "limits": {"max_pinned_sessions": 2}}}},
            {"name": "tensorx", "kind": "unlimited", "cluster": "tensorx", "models": {"m": {"features": ["chat"]}}},
        ],
        "max_pinned_sessions_unlimited": cap,
        "redis": {"url": redis_url, "key_prefix": "b"},
    })


async def live_pins(redis_client, provider: str) -> int:
    seconds, micros = await redis_client.time()
    return await redis_client.zcount(f"{{b:m}}:pins:{provider}", f"({seconds * 1000 + micros // 1000}", "+inf")


async def test_sessions_beyond_the_cap_are_served_without_a_pin_as_the_model_says(redis_client, redis_url):
    config = unlimited_config(redis_url, cap=3)
    router = Router(config, RoutingState(redis_client, config), DegradedFlags(redis_client, config))
    model = S.RoutingModel(config, 300_000, 30_000)
    model_router = R.ModelRouter(config, set())
    ids = (f"L{i}" for i in range(10_000))
    reasons, expected = [], []
    for i in range(8):
        decision = await router.execute_request(RoutingRequest("m", "chat", frozenset(), f"s{i}"))
        reasons.append((decision.provider.name, decision.reason, decision.lease is None))
        if decision.lease is not None:
            await router.state.release_request_lease(decision.lease, refresh_pin=True)
        outcome = R.run(model_router, model, R.Request("m", "chat", frozenset(), f"s{i}"), 1, lambda: next(ids))
        expected.append((outcome.provider, outcome.reason, outcome.lease is None))
    # Past the cap a session is routed as a request without one: a temporary lease on iris-1
    # (its pins are full, its slots are not: the spec prefers our own fleet), no pin anywhere.
    new, capped = ("iris-1", Reason.NEW_PIN, False), ("iris-1", Reason.UNPINNED, False)
    assert reasons == [new, new, ("tensorx", Reason.NEW_PIN, False), ("tensorx", Reason.NEW_PIN, False),
                       ("tensorx", Reason.NEW_PIN, False), capped, capped, capped]
    assert [(p, r.value, no_lease) for p, r, no_lease in reasons] == expected
    assert await live_pins(redis_client, "tensorx") == 3
    # A capped session's next request is still served (again without a pin).
    again = await router.execute_request(RoutingRequest("m", "chat", frozenset(), "s7"))
    assert (again.provider.name, again.reason, again.pin) == ("iris-1", Reason.UNPINNED, None)


async def test_many_sessions_on_an_unlimited_pair_never_exceed_the_cap_nor_the_memory_bound(redis_client, redis_url):
    cap = 2000
    config = unlimited_config(redis_url, cap=cap)
    router = Router(config, RoutingState(redis_client, config), DegradedFlags(redis_client, config))
    await router.execute_request(RoutingRequest("m", "chat", frozenset(), None))  # scripts loaded, connected
    before = (await redis_client.info("memory"))["used_memory"]
    served = 0
    for batch in range(6):  # 3000 sessions, 1.5 x the cap
        for i in range(500):
            session = hashlib.blake2b(f"{batch}-{i}".encode(), digest_size=32).hexdigest()
            decision = await router.execute_request(RoutingRequest("m", "chat", frozenset(), session))
            served += 1
            if decision.lease is not None:
                await router.state.release_request_lease(decision.lease, refresh_pin=True)
        assert await live_pins(redis_client, "tensorx") <= cap
    assert served == 3000
    assert await live_pins(redis_client, "tensorx") == cap
    used = (await redis_client.info("memory"))["used_memory"] - before
    pins = cap + 2  # and iris-1's two
    assert used <= pins * BYTES_PER_PIN_BOUND, f"{used / pins:.0f} bytes per pin"
