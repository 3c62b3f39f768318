"""Degradation shared by all proxies, end to end: two Envoy + ext_proc instances share one Redis;
health checks every 0.2 s, degraded flags refreshed every 0.1 s. Every wait is a bounded poll;
the assertions are on counts and states, never on elapsed time."""

from __future__ import annotations

import itertools

import httpx
import pytest

from extproc import cli
from irislab.local_gateway import LocalGateway, ProviderSimulation
from tests.support.gateway import MODEL, chat_body, clear_routing_state, post, provider_stats, redis_client, wait_until

INTERVAL = 0.2
FAILURES_BEFORE_DEGRADED = 2
SUCCESSES_BEFORE_HEALTHY = 2
INSTANCES = 2
BOUND = 5.0  # seconds any single poll may take before the test fails
_users = itertools.count()


def health_check() -> dict:
    return {
        "url": "http://127.0.0.1:1/health",  # LocalGateway points it at the simulator
        "interval_seconds": INTERVAL,
        "timeout_seconds": 0.5,
        "failures_before_degraded": FAILURES_BEFORE_DEGRADED,
        "successes_before_healthy": SUCCESSES_BEFORE_HEALTHY,
    }


def degradation_config() -> dict:
    return {
        "redis": {"key_prefix": "deg"},
        "session": {"trusted_identity_headers": ["x-user-id"]},  # the test stands in for an authenticating filter
        "server": {"expose_routing_headers": True, "degraded_refresh_seconds": 0.1},
        "degradation": {"passive": {"failures": 3, "window_seconds": 30, "cooldown_seconds": 60}},
        "providers": [
            {"name": "iris-1", "kind": "managed", "cluster": "iris-1", "health_check": health_check(),
             "models": {MODEL: {"features": ["chat", "completions"]}}},
            {"name": "iris-2", "kind": "managed", "cluster": "iris-2", "health_check": health_check(),
             "load": {"url": "http://127.0.0.1:1/metrics", "metric": "vllm:num_requests_waiting",
                      "model_label": "model_name", "threshold": 10, "recover_below": 2, "interval_seconds": INTERVAL},
             "models": {MODEL: {"features": ["chat", "completions"]}}},
            {"name": "tensorx", "kind": "unlimited", "cluster": "tensorx",
             "models": {MODEL: {"features": ["chat", "completions"]}}},
        ],
    }


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    sim = ProviderSimulation(ttft_ms=2, per_token_ms=1, block_tokens=8)
    gw = LocalGateway(config_data=degradation_config(), instances=INSTANCES, default_simulation=sim,
                      work_dir=tmp_path_factory.mktemp("degradation"))
    gw.__enter__()
    yield gw
    gw.stop()


def control(gw, provider: str, path: str, body: dict | None = None) -> None:
    httpx.post(f"{gw.provider_url(provider)}{path}", json=body, timeout=5).raise_for_status()


def unpinned_provider(gw, instance: int) -> str:
    """Where a request without a session (empty prompt) goes now: routing state unchanged."""
    response = post(gw, "/v1/completions", instance=instance, json={"model": MODEL, "prompt": "", "max_tokens": 1})
    return response.headers["x-iris-provider"]


@pytest.fixture
def gw(gateway):
    """Healthy simulators, every checker back to healthy, empty routing state."""
    for name in ("iris-1", "iris-2"):
        control(gateway, name, "/control/health", {"healthy": True})
        control(gateway, name, "/control/load", {"waiting": 0, "model": MODEL})
    for name in gateway.providers:
        control(gateway, name, "/control/clear")
        control(gateway, name, "/stats/reset")
    # Each instance needs successes_before_healthy checks to forget a failing streak.
    enough = INSTANCES * (SUCCESSES_BEFORE_HEALTHY + 1)
    assert wait_until(lambda: all(provider_stats(gateway, n)["health_checks"] >= enough for n in ("iris-1", "iris-2")), BOUND)
    clear_routing_state(redis_client(gateway))
    for instance in range(INSTANCES):
        assert wait_until(lambda: unpinned_provider(gateway, instance) == "iris-1", BOUND)
    for name in gateway.providers:
        control(gateway, name, "/stats/reset")
    return gateway


def failed_checks_from(gw, client: str) -> int:
    return provider_stats(gw, "iris-1")["health_checks_failed_by_client"].get(client, 0)


def new_session(gw, instance: int = 0) -> tuple[str, str]:
    """A request of a new session: (provider, reason)."""
    response = post(gw, "/v1/chat/completions", user=f"user-{next(_users)}", instance=instance, json=chat_body("hi"))
    assert response.status_code == 200, response.text
    return response.headers["x-iris-provider"], response.headers["x-iris-route-reason"]


def status(gw, capsys) -> dict[str, str]:
    """`iris-extproc status`, as provider -> its line for MODEL."""
    capsys.readouterr()
    assert cli.main(["status", "--config", str(gw.running[0].config_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    return {line.split()[0]: line for line in lines[1:] if line.split()[2] == MODEL}


def test_failing_health_check_moves_new_and_pinned_sessions_and_recovery_brings_new_ones_back(gw, capsys):
    alice = post(gw, "/v1/chat/completions", user="alice", json=chat_body("hello"))
    assert (alice.headers["x-iris-provider"], alice.headers["x-iris-route-reason"]) == ("iris-1", "new_pin")

    control(gw, "iris-1", "/control/health", {"healthy": False})
    # A checker probes again only after writing its last result, so once instance 0's checker has
    # had more than failures_before_degraded failed probes answered, instance 0 must avoid iris-1:
    # new sessions leave within failures_before_degraded check intervals (two here).
    for _ in range(int(BOUND / 0.01)):
        failed_before = failed_checks_from(gw, "extproc-0")
        provider, _ = new_session(gw)
        if provider != "iris-1":
            break
        assert failed_before <= FAILURES_BEFORE_DEGRADED
    assert provider == "iris-2"
    failed_checks = provider_stats(gw, "iris-1")["health_checks_failed"]
    assert failed_checks >= FAILURES_BEFORE_DEGRADED  # the checks did it
    served_before = provider_stats(gw, "iris-1")["requests"]
    assert new_session(gw) == ("iris-2", "new_pin")
    assert wait_until(lambda: new_session(gw, instance=1)[0] == "iris-2", BOUND)

    moved = post(gw, "/v1/chat/completions", user="alice", instance=1, json=chat_body("hello"))
    assert (moved.headers["x-iris-provider"], moved.headers["x-iris-route-reason"]) == ("iris-2", "repinned")
    line = status(gw, capsys)["iris-1"]
    assert " degraded " in line and f"health: GET {gw.provider_url('iris-1')}/health -> 503" in line
    assert provider_stats(gw, "iris-1")["requests"] == served_before  # nothing reached it while degraded

    control(gw, "iris-1", "/control/health", {"healthy": True})
    assert wait_until(lambda: new_session(gw) == ("iris-1", "new_pin"), BOUND)
    assert provider_stats(gw, "iris-1")["health_checks"] - failed_checks >= SUCCESSES_BEFORE_HEALTHY
    assert wait_until(lambda: new_session(gw, instance=1) == ("iris-1", "new_pin"), BOUND)
    again = post(gw, "/v1/chat/completions", user="alice", json=chat_body("hello"))
    assert (again.headers["x-iris-provider"], again.headers["x-iris-route-reason"]) == ("iris-2", "pinned")
    assert " healthy" in status(gw, capsys)["iris-1"]


def test_burst_of_upstream_failures_degrades_through_the_passive_path(gw, capsys):
    control(gw, "iris-1", "/control/fail", {"mode": "reset", "count": 1})
    reset = post(gw, "/v1/chat/completions", user="p", json=chat_body("x"))
    assert (reset.status_code, reset.headers["x-iris-provider"]) == (503, "iris-1")  # Envoy: reset before headers
    assert reset.json()["error"]["code"] == "upstream_unavailable" and "retry-after" in reset.headers
    # The reset degraded iris-1 at once (connect); its next healthy check clears that, on both instances.
    for instance in range(INSTANCES):
        assert wait_until(lambda: new_session(gw, instance) == ("iris-1", "new_pin"), BOUND)
    control(gw, "iris-1", "/control/fail", {"status": 502, "count": 2})
    for _ in range(2):
        failed = post(gw, "/v1/chat/completions", user="p", json=chat_body("x"))
        assert (failed.status_code, failed.headers["x-iris-provider"]) == (502, "iris-1")

    # Recorded by instance 0, avoided by instance 1 too.
    assert wait_until(lambda: new_session(gw, instance=1)[0] == "iris-2", BOUND)
    moved = post(gw, "/v1/chat/completions", user="p", json=chat_body("x"))
    assert (moved.status_code, moved.headers["x-iris-provider"], moved.headers["x-iris-route-reason"]) == (
        200, "iris-2", "repinned"
    )
    line = status(gw, capsys)["iris-1"]
    assert "passive: 3 upstream failures within 30 s (last: status 502)" in line
    assert "health:" not in line
    outcomes = provider_stats(gw, "iris-1")["requests_by_status"]
    assert (outcomes["reset"], outcomes["502"]) == (1, 2)


def test_drain_moves_new_traffic_at_once_and_outlives_a_health_recovery(gw, capsys):
    config = str(gw.running[0].config_path)
    assert cli.main(["drain", "iris-1", "--config", config, "--reason", "kernel upgrade"]) == 0
    for instance in range(INSTANCES):
        assert wait_until(lambda: new_session(gw, instance)[0] == "iris-2", BOUND)
    line = status(gw, capsys)["iris-1"]
    assert " drained " in line and "manual: kernel upgrade" in line

    # The health check fails and recovers meanwhile: its recovery clears only its own flag.
    control(gw, "iris-1", "/control/health", {"healthy": False})
    assert wait_until(lambda: "health:" in status(gw, capsys)["iris-1"], BOUND)
    control(gw, "iris-1", "/control/health", {"healthy": True})
    assert wait_until(lambda: "health:" not in status(gw, capsys)["iris-1"], BOUND)
    assert " drained " in status(gw, capsys)["iris-1"]
    assert new_session(gw) == ("iris-2", "new_pin")

    assert cli.main(["undrain", "iris-1", "--config", config]) == 0
    assert wait_until(lambda: new_session(gw) == ("iris-1", "new_pin"), BOUND)
    assert " healthy" in status(gw, capsys)["iris-1"]


def test_load_gauge_over_its_threshold_degrades_until_it_falls_back(gw, capsys):
    config = str(gw.running[0].config_path)
    assert cli.main(["drain", "iris-1", "--config", config]) == 0
    assert wait_until(lambda: new_session(gw)[0] == "iris-2", BOUND)

    control(gw, "iris-2", "/control/load", {"waiting": 25, "model": MODEL})
    assert wait_until(lambda: new_session(gw) == ("tensorx", "new_pin"), BOUND)
    line = status(gw, capsys)["iris-2"]
    assert " degraded " in line and "load: vllm:num_requests_waiting=25 (degraded above 10, until <= 2)" in line

    control(gw, "iris-2", "/control/load", {"waiting": 1, "model": MODEL})
    assert wait_until(lambda: new_session(gw) == ("iris-2", "new_pin"), BOUND)
    assert " healthy" in status(gw, capsys)["iris-2"]


def test_unlimited_providers_are_never_degraded(gw, capsys):
    config = str(gw.running[0].config_path)
    for name in ("iris-1", "iris-2"):
        assert cli.main(["drain", name, "--config", config]) == 0
    assert wait_until(lambda: new_session(gw)[0] == "tensorx", BOUND)
    control(gw, "tensorx", "/control/fail", {"status": 503, "count": 5})
    for _ in range(5):
        failed = post(gw, "/v1/chat/completions", user="u", json=chat_body("x"))
        assert (failed.status_code, failed.headers["x-iris-provider"]) == (503, "tensorx")
    assert new_session(gw) == ("tensorx", "new_pin")
    with pytest.raises(SystemExit):
        cli.main(["drain", "tensorx", "--config", config])
    assert "unlimited: never degraded" in status(gw, capsys)["tensorx"]
    client = redis_client(gw)
    assert client.keys("*degraded:tensorx*") == [] and client.keys("*failures:tensorx*") == []
