"""Affinity pick through real Envoy (docs/operations.md "Real fleets"): the router picks the
replica of every request and Envoy's override_host cluster (the bootstrap `envoy-config`
renders) sends it there; a client's own `x-gateway-destination-endpoint` is not honoured. Two
gateway instances (two Envoys, two ext_proc servers) on one Redis, a pool of three simulated
replicas whose `x-simulator-name` says which one answered, and whose /stats say how many
requests each carried at once."""

from __future__ import annotations

import concurrent.futures
from collections import Counter

import httpx
import pytest
import redis

from irislab.local_gateway import LocalGateway, ProviderSimulation
from tests.support.gateway import wait_until

MODEL = "m"
REPLICAS = 3
CAP = 2
SESSIONS = 12


def pick_config() -> dict:
    limits = {"max_pinned_sessions": 1000, "max_global_in_flight_request_slots": 64}
    return {
        "redis": {"key_prefix": "pick", "outage_policy": "local_share"},
        "server": {"expose_routing_headers": True},
        "providers": [
            # The endpoints are placeholders: the lab puts the simulated replicas there.
            {"name": "iris-1", "kind": "managed", "cluster": "iris-1", "affinity": "pick", "endpoints": ["http://127.0.0.1:1"],
             "models": {MODEL: {"features": ["chat"], "limits": limits, "max_in_flight_per_endpoint": CAP}}},
            {"name": "tensorx", "kind": "unlimited", "cluster": "tensorx", "models": {MODEL: {"features": ["chat"]}}},
        ],
    }


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    sim = ProviderSimulation(ttft_ms=1, per_token_ms=1)
    gateway = LocalGateway(config_data=pick_config(), instances=2, replicas={"iris-1": REPLICAS}, default_simulation=sim,
                           work_dir=tmp_path_factory.mktemp("pick"))
    with gateway:
        yield gateway


def replica_names(gateway: LocalGateway) -> dict[str, str]:
    """Each replica's endpoint (`ip:port`) -> its `x-simulator-name`."""
    return {f"127.0.0.1:{process.port}": f"iris-1-r{i}" for i, process in enumerate(gateway.pools["iris-1"])}


def chat(client: httpx.Client, url: str, session: int, turn: int, headers: dict[str, str] | None = None, tokens: int = 4) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"session {session} turn {turn} " + "word " * 20}],
            "max_tokens": tokens}
    return client.post(f"{url}/v1/chat/completions", json=body, headers={"x-session-id": f"s{session}", **(headers or {})})


def test_each_request_reaches_the_picked_endpoint_and_a_clients_pick_is_not_honoured(pool):
    names = replica_names(pool)
    home: dict[int, str] = {}
    with httpx.Client(timeout=30) as client:
        for turn in range(3):
            for session in range(SESSIONS):
                instance = pool.running[(session + turn) % 2]  # a session's turns alternate over the two gateways
                # From the second turn on, the client names another replica: the gateway ignores it.
                other = next(e for e in names if e != home.get(session))
                headers = {"x-gateway-destination-endpoint": other} if turn else None
                response = chat(client, instance.url, session, turn, headers)
                assert response.status_code == 200, response.text
                picked = response.headers["x-iris-endpoint"]
                assert response.headers["x-simulator-name"] == names[picked], "Envoy sent the request to the endpoint the router picked"
                assert home.setdefault(session, picked) == picked, f"session {session} left its endpoint on turn {turn}"
    assert len(set(home.values())) >= 2, "new sessions spread over the replicas (ties go round by the lease id)"
    for endpoint in names:  # each replica saw the router's pick, itself first, never the client's value
        seen = httpx.get(f"http://{endpoint}/stats", timeout=5).json()["last_request_headers"]
        assert seen and all(h["x-gateway-destination-endpoint"].split(",")[0] == endpoint for h in seen)


def test_no_replica_carries_more_than_its_cap(pool):
    """12 slow requests at once over both gateways: at most CAP per replica (6 in all), the rest
    go to the third party; every count is back to zero afterwards."""
    for process in pool.pools["iris-1"]:
        httpx.post(f"http://127.0.0.1:{process.port}/stats/reset", timeout=5)
    with httpx.Client(timeout=60) as client, concurrent.futures.ThreadPoolExecutor(12) as workers:
        futures = [workers.submit(chat, client, pool.running[i % 2].url, 100 + i, 0, None, 200) for i in range(12)]
        responses = [f.result() for f in futures]
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    served = Counter(r.headers["x-iris-provider"] for r in responses)
    assert served["iris-1"] >= REPLICAS * CAP - 1, served  # the pool was used up to its caps (one may finish early)
    peaks = [httpx.get(f"http://127.0.0.1:{p.port}/stats", timeout=5).json()["max_in_flight"] for p in pool.pools["iris-1"]]
    assert max(peaks) <= CAP, peaks
    store = redis.Redis.from_url(pool.redis_url)
    try:
        def running() -> int:  # live leases per endpoint (a key whose last lease left is gone)
            now_ms = store.time()[0] * 1000
            return sum(store.zcount(k, f"({now_ms}", "+inf") for k in store.keys("{pick:m}:endpoint-leases:*"))

        assert wait_until(lambda: running() == 0, within_seconds=10)
    finally:
        store.close()


def test_without_redis_the_hash_places_and_a_clients_pick_is_still_not_honoured(pool):
    """Redis gone (local_share): leases are granted without a pick, so no destination header
    goes to Envoy and override_host falls back to MAGLEV on the session key; a client's own
    header naming one replica is stripped, so 12 sessions still spread by the hash. Last in
    the module: it stops the gateway's Redis (and starts an empty one again)."""
    names = replica_names(pool)
    target = next(iter(names))
    pool.stop_redis()
    try:
        served: dict[int, str] = {}
        with httpx.Client(timeout=30) as client:
            for session in range(200, 200 + SESSIONS):
                response = chat(client, pool.running[0].url, session, 0, {"x-gateway-destination-endpoint": target})
                assert response.status_code == 200, response.text
                assert response.headers["x-iris-provider"] == "iris-1" and "x-iris-endpoint" not in response.headers
                served[session] = response.headers["x-simulator-name"]
                again = chat(client, pool.running[0].url, session, 1, {"x-gateway-destination-endpoint": target})
                assert again.headers["x-simulator-name"] == served[session], "the fallback hash keeps the session's replica"
        assert len(set(served.values())) > 1, f"every session went to the client's pick {names[target]}: {served}"
    finally:
        pool.start_redis_again()


@pytest.fixture
def lone_pool(tmp_path):
    sim = ProviderSimulation(ttft_ms=1, per_token_ms=1)
    gateway = LocalGateway(config_data=pick_config(), replicas={"iris-1": REPLICAS}, default_simulation=sim, work_dir=tmp_path / "pick")
    with gateway:
        yield gateway


def test_a_dead_replicas_sessions_are_served_by_the_next_endpoint_of_the_pick(lone_pool):
    """A killed replica's connection is refused and the route's retry policy takes the next
    endpoint of the pick's list (nothing was sent, nothing is generated twice); the server then
    takes the dead endpoint out (test_endpoint_health_through_envoy). The other sessions keep
    their replica."""
    home: dict[int, str] = {}
    with httpx.Client(timeout=30) as client:
        for session in range(SESSIONS):
            response = chat(client, lone_pool.url, session, 0)
            assert response.status_code == 200, response.text
            home[session] = response.headers["x-simulator-name"]
        index = int(home[0].rsplit("-r", 1)[1])  # session 0's replica dies
        victim, dead = lone_pool.pools["iris-1"][index], home[0]
        victim.kill()
        assert wait_until(lambda: envoy_connections(lone_pool, victim.port) == 0, within_seconds=10)
        for session in range(SESSIONS):
            response = chat(client, lone_pool.url, session, 1)
            assert response.status_code == 200, response.text
            served = response.headers["x-simulator-name"]
            assert served != dead
            if home[session] != dead:
                assert served == home[session], f"session {session} of a live replica moved"


def envoy_connections(gateway: LocalGateway, port: int) -> int:
    """Envoy's open connections to the replica on `port` (its admin /clusters page)."""
    text = httpx.get(f"http://127.0.0.1:{gateway.running[0].admin_port}/clusters", timeout=5).text
    prefix = f"iris-1::127.0.0.1:{port}::cx_active::"
    return next((int(line[len(prefix):]) for line in text.splitlines() if line.startswith(prefix)), 0)
