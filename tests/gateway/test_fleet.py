"""Several proxies, real load, real faults (issue 5): three Envoy + ext_proc instances share one
Redis; the limits hold, nothing leaks, and outages behave as the configured policy says."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
import redis

from tests.support.fleet import LoadPlan, pinned_providers_per_session, run_load
from tests.support.gateway import (
    LIMITS,
    MODEL,
    clear_routing_state,
    gateway_config,
    provider_stats,
    start_gateway,
    wait_for_instances_to_know_each_other,
    wait_for_no_leases,
)

ENVOY_MESSAGE_TIMEOUT_SECONDS = 5.0  # envoy/envoy.yaml: no request may wait on routing longer


def own_provider_peaks(gateway) -> dict[str, int]:
    return {name: provider_stats(gateway, name)["max_in_flight_by_model"].get(MODEL, 0) for name in ("iris-1", "iris-2")}


def wait_until_pinning(gateway, within_seconds: float) -> bool:
    """Whether every instance pins new sessions again before `within_seconds` pass."""
    deadline = time.monotonic() + within_seconds
    pending = set(range(len(gateway.running)))
    attempt = 0
    while pending and time.monotonic() < deadline:
        for index in list(pending):
            attempt += 1
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"probe {attempt}"}], "max_tokens": 1}
            response = httpx.post(f"{gateway.running[index].url}/v1/chat/completions", json=body, timeout=10)
            if response.headers.get("x-iris-route-reason") == "new_pin":
                pending.discard(index)
        time.sleep(0.1)
    return not pending


def run_in_thread(coro_factory):
    """Run an asyncio load in a thread so the test can inject faults meanwhile."""
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("result", asyncio.run(coro_factory())))
    thread.start()
    return thread, box


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    gateway = start_gateway(tmp_path_factory.mktemp("fleet"), instances=3)
    yield gateway
    gateway.stop()


def test_load_over_three_instances_holds_every_limit(fleet):
    clear_routing_state(redis.Redis.from_url(fleet.redis_url))
    plan = LoadPlan(requests=2000, sessions=200, concurrency=24, stream_share=0.5, abort_share=0.1)
    result = asyncio.run(run_load([i.url for i in fleet.running], plan))
    records = result.records

    assert len(records) == 2000
    assert len({r.session for r in records}) >= 200 * 0.95
    assert sum(r.abort for r in records) >= 0.1 * 0.5 * 2000 * 0.7
    assert result.server_errors() == [], result.server_errors()[:5]
    assert [r for r in records if r.transport_error and not r.abort] == []
    # Every limit was hit: overflow reached iris-2 and the third party, and sessions offloaded.
    reasons = {r.reason for r in records}
    assert {"new_pin", "pinned", "offloaded"} <= reasons
    assert {r.provider for r in records if r.status == 200} == {"iris-1", "iris-2", "tensorx"}
    # The providers' own counters: never more concurrent requests than the limits allow.
    for provider, peak in own_provider_peaks(fleet).items():
        assert peak <= LIMITS["max_global_in_flight_request_slots"], (provider, peak)
    # One provider per session, apart from temporary offloads.
    assert all(len(p) == 1 for p in pinned_providers_per_session(records).values())
    # Nothing leaks: every lease is released, none left to expire.
    assert wait_for_no_leases(redis.Redis.from_url(fleet.redis_url), within_seconds=1.0) == 0


def test_sigkill_of_one_extproc_server(tmp_path):
    gateway = start_gateway(tmp_path, instances=3, lease_timeout_seconds=2)
    try:
        plan = LoadPlan(requests=600, sessions=60, concurrency=12, stream_share=1.0, abort_share=0.0, max_tokens=20)
        thread, box = run_in_thread(lambda: run_load([i.url for i in gateway.running], plan))
        time.sleep(1.0)
        killed_at = time.monotonic()
        gateway.running[0].extproc.kill()
        thread.join(timeout=120)
        records = box["result"].records
        survivors = [r for r in records if r.instance != 0]
        assert survivors and all(r.status == 200 for r in survivors), {r.status for r in survivors}
        # The dead server's clients fail closed (Envoy answers 500), nothing else fails.
        after = [r for r in records if r.instance == 0 and r.started > killed_at + 0.1]
        assert after and all(r.status == 500 or r.transport_error for r in after)
        assert "not-openai-error" not in {r.error_code for r in after}
        # Its leases stop counting within the lease timeout (2 s), without any release.
        assert wait_for_no_leases(redis.Redis.from_url(gateway.redis_url), within_seconds=2.0 + 1.0) == 0
        # Its sessions keep their pins: the pins it made still route the others' requests.
        assert all(len(p) == 1 for p in pinned_providers_per_session(records).values())
    finally:
        gateway.stop()


@pytest.mark.parametrize("policy", ["fail_closed", "degrade"])
def test_redis_outage_follows_the_policy_and_recovers(tmp_path, policy):
    data = gateway_config()
    limits = {**LIMITS, "max_global_in_flight_request_slots": 8, "global_in_flight_request_slots_reserved_for_pinned_sessions": 2}
    for provider in data["providers"][:2]:
        provider["models"][MODEL]["limits"] = limits
    gateway = start_gateway(tmp_path, instances=3, redis=dict(data["redis"], outage_policy=policy), providers=data["providers"])
    try:
        assert wait_for_instances_to_know_each_other(gateway)  # each knows there are three
        plan = LoadPlan(requests=900, sessions=90, concurrency=12, stream_share=0.3, abort_share=0.0, max_tokens=4)
        thread, box = run_in_thread(lambda: run_load([i.url for i in gateway.running], plan))
        time.sleep(1.0)
        outage_start = time.monotonic()
        gateway.stop_redis()
        time.sleep(3.0)
        gateway.start_redis_again()
        outage_end = time.monotonic()
        thread.join(timeout=120)
        records = box["result"].records
        assert len(records) == 900
        assert all(r.ended - r.started < ENVOY_MESSAGE_TIMEOUT_SECONDS for r in records)
        assert [r for r in records if r.transport_error] == []
        during = [r for r in records if outage_start + 0.2 < r.started < outage_end - 0.2]
        assert during
        if policy == "fail_closed":
            explained = {(503, "routing_unavailable"), (200, None)}
            assert {(r.status, r.error_code) for r in during} <= explained
            assert any(r.status == 503 for r in during)
        else:
            assert all(r.status == 200 for r in during), {(r.status, r.error_code) for r in during}
            assert all(r.reason == "unpinned" for r in during if r.started > outage_start + 0.5)
        assert [r for r in records if r.status and r.status >= 500 and r.error_code != "routing_unavailable"] == []
        for provider, peak in own_provider_peaks(gateway).items():
            assert peak <= limits["max_global_in_flight_request_slots"], (provider, peak)
        # Shared routing resumes by itself: within a few probe intervals sessions are pinned again.
        assert wait_until_pinning(gateway, within_seconds=10.0)
        after = asyncio.run(run_load([i.url for i in gateway.running], LoadPlan(requests=150, sessions=30, concurrency=6, seed=9)))
        assert {r.status for r in after.records} == {200}
        assert {r.reason for r in after.records} >= {"new_pin", "pinned"}
        assert wait_for_no_leases(redis.Redis.from_url(gateway.redis_url), within_seconds=1.0) == 0
    finally:
        gateway.stop()


def test_script_flush_mid_load_is_invisible(fleet):
    client = redis.Redis.from_url(fleet.redis_url)
    client.flushall()
    plan = LoadPlan(requests=600, sessions=60, concurrency=12, stream_share=0.3, abort_share=0.0)
    thread, box = run_in_thread(lambda: run_load([i.url for i in fleet.running], plan))
    for _ in range(5):
        time.sleep(0.2)
        client.script_flush()
    thread.join(timeout=120)
    records = box["result"].records
    assert len(records) == 600
    assert {r.status for r in records} == {200}
    assert wait_for_no_leases(client, within_seconds=1.0) == 0
