"""The fleet-state reader and the metrics collector against a real Redis: counts as the routing
scripts count them (expired leases and pins never count), limits from the config, flags, the
cache, and a scrape that survives an unreachable Redis."""

from __future__ import annotations

import asyncio
import socket

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from redis.exceptions import TimeoutError as RedisTimeoutError

from extproc import metrics
from extproc.config import parse_config
from extproc.operations import exporter
from extproc.operations.fleet_state import CachedFleetState, FleetStateReader, on_loop
from extproc.routing.degraded import HEALTH, DegradedFlags
from extproc.routing.outage import InstanceRegistry
from extproc.storage.client import open_redis
from tests.support.configs import small_config_data


def pair(fleet, provider: str, model: str = "m"):
    (found,) = [p for p in fleet.pairs if (p.provider, p.model) == (provider, model)]
    return found


async def redis_now_ms(redis_client) -> int:
    seconds, micros = await redis_client.time()
    return seconds * 1000 + micros // 1000


async def test_counts_live_leases_and_pins_as_the_scripts_do(state, redis_client, small_config):
    now = await redis_now_ms(redis_client)
    await state.try_admit_unpinned_session_request("iris-1", "m", "s1")
    await state.try_admit_unpinned_session_request("iris-1", "m", "s2")
    await state.try_admit_pinned_session_request("m", "s2")
    await state.try_admit_request_without_pin("iris-2", "m")
    # Admitted long ago: its lease and pin expired without a release, and must not count.
    await state.try_admit_unpinned_session_request("iris-2", "m", "old", now_ms=now - 10_000_000)
    await InstanceRegistry(redis_client, small_config.redis.key_prefix).heartbeat()
    await DegradedFlags(redis_client, small_config).set("iris-2", "m", "health: down", 30, HEALTH)

    fleet = await FleetStateReader(small_config, redis_client).read()
    one, two, third = pair(fleet, "iris-1"), pair(fleet, "iris-2"), pair(fleet, "tensorx")
    assert (one.in_flight, one.pins, one.state, one.flags) == (3, 2, "healthy", [])
    assert (two.in_flight, two.pins, two.state) == (1, 0, "degraded")
    assert [(f.source, f.reason) for f in two.flags] == [(HEALTH, "health: down")] and 0 < two.flags[0].ttl_seconds <= 30
    assert (one.in_flight_limit, one.reserved_for_pinned, one.pin_limit) == (4, 1, 2)
    # A pair without a pin limit is capped at max_pinned_sessions_unlimited (bounded routing state).
    assert (third.kind, third.in_flight_limit, third.pin_limit, third.flags) == ("unlimited", None, small_config.max_pinned_sessions_unlimited, [])
    assert fleet.live_instances == 1 and fleet.now_ms >= now
    assert [(p.provider, p.model) for p in fleet.pairs] == [("iris-1", "m"), ("iris-1", "e"), ("iris-2", "m"), ("tensorx", "m"), ("tensorx", "e")]


async def test_a_read_is_one_round_trip(redis_client, small_config):
    calls = []
    original = redis_client.pipeline

    def counting_pipeline(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    redis_client.pipeline = counting_pipeline
    try:
        await FleetStateReader(small_config, redis_client).read()
    finally:
        redis_client.pipeline = original
    assert len(calls) == 1


def blocking_read(config, reads: list | None = None):
    """A blocking read as the metrics thread makes one: here on a loop of its own per read."""

    async def once():
        redis = open_redis(config.redis, timeout_seconds=0.2)
        try:
            return await FleetStateReader(config, redis).read()
        finally:
            await redis.aclose()

    def read():
        if reads is not None:
            reads.append(1)
        return asyncio.run(once())

    return read


def scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for s in family.samples
    }


def test_scrapes_within_the_cache_age_read_redis_once(small_config, redis_server):
    reads = []
    registry = CollectorRegistry()
    registry.register(exporter.FleetCollector(CachedFleetState(blocking_read(small_config, reads), max_age_seconds=3600)))
    first, second = scrape(registry), scrape(registry)
    assert len(reads) == 1 and first == second
    assert first[("iris_fleet_state_up", ())] == 1
    assert first[("iris_in_flight_request_limit", (("gen_ai_request_model", "m"), ("kind", "managed"), ("provider", "iris-1")))] == 4
    registry = CollectorRegistry()
    registry.register(exporter.FleetCollector(CachedFleetState(blocking_read(small_config, reads), max_age_seconds=0)))
    scrape(registry), scrape(registry)
    assert len(reads) == 3


def test_an_unreachable_redis_gives_up_0_and_a_counted_error_not_a_failed_scrape():
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        config = parse_config(small_config_data(f"redis://127.0.0.1:{closed.getsockname()[1]}/0"))
        registry = CollectorRegistry()
        registry.register(exporter.FleetCollector(CachedFleetState(blocking_read(config))))
        errors = metrics.REDIS_ERRORS.labels("fleet_state")._value.get()
        samples = scrape(registry)
    assert samples == {("iris_fleet_state_up", ()): 0}
    assert metrics.REDIS_ERRORS.labels("fleet_state")._value.get() == errors + 1


async def test_a_read_on_the_loop_from_another_thread_and_one_the_loop_cannot_run(redis_client, small_config):
    """The metrics thread's read runs on the event loop; one the loop cannot run within the bound
    is a Redis timeout (the scrape says up 0), not a hung scrape."""
    loop = asyncio.get_running_loop()
    read = on_loop(FleetStateReader(small_config, redis_client), loop, timeout_seconds=30)
    fleet = await asyncio.to_thread(read)
    assert fleet.pairs and fleet.live_instances == 0
    stalled = on_loop(FleetStateReader(small_config, redis_client), loop, timeout_seconds=0.05)
    with pytest.raises(RedisTimeoutError, match="not read within"):
        stalled()  # from the loop's own thread: the loop cannot run the read while this waits


async def test_live_tickets_per_pair_and_class_while_the_queue_is_on(redis_client, redis_url):
    """docs/queue.md: the depth of each pair's admission queue per class, live tickets only (an
    expired ticket of a crashed proxy never counts); nothing while the queue is off."""
    from extproc.routing.state import QueueArgs, Result, RoutingState

    off_for_e = {"e": 0}
    queue = {"classes": [{"name": "interactive", "max_wait_ms": 1000, "max_wait_ms_by_model": off_for_e},
                         {"name": "batch", "max_wait_ms": 1000, "max_wait_ms_by_model": off_for_e}]}
    config = parse_config(small_config_data(redis_url, routing={"queue": queue}))
    state = RoutingState(redis_client, config)
    for i in range(3):
        assert (await state.try_admit_request_without_pin("iris-1", "m")).result is Result.ADMITTED
    now = await redis_now_ms(redis_client)
    for ticket, rank, at in (("i1", 0, None), ("b1", 1, None), ("b2", 1, None), ("ghost", 0, now - 60_000)):
        args = QueueArgs(rank, True, ticket, ticket, "join", 256)
        admission = await state.try_admit_request_without_pin("iris-1", "m", lease_id=ticket, queue=args, now_ms=at)
        assert admission.result is Result.QUEUED
    fleet = await FleetStateReader(config, redis_client).read()
    assert pair(fleet, "iris-1").queued == {"interactive": 1, "batch": 2}
    assert pair(fleet, "iris-2").queued == {"interactive": 0, "batch": 0}
    assert pair(fleet, "iris-1", "e").queued == {}  # no class waits for "e": its queue is off
    off = await FleetStateReader(parse_config(small_config_data(redis_url)), redis_client).read()
    assert all(p.queued == {} for p in off.pairs)
