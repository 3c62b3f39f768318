"""Endpoint health for affinity pick (extproc.routing.endpoint_health, lua/lib.lua `endpoint_down`):
a flagged endpoint leaves placement and only its sessions move; every endpoint out degrades the
pair as any degraded pair. Real Redis, explicit script times (ms); the flags' own times are Redis
time, far after T0, so a flag set here holds for the calls below."""

from __future__ import annotations

import asyncio

import pytest
import yaml
from aiohttp import web

from extproc import cli
from extproc.config import parse_config
from extproc.operations.health import HealthMonitor, _EndpointCheckTask, _EndpointLoadTask, endpoint_check_url
from extproc.routing.degraded import ENDPOINTS as ENDPOINTS_SOURCE
from extproc.routing.degraded import DegradedFlags
from extproc.routing.endpoint_health import CONNECT, HEALTH, LOAD, MANUAL, EndpointHealth, live_readings
from extproc.routing.router import Router, RoutingRequest
from extproc.routing.state import Result, RoutingState
from irislab.processes import free_port
from tests.support.configs import small_config_data
from tests.unit.routing.test_endpoint_pick import ENDPOINTS, T0, pick_config

SESSIONS = [f"s{i}" for i in range(9)]


@pytest.fixture
async def pool(redis_client, redis_url):
    """A pick pair of 3 endpoints without a cap per endpoint, 9 sessions placed (3 on each)."""
    config = pick_config(redis_url, cap=None)
    state = RoutingState(redis_client, config)
    homes = {}
    for session in SESSIONS:
        admission = await state.try_admit_unpinned_session_request("iris-1", "m", session, now_ms=T0)
        assert admission.result is Result.ADMITTED
        homes[session] = admission.lease.endpoint
    assert sorted(homes.values()) == sorted(ENDPOINTS * 3), "equal load: three sessions each"
    return config, state, homes, EndpointHealth(redis_client, config.redis.key_prefix)


async def turns(state, now):
    """Every session's next turn: session -> (endpoint, pin id)."""
    out = {}
    for session in SESSIONS:
        admission = await state.try_admit_pinned_session_request("m", session, now_ms=now)
        assert admission.result is Result.ADMITTED
        out[session] = (admission.lease.endpoint, admission.pin.id)
    return out


@pytest.mark.parametrize("source", [MANUAL, HEALTH, CONNECT])
async def test_a_flagged_endpoint_moves_only_its_sessions(pool, source):
    config, state, homes, health = pool
    first = await turns(state, T0 + 1)
    out = ENDPOINTS[1]
    await health.set("iris-1", "m", out, f"{source}: test", 60, source)
    after = await turns(state, T0 + 2)
    for session in SESSIONS:
        endpoint, pin_id = after[session]
        assert pin_id == first[session][1], "the pin stays on the provider"
        if homes[session] == out:
            assert endpoint != out, f"{session} left the flagged endpoint"
        else:
            assert endpoint == homes[session], f"{session} on a healthy endpoint stays"
    admission = await state.try_admit_request_without_pin("iris-1", "m", now_ms=T0 + 3)
    assert out not in admission.lease.endpoints, "a flagged endpoint is no fallback either"
    # Cleared: the moved sessions keep their new endpoint (the pin recorded it); nobody moves back.
    assert await health.clear("iris-1", "m", out, source)
    assert not await health.clear("iris-1", "m", out, source)
    again = await turns(state, T0 + 4)
    assert {s: e for s, (e, _) in again.items()} == {s: e for s, (e, _) in after.items()}


async def test_one_source_never_clears_another(pool):
    config, state, homes, health = pool
    out = ENDPOINTS[0]
    await health.set("iris-1", "m", out, "drained by ops", 60, MANUAL)
    await health.set("iris-1", "m", out, "connect: refused", 60, CONNECT)
    assert await health.clear("iris-1", "m", out, CONNECT)
    assert [(f.endpoint, f.source, f.reason) for f in await health.flags("iris-1", "m")] == [(out, MANUAL, "drained by ops")]
    assert all(endpoint != out for endpoint, _ in (await turns(state, T0 + 1)).values())


async def test_a_flag_expires_by_redis_time(redis_client, redis_url):
    config = pick_config(redis_url, cap=None)
    health = EndpointHealth(redis_client, config.redis.key_prefix)
    await health.set("iris-1", "m", ENDPOINTS[0], "short", 0.05, MANUAL)
    assert await health.flags("iris-1", "m")
    key = health.keys.endpoint_health("m", "iris-1")
    assert 0 < await redis_client.pttl(key) <= 50, "the hash lives as long as its longest flag"
    state = RoutingState(redis_client, config)
    for _ in range(200):  # bounded wait on the flag's expiry (Redis time)
        if not await redis_client.exists(key):
            break
        await asyncio.sleep(0.01)
    placed = {(await state.try_admit_request_without_pin("iris-1", "m", now_ms=None)).lease.endpoint for _ in range(6)}
    assert ENDPOINTS[0] in placed


async def test_passive_failures_take_an_endpoint_out_after_the_threshold(pool):
    config, state, homes, health = pool
    out = ENDPOINTS[2]
    assert not await health.record_failure("iris-1", "m", out, "status 503", 10, 3, 30)
    assert not await health.record_failure("iris-1", "m", out, "status 503", 10, 3, 30)
    assert not (await health.flags("iris-1", "m"))
    assert await health.record_failure("iris-1", "m", out, "status 503", 10, 3, 30)
    [flag] = await health.flags("iris-1", "m")
    assert (flag.endpoint, flag.source) == (out, "passive") and 25 < flag.ttl_seconds <= 30
    moved = await turns(state, T0 + 1)
    assert all(endpoint != out for endpoint, _ in moved.values())
    assert all(moved[s][0] == homes[s] for s in SESSIONS if homes[s] != out)


async def test_every_endpoint_out_degrades_the_pair(pool, redis_client):
    config, state, homes, health = pool
    flags = DegradedFlags(redis_client, config)
    router = Router(config, state, flags)
    for endpoint in ENDPOINTS[:2]:
        await health.set("iris-1", "m", endpoint, "drained", 60, MANUAL)
    await flags.refresh()
    assert not flags.is_degraded("iris-1", "m"), "one endpoint left: the pair serves on it"
    await health.set("iris-1", "m", ENDPOINTS[2], "drained", 60, MANUAL)
    # Until this instance's refresh, the scripts find nowhere to place: the pair answers full.
    refused = await state.try_admit_pinned_session_request("m", SESSIONS[0], now_ms=T0 + 1)
    assert refused.result is Result.GLOBAL_IN_FLIGHT_REQUEST_LIMIT_REACHED
    await flags.refresh()
    assert flags.is_degraded("iris-1", "m")
    assert ENDPOINTS_SOURCE in flags.flags("iris-1", "m")
    assert "every endpoint out" in flags.reasons()[("iris-1", "m")]
    assert [p.name for p in router.eligible(_chat_request())] == ["iris-2", "tensorx"], "the pair is not eligible: as degraded"
    await health.clear("iris-1", "m", ENDPOINTS[0], MANUAL)
    await flags.refresh()
    assert not flags.is_degraded("iris-1", "m")


def _chat_request():
    return RoutingRequest(model="m", feature="chat", sub_features=frozenset(), session_id="x")


def _pick_yaml(tmp_path, redis_url) -> str:
    data = small_config_data(redis_url)
    pool = data["providers"][0]
    pool["affinity"] = "pick"
    pool["endpoints"] = [f"http://{e}" for e in ENDPOINTS]
    path = tmp_path / "pick.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


async def cli_main(*argv: str) -> int:
    """`iris-extproc ARGV` in a thread: it runs its own event loop."""
    return await asyncio.to_thread(cli.main, list(argv))


async def test_a_drain_names_one_endpoint(pool, tmp_path, redis_url, capsys):
    config, state, homes, health = pool
    path = _pick_yaml(tmp_path, redis_url)
    out = ENDPOINTS[0]
    assert await cli_main("drain", "iris-1", "--model", "m", "--endpoint", out, "--reason", "kernel upgrade", "--config", path) == 0
    assert capsys.readouterr().out == f"drained iris-1 m endpoint {out}\n"
    moved = await turns(state, T0 + 1)
    assert all(moved[s][0] != out for s in SESSIONS)
    assert all(moved[s][0] == homes[s] for s in SESSIONS if homes[s] != out), "only the drained endpoint's sessions move"
    assert await cli_main("status", "--config", path) == 0
    [line] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("iris-1") and " m " in line]
    assert "healthy" in line and f"endpoint {out} out: manual: kernel upgrade" in line, line
    assert await cli_main("undrain", "iris-1", "--endpoint", out, "--model", "m", "--config", path) == 0
    assert await cli_main("undrain", "iris-1", "--endpoint", out, "--model", "m", "--config", path) == 0
    assert capsys.readouterr().out == f"undrained iris-1 m endpoint {out}\niris-1 m endpoint {out} was not drained\n"
    assert await health.flags("iris-1", "m") == []


async def test_drain_wait_by_endpoint_waits_for_its_requests_only(redis_client, redis_url, tmp_path, capsys):
    config = pick_config(redis_url, cap=None)
    state = RoutingState(redis_client, config)
    leases = [(await state.try_admit_request_without_pin("iris-1", "m", now_ms=None)).lease for _ in range(6)]  # Redis time
    path = _pick_yaml(tmp_path, redis_url)
    out = ENDPOINTS[1]
    argv = ("drain", "iris-1", "--model", "m", "--endpoint", out, "--wait", "--wait-timeout", "0.3", "--config", path)
    assert await cli_main(*argv) == 1, "two requests still run on the endpoint"
    assert "still 2 requests in flight on endpoint" in capsys.readouterr().err
    for lease in leases:
        if lease.endpoint == out:
            await state.release_request_lease(lease, refresh_pin=False, now_ms=None)
    assert await cli_main(*argv) == 0, "the other endpoints' requests do not hold the drain"
    assert f"no request in flight on endpoint {out}" in capsys.readouterr().out


async def test_a_drain_refuses_an_endpoint_the_provider_does_not_have(tmp_path, redis_url):
    path = _pick_yaml(tmp_path, redis_url)
    with pytest.raises(SystemExit, match="not an endpoint of iris-1"):
        cli.main(["drain", "iris-1", "--endpoint", "10.0.0.1:80", "--config", path])
    with pytest.raises(SystemExit, match="does not have affinity pick"):
        cli.main(["drain", "iris-2", "--endpoint", ENDPOINTS[0], "--config", path])


async def test_a_connect_failure_on_a_pick_pair_takes_out_its_endpoint_not_the_pair(pool, redis_client):
    config, state, homes, health = pool
    flags = DegradedFlags(redis_client, config)
    monitor = HealthMonitor(config, redis_client, flags)
    out = ENDPOINTS[1]
    await monitor.connection_failed(config.provider("iris-1"), "m", "upstream_reset_before_response_started{connection_failure}", out)
    assert not flags.is_degraded("iris-1", "m"), "the pair keeps serving on its other endpoints"
    [flag] = await health.flags("iris-1", "m")
    assert (flag.endpoint, flag.source) == (out, CONNECT)
    moved = await turns(state, T0 + 1)
    assert all(moved[s][0] != out for s in SESSIONS)
    assert all(moved[s][0] == homes[s] for s in SESSIONS if homes[s] != out)
    await monitor.close()


async def test_a_5xx_burst_of_one_endpoint_takes_out_that_endpoint(pool, redis_client):
    config, state, homes, health = pool
    flags = DegradedFlags(redis_client, config)
    monitor = HealthMonitor(config, redis_client, flags)
    out = ENDPOINTS[0]
    for _ in range(config.degradation.passive.failures - 1):
        assert not await monitor.record_endpoint_failure("iris-1", "m", out, "status 503")
    assert await monitor.record_endpoint_failure("iris-1", "m", out, "status 503")
    assert not flags.is_degraded("iris-1", "m")
    assert [(f.endpoint, f.source) for f in await health.flags("iris-1", "m")] == [(out, "passive")]


class Replica:
    """A loopback HTTP server whose /health answers `status` and whose /metrics answers
    `metrics` (Prometheus text, vLLM's gauges; None: the port is closed)."""

    def __init__(self):
        self.status = 200
        self.metrics = ""
        self.port = free_port()
        self.runner = None

    def engine_holds(self, running: int, waiting: int) -> None:
        self.metrics = (f'vllm:num_requests_running{{model_name="m"}} {running}\n'
                        f'vllm:num_requests_waiting{{model_name="m"}} {waiting}\n')

    async def start(self):
        app = web.Application()
        async def health(_request):
            return web.Response(status=self.status)

        async def metrics(_request):
            return web.Response(text=self.metrics)

        app.router.add_get("/health", health)
        app.router.add_get("/metrics", metrics)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def stop(self):
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


async def test_the_active_check_runs_against_each_endpoint(redis_client, redis_url):
    replicas = [Replica() for _ in range(3)]
    for replica in replicas:
        await replica.start()
    try:
        data = small_config_data(redis_url)
        pool_provider = data["providers"][0]
        pool_provider["affinity"] = "pick"
        pool_provider["endpoints"] = [f"http://127.0.0.1:{r.port}" for r in replicas]
        pool_provider["health_check"] = {"url": "http://pool.invalid:8000/health?x=1", "interval_seconds": 60,
                                         "failures_before_degraded": 2, "successes_before_healthy": 1}
        config = parse_config(data)
        flags = DegradedFlags(redis_client, config)
        monitor = HealthMonitor(config, redis_client, flags)
        health = EndpointHealth(redis_client, config.redis.key_prefix)
        monitor.start()  # its loops' first probe (one failure of two at most) writes nothing; the steps below are this test's
        try:
            endpoints = [f"127.0.0.1:{r.port}" for r in replicas]
            assert endpoint_check_url("http://u:p@pool.invalid:8000/health?x=1", endpoints[0]) == f"http://{endpoints[0]}/health?x=1"
            replicas[1].status = 503
            await replicas[2].stop()  # refuses connections
            # Each check's second failure takes its endpoint out; the first endpoint stays.
            steps = {e: _EndpointCheckTask(monitor, config.provider("iris-1"), config.provider("iris-1").health_check, e)
                     for e in endpoints}
            for _ in range(2):
                for step in steps.values():
                    await step.step()
            out = {(f.endpoint, f.source) for f in await health.flags("iris-1", "m")}
            assert out == {(endpoints[1], HEALTH), (endpoints[2], HEALTH)}
            assert all("health: GET http://127.0.0.1:" in f.reason for f in await health.flags("iris-1", "m"))
            assert not flags.is_degraded("iris-1", "m")
            await replicas[0].stop()
            for _ in range(2):
                await steps[endpoints[0]].step()
            assert flags.is_degraded("iris-1", "m"), "every endpoint out: the pair is degraded"
            replicas[1].status = 200
            await steps[endpoints[1]].step()
            assert {f.endpoint for f in await health.flags("iris-1", "m")} == {endpoints[0], endpoints[2]}
            assert not flags.is_degraded("iris-1", "m")
        finally:
            await monitor.close()
    finally:
        for replica in replicas:
            await replica.stop()


async def test_an_engines_reading_weighs_as_load_above_the_exact_count(pool, redis_client):
    """Placement's load is the larger of the router's exact count and the engine's reading (it
    also sees work the router did not send); a reading is no flag and lapses at its deadline."""
    config, state, homes, health = pool
    busy = ENDPOINTS[0]
    await health.write_readings("iris-1", "m", {busy: 7, ENDPOINTS[1]: 0}, 60)
    assert await health.flags("iris-1", "m") == []
    raw = await redis_client.hgetall(state.keys.endpoint_health("m", "iris-1"))
    assert live_readings(raw, T0) == {busy: 7.0, ENDPOINTS[1]: 0.0}
    for i in range(4):  # sessionless requests: never the busy endpoint while another is lighter
        admission = await state.try_admit_request_without_pin("iris-1", "m", now_ms=T0 + 10 + i)
        assert admission.lease.endpoint != busy and admission.lease.endpoints[-1] == busy
    # A session pinned to the busy endpoint stays: the reading is load, not a flag.
    session = next(s for s in SESSIONS if homes[s] == busy)
    assert (await state.try_admit_pinned_session_request("m", session, now_ms=T0 + 20)).lease.endpoint == busy
    later = T0 + 10**13  # after the reading's deadline (Redis time + 60 s): it no longer counts
    placed = {(await state.try_admit_request_without_pin("iris-1", "m", now_ms=later + i)).lease.endpoint for i in range(6)}
    assert busy in placed


async def test_the_load_gauge_reads_each_endpoint_and_takes_out_only_a_saturated_or_silent_one(redis_client, redis_url):
    """Affinity pick: the provider's `load` gauge (vLLM's preset) is read from each endpoint; one
    over a threshold and one that cannot be read past stale_after_seconds get the `load` flag and
    leave placement, the third keeps placing; each reading records the engine's running + waiting
    requests; back under every threshold clears the flag."""
    replicas = [Replica() for _ in range(3)]
    for replica in replicas[:2]:
        await replica.start()
    replicas[0].engine_holds(running=2, waiting=12)  # over vLLM's waiting threshold (8)
    replicas[1].engine_holds(running=1, waiting=0)
    try:
        data = small_config_data(redis_url)
        pool_provider = data["providers"][0]
        pool_provider["affinity"] = "pick"
        pool_provider["endpoints"] = [f"http://127.0.0.1:{r.port}" for r in replicas]
        pool_provider["load"] = {"url": "http://pool.invalid:8000/metrics", "preset": "vllm",
                                 "interval_seconds": 60, "stale_after_seconds": 0.2}
        pool_provider["models"]["m"]["limits"] = {"max_pinned_sessions": 100, "max_global_in_flight_request_slots": 100,
                                                  "max_per_session_in_flight_request_slots": 10}
        config = parse_config(data)
        flags = DegradedFlags(redis_client, config)
        monitor = HealthMonitor(config, redis_client, flags)
        health = EndpointHealth(redis_client, config.redis.key_prefix)
        state = RoutingState(redis_client, config)
        monitor.start()  # each loop's first reading; the steps below are this test's
        try:
            endpoints = [f"127.0.0.1:{r.port}" for r in replicas]
            provider = config.provider("iris-1")
            steps = [_EndpointLoadTask(monitor, provider, provider.load, e) for e in endpoints]
            deadline = asyncio.get_running_loop().time() + 10
            while LOAD not in {f.source for f in await health.flags("iris-1", "m") if f.endpoint == endpoints[2]}:
                assert asyncio.get_running_loop().time() < deadline, "the silent endpoint never went out"
                for step in steps:
                    await step.step()
            out = {f.endpoint: f.reason for f in await health.flags("iris-1", "m")}
            assert set(out) == {endpoints[0], endpoints[2]}
            assert "vllm:num_requests_waiting=12" in out[endpoints[0]]
            assert out[endpoints[2]].startswith(f"load: no reading of http://{endpoints[2]}/metrics")
            raw = await redis_client.hgetall(state.keys.endpoint_health("m", "iris-1"))
            assert live_readings(raw, T0) == {endpoints[0]: 14.0, endpoints[1]: 1.0}
            for session in SESSIONS[:3]:
                admission = await state.try_admit_unpinned_session_request("iris-1", "m", session, now_ms=T0 + 1)
                assert admission.lease.endpoint == endpoints[1]
            assert not flags.is_degraded("iris-1", "m")
            replicas[0].engine_holds(running=0, waiting=1)  # back at or under recover_below (2)
            await steps[0].step()
            assert {f.endpoint for f in await health.flags("iris-1", "m")} == {endpoints[2]}
            admission = await state.try_admit_request_without_pin("iris-1", "m", now_ms=T0 + 2)
            assert admission.lease.endpoint == endpoints[0], "its engine holds 1, the other endpoint 3 of the router's"
        finally:
            await monitor.close()
    finally:
        for replica in replicas:
            await replica.stop()
