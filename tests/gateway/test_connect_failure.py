"""A provider that refuses connections degrades its pair at once (source `connect`), end to end:
a pinned provider is SIGKILLed; the turn that meets the refused connection gets an OpenAI-style
503 with `retry-after`, and the next turn is repinned elsewhere. A healthy check of the provider,
once it is back, clears the flag. The active health check here never degrades on its own
(failures_before_degraded is out of reach), so only the connect source can move the session."""

from __future__ import annotations

import itertools

import httpx
import pytest

from irislab.local_gateway import LocalGateway, ProviderSimulation
from tests.support.gateway import MODEL, chat_body, post, redis_client, wait_until

BOUND = 10.0  # seconds any single poll may take before the test fails
CONNECT_FLAG = f"{{conn:{MODEL}}}:degraded:iris-1:connect"


def config() -> dict:
    never_by_health = {"url": "http://127.0.0.1:1/health", "interval_seconds": 0.2, "timeout_seconds": 0.5,
                       "failures_before_degraded": 1_000_000, "successes_before_healthy": 1}
    return {
        "redis": {"key_prefix": "conn"},
        "session": {"trusted_identity_headers": ["x-user-id"]},  # the tests stand in for an authenticating filter
        "server": {"expose_routing_headers": True, "degraded_refresh_seconds": 0.1, "retry_after_seconds": 2},
        "degradation": {"passive": {"failures": 1000}, "connect": {"ttl_seconds": 300}},
        "providers": [
            {"name": "iris-1", "kind": "managed", "cluster": "iris-1", "health_check": never_by_health,
             "models": {MODEL: {"features": ["chat"], "limits": {"max_pinned_sessions": 10}}}},
            {"name": "iris-2", "kind": "managed", "cluster": "iris-2",
             "models": {MODEL: {"features": ["chat"], "limits": {"max_pinned_sessions": 10}}}},
            {"name": "tensorx", "kind": "unlimited", "cluster": "tensorx", "models": {MODEL: {"features": ["chat"]}}},
        ],
    }


@pytest.fixture
def gateway(tmp_path):
    sim = ProviderSimulation(ttft_ms=2, per_token_ms=1, block_tokens=8)
    with LocalGateway(config_data=config(), default_simulation=sim, work_dir=tmp_path) as gw:
        yield gw


def turn(gw, user: str) -> httpx.Response:
    return post(gw, "/v1/chat/completions", user=user, json=chat_body("the same conversation"))


def test_second_turn_after_a_crash_is_repinned_and_a_healthy_check_clears_the_flag(gateway):
    client = redis_client(gateway)
    first = turn(gateway, "alice")
    assert first.status_code == 200, first.text
    assert (first.headers["x-iris-provider"], first.headers["x-iris-route-reason"]) == ("iris-1", "new_pin")

    gateway.providers["iris-1"].kill()
    met = turn(gateway, "alice")  # the first turn after the crash meets the refused connection
    assert met.status_code == 503
    assert met.headers["retry-after"] == "2"
    assert met.headers["content-type"] == "application/json"
    assert met.json()["error"]["code"] == "upstream_unavailable"  # Envoy's local reply (envoy.yaml)
    assert set(met.json()["error"]) == {"message", "type", "param", "code"}
    assert client.get(CONNECT_FLAG).decode().startswith("connect: upstream_reset_before_response_started")

    second = turn(gateway, "alice")
    assert second.status_code == 200, second.text
    assert (second.headers["x-iris-provider"], second.headers["x-iris-route-reason"]) == ("iris-2", "repinned")

    gateway.restart_provider("iris-1")
    assert wait_until(lambda: client.get(CONNECT_FLAG) is None, BOUND)
    users = itertools.count()
    assert wait_until(lambda: turn(gateway, f"new-{next(users)}").headers.get("x-iris-provider") == "iris-1", BOUND)
    assert turn(gateway, "alice").headers["x-iris-provider"] == "iris-2"  # alice stays where she moved
