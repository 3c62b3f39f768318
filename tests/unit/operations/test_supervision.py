"""Supervised background work (issue 15): a step that raises is restarted with a backoff,
counted and logged once per failure streak; a health checker that raises keeps its provider's
flag while the provider fails; passive failures go through one bounded queue and a fixed number
of writers."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from extproc.config import parse_config
from extproc.metrics import FAILURES_DROPPED, RESTARTS
from extproc.operations import health
from extproc.operations.health import PASSIVE_QUEUE_SIZE, PASSIVE_WRITERS, HealthMonitor
from extproc.routing.degraded import HEALTH, DegradedFlags
from extproc.supervision import backoff_seconds, run_every
from tests.support.configs import small_config_data


def restarts(task: str) -> float:
    return RESTARTS.labels(task)._value.get()


async def wait_for(predicate, within_seconds: float = 20.0, interval: float = 0.01):
    """Wait until `predicate()` is truthy (returned), or fail after `within_seconds`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_seconds
    while not (value := predicate()):
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(interval)
    return value


def test_backoff_doubles_up_to_its_cap():
    assert [backoff_seconds(n, 0.3) for n in (1, 2, 3, 4, 5)] == [0.05, 0.1, 0.2, 0.3, 0.3]


async def test_a_step_that_raises_is_restarted_counted_and_logged_once_per_streak(caplog):
    calls = []

    async def step():
        calls.append(len(calls))
        if len(calls) in (2, 3, 4, 7):  # two failure streaks: three in a row, then one
            raise KeyError("unexpected")

    before = restarts("flaky")
    with caplog.at_level(logging.WARNING, logger="extproc.supervision"):
        task = asyncio.create_task(run_every("flaky", step, 0))
        await wait_for(lambda: len(calls) >= 9)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert restarts("flaky") - before == 4
    failed = [r for r in caplog.records if "failed; restarting" in r.getMessage()]
    recovered = [r for r in caplog.records if "recovered" in r.getMessage()]
    assert len(failed) == 2 and all(r.exc_info for r in failed)
    assert [r.getMessage() for r in recovered] == [
        "background task flaky recovered after 3 failed attempts",
        "background task flaky recovered after 1 failed attempts",
    ]
    assert task.cancelled()


async def failing_provider():
    """A real HTTP server on loopback whose /health always answers 503."""
    probes = []

    async def handle(request):
        probes.append(request.path)
        return web.Response(status=503)

    app = web.Application()
    app.router.add_get("/health", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, port, probes


async def test_a_health_checker_that_raises_restarts_and_keeps_the_flag_while_the_provider_fails(
    redis_client, redis_url, monkeypatch
):
    runner, port, probes = await failing_provider()
    data = small_config_data(redis_url)
    data["providers"][0]["health_check"] = {
        "url": f"http://127.0.0.1:{port}/health", "interval_seconds": 0.05, "timeout_seconds": 0.5,
        "failures_before_degraded": 2, "successes_before_healthy": 1,
    }
    config = parse_config(data)
    flags, reader = DegradedFlags(redis_client, config), DegradedFlags(redis_client, config)
    monitor = HealthMonitor(config, redis_client, flags)
    real_probe = HealthMonitor._probe
    faults = {"left": 0}

    async def probe(self, *args):
        if faults["left"]:
            faults["left"] -= 1
            raise RuntimeError("a bug outside the errors the checker catches")
        return await real_probe(self, *args)

    monkeypatch.setattr(HealthMonitor, "_probe", probe)
    before = restarts("health:iris-1")
    try:
        monitor.start()
        await wait_for(lambda: flags.is_degraded("iris-1", "m"))
        faults["left"] = 5
        seen_probes = len(probes)
        checks = []
        while restarts("health:iris-1") - before < 5 or len(probes) < seen_probes + 3:
            await reader.refresh()
            checks.append(reader.flags("iris-1", "m").get(HEALTH))
            await asyncio.sleep(0.02)
            assert len(checks) < 2000, "the checker did not restart"
        assert all(reason and reason.startswith("health: GET") for reason in checks), checks
        assert restarts("health:iris-1") - before == 5
        ttl_ms = await redis_client.pttl("{t:m}:degraded:iris-1:health")
        assert ttl_ms > 500  # renewed after the restarts: the TTL is 3 x 0.5 s
    finally:
        await monitor.close()
        await runner.cleanup()


async def test_passive_failures_go_through_one_bounded_queue_and_fixed_writers(redis_client, redis_url):
    data = small_config_data(redis_url)
    data["degradation"] = {"passive": {"failures": 10_000, "window_seconds": 60, "cooldown_seconds": 60}}
    config = parse_config(data)
    monitor = HealthMonitor(config, redis_client, DegradedFlags(redis_client, config))
    iris_1 = config.provider("iris-1")
    dropped = FAILURES_DROPPED._value.get()
    for _ in range(PASSIVE_QUEUE_SIZE + 500):  # a burst of 5xx before any writer runs
        monitor.observe(iris_1, "m", 503)
    assert FAILURES_DROPPED._value.get() - dropped == 500
    assert monitor._failures.qsize() == PASSIVE_QUEUE_SIZE
    try:
        monitor.start()
        assert len(monitor._tasks) == PASSIVE_WRITERS
        await wait_for(lambda: monitor._failures.qsize() == 0)
        recorded = await wait_for_count(redis_client, "{t:m}:failures:iris-1", PASSIVE_QUEUE_SIZE)
        assert recorded == PASSIVE_QUEUE_SIZE
    finally:
        await monitor.close()


async def wait_for_count(redis_client, key: str, expected: int) -> int:
    for _ in range(1000):
        count = await redis_client.zcard(key)
        if count >= expected:
            return count
        await asyncio.sleep(0.01)
    return count


def test_the_passive_bounds_are_small():
    assert PASSIVE_WRITERS <= 4 and PASSIVE_QUEUE_SIZE <= 4096
    assert health.PASSIVE_QUEUE_SIZE == PASSIVE_QUEUE_SIZE
