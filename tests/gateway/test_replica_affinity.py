"""Affinity inside a provider (docs/operations.md "Real fleets"): a provider whose cluster has
several replicas keeps each session on one of them, so every turn meets the prefix cache of its
earlier turns; a replica that dies moves only its own sessions. Real Envoy (the shipped
envoy.yaml: a MAGLEV cluster and the route's hash policy on x-iris-affinity), real Redis, and a
pool of three simulated replicas whose `x-simulator-name` says which one answered."""

from __future__ import annotations

from collections import Counter

import httpx
import pytest

from irislab.local_gateway import LocalGateway, ProviderSimulation
from tests.support.gateway import wait_until

MODEL = "m"
REPLICAS = 3
SESSIONS = 30
TURNS = 6
BLOCK_TOKENS = 8


def pool_config() -> dict:
    limits = {"max_pinned_sessions": 1000, "max_global_in_flight_request_slots": 64}
    return {
        "redis": {"key_prefix": "pool"},
        "server": {"expose_routing_headers": True},
        "providers": [
            {"name": "iris-1", "kind": "managed", "cluster": "iris-1", "models": {MODEL: {"features": ["chat", "embeddings"], "limits": limits}}},
            {"name": "tensorx", "kind": "unlimited", "cluster": "tensorx", "models": {MODEL: {"features": ["chat", "embeddings"]}}},
        ],
    }


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    sim = ProviderSimulation(ttft_ms=1, per_token_ms=1, block_tokens=BLOCK_TOKENS)
    gateway = LocalGateway(config_data=pool_config(), replicas={"iris-1": REPLICAS}, default_simulation=sim,
                           work_dir=tmp_path_factory.mktemp("pool"))
    with gateway:
        yield gateway


def envoy_connections(gateway: LocalGateway, port: int) -> int:
    """Envoy's open connections to the replica on `port` (its admin /clusters page)."""
    text = httpx.get(f"http://127.0.0.1:{gateway.running[0].admin_port}/clusters", timeout=5).text
    prefix = f"iris-1::127.0.0.1:{port}::cx_active::"
    return next((int(line[len(prefix):]) for line in text.splitlines() if line.startswith(prefix)), 0)


def turn(client: httpx.Client, gateway: LocalGateway, session: int, history: list[dict]) -> tuple[str, dict]:
    """One chat turn of `session` (its messages so far in `history`, extended in place): the
    replica that answered and the usage it reported."""
    history.append({"role": "user", "content": f"session {session} asks question {len(history)} " + "word " * 12})
    body = {"model": MODEL, "messages": history, "max_tokens": 4}
    response = client.post(f"{gateway.url}/v1/chat/completions", json=body, headers={"x-session-id": f"s{session}"})
    assert response.status_code == 200, response.text
    assert response.headers["x-iris-provider"] == "iris-1"
    history.append(response.json()["choices"][0]["message"])
    return response.headers["x-simulator-name"], response.json()["usage"]


def test_every_session_keeps_one_replica_and_its_cache_and_a_dead_replica_moves_only_its_own(pool):
    histories: dict[int, list[dict]] = {s: [] for s in range(SESSIONS)}
    replica_of: dict[int, str] = {}
    last_prompt: dict[int, int] = {}  # prompt tokens of each session's previous turn

    def assert_cached(session: int, usage: dict) -> None:
        """Everything the previous turn's prompt held is cached, as on a provider of one replica
        (the simulator caches whole blocks of BLOCK_TOKENS words)."""
        assert usage["prompt_tokens_details"]["cached_tokens"] >= last_prompt[session] - BLOCK_TOKENS, (session, usage)

    with httpx.Client(timeout=30) as client:
        for number in range(TURNS):
            for session, history in histories.items():
                replica, usage = turn(client, pool, session, history)
                assert replica_of.setdefault(session, replica) == replica, f"session {session} moved on turn {number}"
                if number > 0:
                    assert_cached(session, usage)
                last_prompt[session] = usage["prompt_tokens"]
        spread = Counter(replica_of.values())
        assert set(spread) == {f"iris-1-r{i}" for i in range(REPLICAS)}, spread  # 30 sessions reach all three

        victim = pool.pools["iris-1"][0]
        victim.kill()
        # Envoy drops its idle keep-alive connections to the dead replica as it sees them close; a
        # request sent on one at that very instant would be reset after it was sent (a 503 the
        # retry policy must not repeat: docs/operations.md "Real fleets").
        assert wait_until(lambda: envoy_connections(pool, victim.port) == 0, within_seconds=10)
        moved_to: dict[int, str] = {}
        for number in range(2):
            for session, history in histories.items():
                replica, usage = turn(client, pool, session, history)
                assert replica != "iris-1-r0"
                if replica_of[session] != "iris-1-r0":
                    assert replica == replica_of[session], f"session {session} of a live replica moved"
                    assert_cached(session, usage)
                else:  # a moved session settles on one live replica: its second turn there is cached
                    assert moved_to.setdefault(session, replica) == replica
                    if number == 1:
                        assert_cached(session, usage)
                last_prompt[session] = usage["prompt_tokens"]
    assert moved_to and len(moved_to) == spread["iris-1-r0"]


def test_requests_without_a_session_spread_over_the_replicas(pool):
    """Embeddings never form a session: no affinity key, so the pool's balancer spreads them."""
    seen = Counter()
    with httpx.Client(timeout=30) as client:
        for i in range(30):
            response = client.post(f"{pool.url}/v1/embeddings", json={"model": MODEL, "input": f"text {i}"})
            assert response.status_code == 200, response.text
            seen[response.headers["x-simulator-name"]] += 1
    assert len(seen) >= 2, seen
