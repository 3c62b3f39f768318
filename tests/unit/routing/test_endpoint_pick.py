"""Affinity pick in the routing state (lua/lib.lua "Placement on a pick pair"): per-endpoint
counts, replica pins and placement, against a real Redis, with explicit times (ms)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from extproc.config import RedisSettings, parse_config
from extproc.routing.degraded import DegradedFlags
from extproc.routing.endpoint_health import CONNECT, EndpointHealth
from extproc.routing.lease_table import LeaseTable
from extproc.routing.outage import InstanceRegistry, OutagePolicy, RedisBreaker
from extproc.routing.placement import deciding_with, prompt_blocks
from extproc.routing.router import Router, RoutingRequest
from extproc.routing.state import Result, RoutingState
from extproc.storage.client import connect, open_redis
from extproc.storage.pipelined import open_pipelined
from irislab.processes import free_port
from irislab.redis_topologies import LocalCluster
from tests.support.configs import small_config_data

T0 = 1_000_000_000
LEASE_MS = 30_000
ENDPOINTS = ["127.0.0.1:9001", "127.0.0.1:9002", "127.0.0.1:9003"]
CAP = 2


def pick_config(redis_url: str, cap: int | None = CAP, redis: dict | None = None, **placement):
    data = small_config_data(redis_url) if redis is None else small_config_data(redis=redis)
    pool = data["providers"][0]
    pool["affinity"] = "pick"
    pool["endpoints"] = [f"http://{e}" for e in ENDPOINTS]
    entry = pool["models"]["m"]
    entry["limits"] = {"max_pinned_sessions": 100, "max_global_in_flight_request_slots": 100,
                       "max_per_session_in_flight_request_slots": 10}
    if cap is not None:
        entry["max_in_flight_per_endpoint"] = cap
    data["routing"] = {"placement": placement} if placement else {}
    return parse_config(data)


@pytest.fixture
async def proxies(redis_client, redis_url):
    """Three proxies' routing states on one Redis: redis-py, and two pipelined clients."""
    config = pick_config(redis_url)
    hot = [open_pipelined(RedisSettings(url=redis_url), timeout_seconds=5) for _ in range(2)]
    yield [RoutingState(redis_client, config), *(RoutingState(redis_client, config, hot_path=h) for h in hot)]
    for client in hot:
        await client.aclose()


async def counts(redis_client, state, now):
    """The live leases per endpoint, read from Redis: every proxy's view."""
    return [await redis_client.zcount(state.keys.endpoint_leases("m", "iris-1", e), f"({now}", "+inf") for e in ENDPOINTS]


def blocks(text: str) -> tuple[str, ...]:
    return prompt_blocks(text.encode(), 256, 32)


async def test_three_proxies_place_and_count_a_session_alike(proxies, redis_client):
    sessions = [f"s{i}" for i in range(3)]
    first = {}
    for session, state in zip(sessions, proxies):
        admission = await state.try_admit_unpinned_session_request("iris-1", "m", session, now_ms=T0)
        assert admission.result is Result.ADMITTED
        first[session] = admission.lease
    assert sorted(lease.endpoint for lease in first.values()) == ENDPOINTS  # equal load: one each
    turns = []
    for turn, state in zip(range(3), itertools.cycle(reversed(proxies))):  # each session's turns over other proxies
        for session in sessions:
            admission = await state.try_admit_pinned_session_request("m", session, now_ms=T0 + 1 + turn)
            if turn == 0:
                assert admission.lease.endpoint == first[session].endpoint, "a later turn goes to the pin's endpoint"
            turns.append(admission.lease)
    # Two turns filled each endpoint to its cap of 2; the third turns find every endpoint full.
    assert all(lease is None for lease in turns[6:])
    for state in proxies:
        assert await counts(redis_client, state, T0 + 10) == [CAP, CAP, CAP]
        pin, _ = await state.get_pin_and_try_admit("m", "s0", [], now_ms=T0 + 10)
        assert pin is not None
    for lease, state in zip([*first.values(), *(t for t in turns if t)], itertools.cycle(proxies)):
        assert (await state.release_request_lease(lease, refresh_pin=True, now_ms=T0 + 20)).result is Result.RELEASED
    assert await counts(redis_client, proxies[0], T0 + 20) == [0, 0, 0]


async def test_the_pins_endpoint_at_its_cap_moves_the_session(proxies, redis_client):
    state = proxies[0]
    first = await state.try_admit_unpinned_session_request("iris-1", "m", "s", now_ms=T0)
    home = first.lease.endpoint
    second = await state.try_admit_pinned_session_request("m", "s", now_ms=T0 + 1)
    assert second.lease.endpoint == home
    moved = await proxies[1].try_admit_pinned_session_request("m", "s", now_ms=T0 + 2)
    assert moved.result is Result.ADMITTED
    assert moved.lease.endpoint != home, "the pin's endpoint at its cap is skipped"
    assert moved.pin.id == first.pin.id, "the pin stays on the provider; only its endpoint changes"
    later = await proxies[2].try_admit_pinned_session_request("m", "s", now_ms=T0 + 3)
    assert later.lease.endpoint == moved.lease.endpoint, "the pin records its new endpoint"
    assert home not in moved.lease.endpoints, "an endpoint at its cap is no fallback either"


async def test_a_chained_turn_goes_to_the_endpoint_that_stores_its_response(proxies, redis_client):
    """A Responses turn continuing a response stored on one endpoint (lib.lua `place`, the
    chained endpoint rides in `deciding_with`) goes there alone: before the session's pin, even at
    the endpoint's cap while the pair has room, for a new session and a sessionless request too;
    the pin then records it. Another provider's endpoint of that name changes nothing."""
    state = proxies[0]
    first = await state.try_admit_unpinned_session_request("iris-1", "m", "s", now_ms=T0)
    pinned = first.lease.endpoint
    storing = next(e for e in ENDPOINTS if e != pinned)
    with deciding_with((), ("iris-1", storing)):
        for i in range(CAP):  # new sessions continuing responses stored there: the endpoint at its cap
            filler = await state.try_admit_unpinned_session_request("iris-1", "m", f"filler{i}", now_ms=T0)
            assert filler.lease.endpoints == (storing,)
        assert (await counts(redis_client, state, T0))[ENDPOINTS.index(storing)] == CAP
        chained = await proxies[1].try_admit_pinned_session_request("m", "s", now_ms=T0 + 1)
        sessionless = await proxies[2].try_admit_request_without_pin("iris-1", "m", now_ms=T0 + 1)
    assert chained.result is Result.ADMITTED and chained.lease.endpoints == (storing,), "the storing replica alone, at its cap"
    assert sessionless.lease.endpoints == (storing,)
    assert await counts(redis_client, state, T0 + 1) == [CAP + 2 if e == storing else int(e == pinned) for e in ENDPOINTS]
    later = await state.try_admit_pinned_session_request("m", "s", now_ms=T0 + 2)
    assert later.lease.endpoint != storing, "without the chain, the endpoint over its cap is skipped"
    with deciding_with((), ("another-provider", pinned)):
        other = await state.try_admit_request_without_pin("iris-1", "m", now_ms=T0 + 3)
    assert other.lease.endpoint != storing and len(other.lease.endpoints) > 1, "placed as usual"


async def test_every_endpoint_at_its_cap_is_a_full_pair(proxies):
    state = proxies[0]
    for i in range(len(ENDPOINTS) * CAP):
        assert (await state.try_admit_request_without_pin("iris-1", "m", now_ms=T0)).result is Result.ADMITTED
    refused = await state.try_admit_request_without_pin("iris-1", "m", now_ms=T0)
    assert refused.result is Result.GLOBAL_IN_FLIGHT_REQUEST_LIMIT_REACHED
    assert refused.lease is None
    new_session = await proxies[1].try_admit_unpinned_session_request("iris-1", "m", "late", now_ms=T0)
    assert new_session.result is Result.GLOBAL_IN_FLIGHT_REQUEST_LIMIT_REACHED


async def test_counts_return_to_zero_after_releases_and_expiry(proxies, redis_client):
    state = proxies[0]
    leases = [(await state.try_admit_request_without_pin("iris-1", "m", now_ms=T0)).lease for _ in range(4)]
    pinned = (await state.try_admit_unpinned_session_request("iris-1", "m", "s", now_ms=T0)).lease
    assert sum(await counts(redis_client, state, T0)) == 5
    renewed = await proxies[1].renew_request_lease(leases[0], now_ms=T0 + LEASE_MS - 1)
    assert renewed.result is Result.RENEWED
    for lease in leases[1:3]:
        await proxies[2].release_request_lease(lease, refresh_pin=False, now_ms=T0 + 10)
    assert sum(await counts(redis_client, state, T0 + 10)) == 3
    # The unrenewed leases expire: only the renewed one counts, on its endpoint, until it expires too.
    after = T0 + LEASE_MS + 1
    assert await counts(redis_client, state, after) == [int(e == leases[0].endpoint) for e in ENDPOINTS]
    assert sum(await counts(redis_client, state, T0 + 2 * LEASE_MS)) == 0
    assert (await state.release_request_lease(pinned, refresh_pin=False, now_ms=after)).result is Result.LEASE_EXPIRED
    # Expired leases never hold a slot: the endpoint that had 2 takes 2 again.
    again = [await state.try_admit_request_without_pin("iris-1", "m", now_ms=T0 + 2 * LEASE_MS) for _ in range(6)]
    assert all(a.result is Result.ADMITTED for a in again)


async def test_an_abandoned_decision_frees_its_endpoint(proxies, redis_client):
    state = proxies[0]
    admission = await state.try_admit_unpinned_session_request("iris-1", "m", "s", lease_id="L" * 32, pin_id="P" * 32, now_ms=T0)
    assert sum(await counts(redis_client, state, T0)) == 1
    await proxies[1].abandon_request("m", "s", "L" * 32, "P" * 32, now_ms=T0 + 1)
    assert sum(await counts(redis_client, state, T0 + 1)) == 0
    assert admission.lease.endpoint in ENDPOINTS


async def test_a_replayed_admission_answers_its_endpoint(proxies):
    state = proxies[0]
    first = await state.try_admit_request_without_pin("iris-1", "m", lease_id="a" * 32, now_ms=T0)
    again = await proxies[1].try_admit_request_without_pin("iris-1", "m", lease_id="a" * 32, now_ms=T0 + 1)
    assert again.lease.endpoint == first.lease.endpoint


async def test_a_lease_answered_by_another_endpoint_counts_there(proxies, redis_client):
    """lua/move_endpoint_lease.lua (Envoy retried the pick on its next endpoint): the lease leaves
    the picked endpoint and counts on the one that answered with the same deadline and a TTL on
    its key; again, from any proxy, changes nothing; an endpoint the pair does not list, on
    either side, moves nothing. Renewals then move its deadline there, the release ends it
    there, and a released or expired lease never moves."""
    state = proxies[0]
    lease = (await state.try_admit_unpinned_session_request("iris-1", "m", "s", now_ms=T0)).lease
    picked = lease.endpoint
    answered = next(e for e in ENDPOINTS if e != picked)
    on = [int(e == answered) for e in ENDPOINTS]

    def key(endpoint: str) -> str:
        return state.keys.endpoint_leases("m", "iris-1", endpoint)

    assert (await state.move_endpoint_lease(lease, "127.0.0.1:9999", now_ms=T0 + 1)).result is Result.NOT_FOUND
    unlisted = dataclasses.replace(lease, endpoints=("127.0.0.1:9999",))
    assert (await state.move_endpoint_lease(unlisted, answered, now_ms=T0 + 1)).result is Result.NOT_FOUND
    assert not await redis_client.exists(key("127.0.0.1:9999"))
    assert await counts(redis_client, state, T0 + 1) == [int(e == picked) for e in ENDPOINTS]
    moved = await proxies[1].move_endpoint_lease(lease, answered, now_ms=T0 + 1)
    assert (moved.result, moved.deadline_ms) == (Result.MOVED, lease.deadline_ms)
    assert await redis_client.zscore(key(answered), lease.id) == lease.deadline_ms
    assert await counts(redis_client, state, T0 + 1) == on
    assert await redis_client.pttl(key(answered)) > LEASE_MS
    again = await proxies[2].move_endpoint_lease(lease, answered, now_ms=T0 + 2)
    assert (again.result, again.deadline_ms) == (Result.MOVED, lease.deadline_ms), "idempotent"
    back = dataclasses.replace(lease, endpoints=(answered,))
    assert (await state.move_endpoint_lease(back, answered, now_ms=T0 + 3)).result is Result.NOT_FOUND, "the same endpoint"
    assert await counts(redis_client, state, T0 + 3) == on
    renewed = await state.renew_request_lease(lease, now_ms=T0 + LEASE_MS // 2)
    assert await redis_client.zscore(key(answered), lease.id) == renewed.deadline_ms > lease.deadline_ms
    assert await counts(redis_client, state, renewed.deadline_ms - 1) == on
    assert (await state.release_request_lease(lease, refresh_pin=True, now_ms=T0 + LEASE_MS)).result is Result.RELEASED
    assert await counts(redis_client, state, T0 + LEASE_MS) == [0, 0, 0]
    assert (await state.move_endpoint_lease(lease, answered, now_ms=T0 + LEASE_MS)).result is Result.NOT_FOUND
    expired = (await state.try_admit_request_without_pin("iris-1", "m", now_ms=T0)).lease
    elsewhere = next(e for e in ENDPOINTS if e != expired.endpoint)
    assert (await state.move_endpoint_lease(expired, elsewhere, now_ms=expired.deadline_ms)).result is Result.NOT_FOUND
    assert await redis_client.zscore(key(elsewhere), expired.id) is None


async def test_the_endpoint_that_answered_learns_the_prompt_and_draws_its_prefix(redis_client, redis_url):
    """A moved lease teaches the answering endpoint's prefix index the request's blocks (the
    decision's, passed again with the move): once the picked endpoint is out (its refused
    connection's `connect` flag), a later request with the same prefix is placed there, not on
    the endpoint that never served it."""
    config = pick_config(redis_url, cap=None)
    state = RoutingState(redis_client, config)
    document = "The shared system prompt of one group of users. " * 40
    with deciding_with(blocks(document + "first user")):
        lease = (await state.try_admit_request_without_pin("iris-1", "m", now_ms=T0)).lease
        answered = next(e for e in ENDPOINTS if e != lease.endpoint)
        assert (await state.move_endpoint_lease(lease, answered, now_ms=T0 + 1)).result is Result.MOVED
    assert await redis_client.zcard(state.keys.endpoint_prefixes("m", "iris-1", answered)) == len(blocks(document + "first user"))
    await state.release_request_lease(lease, refresh_pin=False, now_ms=T0 + 2)
    await EndpointHealth(redis_client, config.redis.key_prefix).set("iris-1", "m", lease.endpoint, "connect: refused", 60, CONNECT)
    with deciding_with(blocks(document + "second user")):
        later = (await state.try_admit_request_without_pin("iris-1", "m", now_ms=T0 + 3)).lease
    assert later.endpoint == answered


async def test_the_lease_table_moves_a_lease_to_the_endpoint_that_answered(redis_client, redis_url):
    """LeaseTable.answered_by: the held lease names the endpoint that answered first (its chain
    record, `x-iris-endpoint` and an adoption read it) and Redis counts it there; a Redis that
    fails the move is logged and counted by the breaker, never raised; the release ends it."""
    config = pick_config(redis_url)
    state = RoutingState(redis_client, config)
    router = Router(config, state, DegradedFlags(redis_client, config))
    breaker = RedisBreaker(redis_client, 3)
    table = LeaseTable(config, state, router, OutagePolicy(config, router, InstanceRegistry(redis_client, "iris")), breaker)
    table.start()
    dead = connect(f"redis://127.0.0.1:{free_port()}/0", timeout_seconds=0.2)
    try:
        held, failing = [await table.decide(RoutingRequest("m", "chat", frozenset(), f"s{i}")) for i in range(2)]
        picked = held.lease.endpoint
        answered = next(e for e in ENDPOINTS if e != picked)
        await table.answered_by(held, answered)
        assert held.lease.endpoint == answered and picked in held.lease.endpoints[1:]
        now = (await redis_client.time())[0] * 1000
        failing_on = [int(e == failing.lease.endpoint) for e in ENDPOINTS]
        assert await counts(redis_client, state, now) == [a + b for a, b in zip([int(e == answered) for e in ENDPOINTS], failing_on)]
        failing.state = RoutingState(dead, config)
        elsewhere = next(e for e in ENDPOINTS if e != failing.lease.endpoint)
        await table.answered_by(failing, elsewhere)  # logged, not raised
        assert failing.lease.endpoint == elsewhere, "in memory, the lease runs where it was answered"
        table.end(held, succeeded=True)
        failing.state = state
        table.end(failing, succeeded=True)
        await table.drain()
        assert await counts(redis_client, state, now) == [0, 0, 0]
    finally:
        await dead.aclose()


async def test_sessionless_requests_go_to_the_least_loaded_endpoint(proxies, redis_client):
    state = proxies[0]
    pinned = [(await state.try_admit_unpinned_session_request("iris-1", "m", f"s{i}", now_ms=T0)).lease for i in range(3)]
    busy = pinned[0].endpoint
    await state.try_admit_pinned_session_request("m", "s0", now_ms=T0)  # the first endpoint carries 2
    await state.release_request_lease(pinned[1], refresh_pin=False, now_ms=T0)  # the second 0, the third 1
    idle = pinned[1].endpoint
    for state in proxies:
        lease = (await state.try_admit_request_without_pin("iris-1", "m", now_ms=T0 + 1)).lease
        assert lease.endpoint == idle
        await state.release_request_lease(lease, refresh_pin=False, now_ms=T0 + 1)
    lease = (await state.try_admit_request_without_pin("iris-1", "m", now_ms=T0 + 1)).lease
    third = next(e for e in ENDPOINTS if e not in (busy, idle))
    assert lease.endpoints == (idle, third), "the fallbacks: next best first; the endpoint at its cap is none"


async def test_a_shared_prefix_lands_where_it_was_served_unless_that_endpoint_is_loaded(redis_client, redis_url):
    config = pick_config(redis_url, cap=None, prefix_weight=2)
    proxies = [RoutingState(redis_client, config) for _ in range(3)]
    document = "You answer questions about this document. " * 40  # a shared prefix of ~1.7 kB: 6 blocks
    with deciding_with(blocks(document + "first user")):
        first = (await proxies[0].try_admit_request_without_pin("iris-1", "m", now_ms=T0)).lease
    await proxies[0].release_request_lease(first, refresh_pin=False, now_ms=T0 + 1)
    home = first.endpoint
    placed = []
    for i, state in enumerate(itertools.cycle(proxies)):
        if i == 4:
            break
        with deciding_with(blocks(document + f"user {i}")):
            placed.append((await state.try_admit_unpinned_session_request("iris-1", "m", f"u{i}", now_ms=T0 + 2 + i)).lease)
    # Prefix weight 2, load weight 1: the home endpoint takes the group while it carries fewer
    # than 2 requests more than the least loaded one, then the group spreads.
    assert [lease.endpoint for lease in placed[:2]] == [home, home]
    assert placed[2].endpoint != home, "a hot prefix does not pile onto one replica"
    loads = await counts(redis_client, proxies[0], T0 + 10)
    assert max(loads) - min(loads) <= 2


async def test_pure_load_placement_ignores_prefixes(redis_client, redis_url):
    config = pick_config(redis_url, cap=None, prefix_weight=0)
    state = RoutingState(redis_client, config)
    with deciding_with(blocks("same prefix " * 50)):
        placed = [(await state.try_admit_request_without_pin("iris-1", "m", now_ms=T0)).lease.endpoint for _ in range(3)]
    assert sorted(placed) == ENDPOINTS


async def test_the_prefix_index_is_bounded(redis_client, redis_url):
    config = pick_config(redis_url, cap=None, index_blocks_per_endpoint=10)
    state = RoutingState(redis_client, config)
    for i in range(5):
        with deciding_with(blocks(f"{i} " * 2000)):  # 32 blocks each
            lease = (await state.try_admit_request_without_pin("iris-1", "m", now_ms=T0 + i)).lease
            await state.release_request_lease(lease, refresh_pin=False, now_ms=T0 + i)
    for endpoint in ENDPOINTS:
        key = state.keys.endpoint_prefixes("m", "iris-1", endpoint)
        assert await redis_client.zcard(key) <= 10
        assert 0 < await redis_client.pttl(key) or not await redis_client.exists(key)


def test_prompt_blocks_chain() -> None:
    a, b = blocks("x" * 600), blocks("x" * 512 + "y" * 88)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    assert blocks("y" + "x" * 599)[1] != a[1], "a block's hash covers every block before it"
    assert prompt_blocks(b"z" * 100_000, 256, 32) == prompt_blocks(b"z" * 8192, 256, 32)
    assert prompt_blocks(None, 256, 32) == ()


async def test_a_reload_that_adds_an_endpoint_moves_no_session_and_one_that_removes_one_moves_only_its_own(redis_client, redis_url):
    before = RoutingState(redis_client, pick_config(redis_url))
    homes = {}
    for i in range(6):
        lease = (await before.try_admit_unpinned_session_request("iris-1", "m", f"s{i}", now_ms=T0)).lease
        homes[f"s{i}"] = lease.endpoint
        await before.release_request_lease(lease, refresh_pin=True, now_ms=T0)
    grown = pick_config(redis_url)
    grown.providers[0].endpoints.append("http://127.0.0.1:9004")
    after = RoutingState(redis_client, grown)
    for session, home in homes.items():
        lease = (await after.try_admit_pinned_session_request("m", session, now_ms=T0 + 1)).lease
        assert lease.endpoint == home, "an added endpoint moves no session"
        await after.release_request_lease(lease, refresh_pin=True, now_ms=T0 + 1)
    shrunk = pick_config(redis_url)
    gone = homes["s0"]
    shrunk.providers[0].endpoints.remove(f"http://{gone}")
    smaller = RoutingState(redis_client, shrunk)
    for session, home in homes.items():
        lease = (await smaller.try_admit_pinned_session_request("m", session, now_ms=T0 + 2)).lease
        assert lease.endpoint != gone and (home == gone or lease.endpoint == home), (session, home, lease.endpoint)
        await smaller.release_request_lease(lease, refresh_pin=True, now_ms=T0 + 2)


@pytest.mark.parametrize("kind", ["redis-py", "pipelined"])
async def test_placement_and_counts_in_a_redis_cluster(tmp_path, kind):
    """The pick's keys (endpoint leases and prefix indexes) share the model's hash tag: in a
    Redis Cluster every script still runs on one shard, over either client."""
    with LocalCluster(tmp_path / "cluster") as cluster:
        config = pick_config("", redis={"cluster": {"nodes": cluster.seeds}, "key_prefix": "t"})
        client = open_redis(config.redis, timeout_seconds=5)
        hot = None if kind == "redis-py" else open_pipelined(config.redis, timeout_seconds=5)
        try:
            state = RoutingState(client, config, hot_path=hot)
            leases = [(await state.try_admit_unpinned_session_request("iris-1", "m", f"s{i}")).lease for i in range(3)]
            with deciding_with(blocks("a shared system prompt " * 40)):
                turn = await state.try_admit_pinned_session_request("m", "s0")
            assert sorted(lease.endpoint for lease in leases) == ENDPOINTS
            assert turn.lease.endpoint == leases[0].endpoint
            for lease in [*leases, turn.lease]:
                assert (await state.renew_request_lease(lease)).result is Result.RENEWED
                assert (await state.release_request_lease(lease, refresh_pin=True)).result is Result.RELEASED
        finally:
            if hot is not None:
                await hot.aclose()
            await client.aclose()
