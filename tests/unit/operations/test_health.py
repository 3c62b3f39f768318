"""Degradation without a gateway: flags per source, the health-check streak, the passive window
script against a real Redis, the load gauge parser, and the new configuration checks."""

from __future__ import annotations

import asyncio

import pytest

from extproc.config import ConfigError, LoadGauge, parse_config
from extproc.operations.fleet_state import FleetStateReader
from extproc.operations.health import HealthMonitor, Streak, display_url, gauge_values, over_threshold, signal_values
from extproc.routing.degraded import CONNECT, HEALTH, LOAD, MANUAL, PASSIVE, DegradedFlags
from extproc.routing.router import RejectionKind, Router, RoutingRequest
from extproc.routing.state import RoutingState
from tests.support.configs import small_config_data


async def test_a_source_clears_only_its_own_flag(redis_client, small_config):
    flags = DegradedFlags(redis_client, small_config)
    reader = DegradedFlags(redis_client, small_config)
    await flags.set("iris-1", "m", "manual: drained by ops", 60, MANUAL)
    await flags.set("iris-1", "m", "health: GET /health -> 503", 60, HEALTH)
    await flags.clear("iris-1", "m", HEALTH)  # an automatic recovery
    await reader.refresh()
    assert reader.is_degraded("iris-1", "m")
    assert reader.flags("iris-1", "m") == {MANUAL: "manual: drained by ops"}
    await flags.clear("iris-1", "m", MANUAL)
    await reader.refresh()
    assert not reader.is_degraded("iris-1", "m")
    assert await redis_client.keys("*degraded*") == []


async def test_flags_live_under_the_models_hash_tag_and_expire(redis_client, small_config):
    flags = DegradedFlags(redis_client, small_config)
    await flags.set_many([("iris-1", "m"), ("iris-2", "m")], "health: down", 30, HEALTH)
    keys = sorted(k.decode() for k in await redis_client.keys("*"))
    assert keys == ["{t:m}:degraded:iris-1:health", "{t:m}:degraded:iris-2:health"]
    (flag,) = await pair_flags(redis_client, small_config, "iris-1", "m")
    assert (flag.source, flag.reason) == (HEALTH, "health: down")
    assert 0 < flag.ttl_seconds <= 30


async def pair_flags(redis_client, config, provider: str, model: str) -> list:
    """The pair's degraded flags as `iris-extproc status` reads them."""
    fleet = await FleetStateReader(config, redis_client).read()
    (pair,) = [p for p in fleet.pairs if (p.provider, p.model) == (provider, model)]
    return pair.flags


async def test_refresh_is_one_round_trip(redis_client, small_config):
    flags = DegradedFlags(redis_client, small_config)
    await flags.set("iris-2", "m", "load: high", 60, LOAD)
    calls = []
    original = redis_client.pipeline

    def counting_pipeline(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    redis_client.pipeline = counting_pipeline
    try:
        assert await flags.refresh() == {("iris-2", "m"): "load: high"}
    finally:
        redis_client.pipeline = original
    assert len(calls) == 1


def test_unknown_source_is_refused(redis_client, small_config):
    with pytest.raises(ValueError):
        DegradedFlags(redis_client, small_config)._key("iris-1", "m", "gossip")


def test_streak_needs_consecutive_results():
    streak = Streak(failures_before_degraded=2, successes_before_healthy=2)
    assert [streak.record(ok) for ok in (False, True, False, False, True, False, True, True)] == [
        False, False, False, True, True, True, True, False
    ]


def test_gauge_values_per_model_and_in_total():
    text = (
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{model_name="up-m"} 12\n'
        'vllm:num_requests_waiting{model_name="other"} 3\n'
        'vllm:num_requests_running{model_name="up-m"} 99\n'
    )
    assert gauge_values(text, "vllm:num_requests_waiting", "model_name", {"m": "up-m", "e": "e"}) == {"m": 12.0, "e": 0.0}
    assert gauge_values(text, "vllm:num_requests_waiting", None, {"m": "up-m"}) == {"m": 15.0}


def test_a_preset_reads_every_signal_of_its_engine_and_its_model_label():
    text = (
        'vllm:num_requests_waiting{model_name="up-m",engine="0"} 1\n'
        'vllm:kv_cache_usage_perc{model_name="up-m",engine="0"} 0.97\n'
    )
    gauge = LoadGauge(url="http://x/metrics", preset="vllm")
    metrics_read = [signal.metric for signal in gauge.all_signals()]
    assert metrics_read == ["vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"] and gauge.label() == "model_name"
    values = signal_values(text, metrics_read, gauge.label(), {"m": "up-m"})
    assert values == {"vllm:num_requests_waiting": {"m": 1.0}, "vllm:kv_cache_usage_perc": {"m": 0.97}}
    saturated = [s.metric for s in gauge.all_signals() if over_threshold(values[s.metric]["m"], False, s.threshold, s.recovers_at)]
    assert saturated == ["vllm:kv_cache_usage_perc"]
    with pytest.raises(ConfigError, match="load: needs a preset"):
        parse_config(small_config_data(providers=[{"name": "p", "kind": "managed", "cluster": "p", "load": {"url": "http://x/m"},
                                                   "models": {"m": {"features": ["chat"]}}}]))


def test_load_degrades_above_the_threshold_until_back_at_recover_below():
    over = False
    seen = []
    for value in (5, 11, 6, 2.5, 2, 9, 10, 10.5):
        over = over_threshold(value, over, threshold=10, recover_below=2)
        seen.append(over)
    assert seen == [False, True, True, True, False, False, False, True]


def test_display_url_drops_user_info_and_query():
    assert display_url("https://user:pw@h.example:8443/health?token=s") == "https://h.example:8443/health"


def passive_config(redis_url, **passive):
    data = small_config_data(redis_url)
    data["degradation"] = {"passive": {"failures": 3, "window_seconds": 10, "cooldown_seconds": 60, **passive}}
    return parse_config(data)


async def test_passive_failures_in_the_window_degrade_for_a_cooldown(redis_client, redis_url):
    config = passive_config(redis_url)
    flags = DegradedFlags(redis_client, config)
    monitor = HealthMonitor(config, redis_client, flags)
    assert [await monitor.record_failure("iris-1", "m", "status 503") for _ in range(3)] == [False, False, True]
    assert flags.is_degraded("iris-1", "m")
    (flag,) = await pair_flags(redis_client, config, "iris-1", "m")
    assert flag.source == PASSIVE and flag.reason.startswith("passive: 3 upstream failures within 10 s")
    assert 50 < flag.ttl_seconds <= 60
    assert await redis_client.exists("{t:m}:failures:iris-1") == 0  # the next cool-down needs fresh failures


async def test_passive_window_forgets_old_failures(redis_client, redis_url):
    config = passive_config(redis_url, window_seconds=0.05)
    monitor = HealthMonitor(config, redis_client, DegradedFlags(redis_client, config))
    for _ in range(4):
        assert not await monitor.record_failure("iris-1", "m", "status 500")
        await asyncio.sleep(0.06)


async def test_passive_ignores_successes_client_errors_and_unlimited_providers(redis_client, redis_url):
    config = passive_config(redis_url, failures=1)
    monitor = HealthMonitor(config, redis_client, DegradedFlags(redis_client, config))
    monitor.observe(config.provider("iris-1"), "m", 200)
    monitor.observe(config.provider("iris-1"), "m", 429)
    monitor.observe(config.provider("iris-1"), "m", None)
    monitor.observe(config.provider("tensorx"), "m", 503)
    await monitor.close()
    assert await redis_client.keys("*") == []


async def test_connect_failure_degrades_the_pair_at_once_until_its_next_success(redis_client, redis_url):
    config = parse_config(small_config_data(redis_url, degradation={"connect": {"ttl_seconds": 20}}))
    flags, other = DegradedFlags(redis_client, config), DegradedFlags(redis_client, config)
    monitor = HealthMonitor(config, redis_client, flags)
    await monitor.connection_failed(config.provider("iris-1"), "m", "upstream_reset_before_response_started{connection_failure}")
    assert flags.flags("iris-1", "m") == {CONNECT: "connect: upstream_reset_before_response_started{connection_failure}"}
    assert not flags.is_degraded("iris-1", "e") and not flags.is_degraded("iris-2", "m")  # that pair only
    (flag,) = await pair_flags(redis_client, config, "iris-1", "m")
    assert flag.source == CONNECT and 10 < flag.ttl_seconds <= 20
    await other.refresh()
    assert other.flags("iris-1", "m") == flags.flags("iris-1", "m")  # shared
    monitor.succeeded(config.provider("iris-1"), "e")  # another pair's success clears nothing
    monitor.succeeded(config.provider("iris-1"), "m")
    for _ in range(500):  # the clear runs in the background
        if not flags.is_degraded("iris-1", "m"):
            break
        await asyncio.sleep(0.01)
    await monitor.close()
    assert not flags.is_degraded("iris-1", "m")
    assert await redis_client.keys("*degraded*") == []


async def test_connect_failure_of_an_unlimited_provider_or_when_disabled_sets_nothing(redis_client, redis_url):
    for data in (small_config_data(redis_url), small_config_data(redis_url, degradation={"connect": {"enabled": False}})):
        config = parse_config(data)
        monitor = HealthMonitor(config, redis_client, DegradedFlags(redis_client, config))
        await monitor.connection_failed(config.provider("tensorx"), "m", "upstream_reset_before_response_started")
    await monitor.connection_failed(config.provider("iris-1"), "m", "upstream_reset_before_response_started")
    assert await redis_client.keys("*") == []


def test_checks_on_unlimited_providers_and_bad_credentials_are_rejected():
    data = small_config_data()
    data["providers"][2]["health_check"] = {"url": "http://127.0.0.1:1/health"}
    data["providers"][2]["credentials"] = {"api_key_env": "A", "api_key_file": "/f"}
    data["providers"][0]["load"] = {"url": "http://x/metrics", "metric": "g", "threshold": 1, "recover_below": 2}
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert info.value.problems == [
        "providers[0].load.recover_below: must be <= threshold (1)",
        "providers[2].credentials: set exactly one of api_key_env or api_key_file",
        "providers[2].health_check: an unlimited provider is never degraded (the spec)",
    ]


async def test_unsupported_feature_rejection_names_the_feature(redis_client, small_config):
    router = Router(small_config, RoutingState(redis_client, small_config), DegradedFlags(redis_client, small_config))
    vision = await router.execute_request(RoutingRequest("m", "chat", frozenset({"vision", "tools"}), "s"))
    assert vision.kind is RejectionKind.UNSUPPORTED
    assert vision.message == "model 'm' does not support vision: no provider serves it with vision"
    assert vision.param == "messages"
    embeddings = await router.execute_request(RoutingRequest("m", "embeddings", frozenset(), None))
    assert "does not support embeddings" in embeddings.message


async def test_unsupported_combination_is_named(redis_client, redis_url):
    data = small_config_data(redis_url)
    data["providers"][1]["models"]["m"]["features"] = ["chat", "vision"]
    data["providers"][2]["models"]["m"]["features"] = ["chat"]
    config = parse_config(data)
    router = Router(config, RoutingState(redis_client, config), DegradedFlags(redis_client, config))
    both = await router.execute_request(RoutingRequest("m", "chat", frozenset({"vision", "tools"}), "s"))
    assert both.message == "model 'm' does not support chat and tools and vision together: no provider serves that combination"


async def test_a_stale_load_signal_fails_closed_until_a_reading_comes_back(redis_client, redis_url):
    """stale_after_seconds: no reading for that long counts as saturated (llm-d's picker does the
    same); the first reading under every threshold clears it."""
    from aiohttp import web

    from irislab.processes import free_port

    port = free_port()
    data = small_config_data(redis_url)
    data["providers"][0]["load"] = {"url": f"http://127.0.0.1:{port}/metrics", "preset": "llamacpp",
                                    "interval_seconds": 0.05, "timeout_seconds": 1, "stale_after_seconds": 0.3}
    config = parse_config(data)
    flags = DegradedFlags(redis_client, config)
    monitor = HealthMonitor(config, redis_client, flags)
    monitor.start()
    try:
        await refreshed_until(flags, lambda: flags.is_degraded("iris-1", "m"))
        assert flags.flags("iris-1", "m")[LOAD].startswith("load: no reading of http://127.0.0.1:")
        assert flags.is_degraded("iris-1", "e") and not flags.is_degraded("iris-2", "m")

        async def metrics(request):
            return web.Response(text="llamacpp:requests_deferred 0\n")

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            # One reading clears the models one after the other: wait for both.
            await refreshed_until(flags, lambda: not flags.is_degraded("iris-1", "m") and not flags.is_degraded("iris-1", "e"))
            assert not flags.is_degraded("iris-1", "m") and not flags.is_degraded("iris-1", "e")
        finally:
            await runner.cleanup()
    finally:
        await monitor.close()


async def refreshed_until(flags: DegradedFlags, condition, within_seconds: float = 30.0) -> None:
    """Refresh `flags` until `condition()` holds, for `within_seconds` at most (then return: the
    caller's assertion says what did not happen)."""
    deadline = asyncio.get_running_loop().time() + within_seconds
    while asyncio.get_running_loop().time() < deadline:
        await flags.refresh()
        if condition():
            return
        await asyncio.sleep(0.01)
