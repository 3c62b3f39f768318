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
import orjson
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
             "models": {MODEL: {"features": ["chat", "responses"], "limits": limits, "max_in_flight_per_endpoint": CAP}}},
            {"name": "tensorx", "kind": "unlimited", "cluster": "tensorx", "models": {MODEL: {"features": ["chat", "responses"]}}},
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
    # Ties go by the lease id, which is random: 12 sessions miss one replica of 3 about 2 % of the time.
    assert len(set(home.values())) >= 2, "new sessions spread over the replicas"
    for endpoint in names:  # a replica saw requests iff it was a home, each with the router's pick, itself first
        seen = httpx.get(f"http://{endpoint}/stats", timeout=5).json()["last_request_headers"]
        assert bool(seen) == (endpoint in home.values()), endpoint
        assert all(h["x-gateway-destination-endpoint"].split(",")[0] == endpoint for h in seen)


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


def respond(client: httpx.Client, url: str, session: str, text: str, previous: str | None = None) -> httpx.Response:
    body = {"model": MODEL, "input": text, "max_output_tokens": 4, **({"previous_response_id": previous} if previous else {})}
    return client.post(f"{url}/v1/responses", json=body, headers={"x-session-id": session, **CHAIN_USER})


CHAIN_USER = {"authorization": "Bearer chain-user"}


def test_a_stored_response_stays_reachable_on_its_replica_under_load(pool):
    """Issue 30: a session's first response is stored on its replica A; slow requests then fill A
    to its cap, and the session's next response is placed on B (its pin moves there). Each
    response is found by id on the replica that stores it (the chain record's endpoint), and a
    turn chained to the first goes to A, over the session's pin and A's cap (the storing replica
    is the only one that can serve it), through either gateway. Before, these went by the hash
    of the session key or by the pin, to a replica that does not hold the response (404)."""
    names = replica_names(pool)
    for endpoint in names:
        httpx.post(f"http://{endpoint}/stats/reset", timeout=5)
    with httpx.Client(timeout=60) as client, concurrent.futures.ThreadPoolExecutor(CAP) as workers:
        first = respond(client, pool.running[0].url, "chain", "the first question")
        assert first.status_code == 200, first.text
        home = first.headers["x-iris-endpoint"]
        assert first.headers["x-simulator-name"] == names[home]
        loaders = []  # sessions whose first turn landed on A: their slow turns fill it to its cap
        for session in range(300, 340):
            if len(loaders) < CAP and chat(client, pool.running[0].url, session, 0).headers.get("x-iris-endpoint") == home:
                loaders.append(session)
        assert len(loaders) == CAP, "no session of 40 was placed on the first response's replica"
        slow = [workers.submit(chat, client, pool.running[i % 2].url, session, 1, None, 4000) for i, session in enumerate(loaders)]
        try:
            assert wait_until(lambda: httpx.get(f"http://{home}/stats", timeout=5).json()["in_flight"] == CAP, within_seconds=20)
            second = respond(client, pool.running[1].url, "chain", "the second question")
            assert second.status_code == 200, second.text
            moved = second.headers["x-iris-endpoint"]
            assert moved != home, "A at its cap: the session's next response is placed elsewhere"
            at_cap = respond(client, pool.running[1].url, "chain", "continue the first", first.json()["id"])
            assert at_cap.status_code == 200, at_cap.text
            assert at_cap.headers["x-simulator-name"] == names[home], "the chained turn reached the storing replica at its cap"
            assert httpx.get(f"http://{home}/stats", timeout=5).json()["max_in_flight"] <= CAP + 1
        finally:
            assert all(f.result().status_code == 200 for f in slow)
        for gateway in pool.running:
            for created, where in ((first, home), (second, moved)):
                response_id = created.json()["id"]
                found = client.get(f"{gateway.url}/v1/responses/{response_id}", headers=CHAIN_USER)
                assert found.status_code == 200, found.text
                assert found.headers["x-simulator-name"] == names[where] and found.json()["id"] == response_id
                items = client.get(f"{gateway.url}/v1/responses/{response_id}/input_items", headers=CHAIN_USER)
                assert items.status_code == 200, items.text
            chained = respond(client, gateway.url, "chain", "back to the first", first.json()["id"])
            assert chained.status_code == 200, chained.text
            assert chained.headers["x-simulator-name"] == names[home], "a chained turn goes to the storing replica, not the pin's"
        deleted = client.delete(f"{pool.running[0].url}/v1/responses/{second.json()['id']}", headers=CHAIN_USER)
        assert deleted.status_code == 200, deleted.text
        assert deleted.headers["x-simulator-name"] == names[moved]
    store = redis.Redis.from_url(pool.redis_url)
    try:  # every record names its replica: the first and the chained turns' on A, the deleted one gone
        records = [orjson.loads(store.get(key)) for key in store.keys("{pick:m}:response:*")]
    finally:
        store.close()
    assert len(records) == 4, records
    assert {r[2] for r in records} == {home}, records


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


@pytest.fixture
def named_pool(tmp_path):
    """The pool's endpoints as one DNS name (a headless Service's form): `localhost`, which
    resolves to the simulator's 127.0.0.1 (the lab puts the simulator's port on the name)."""
    data = pick_config()
    data["providers"][0]["endpoints"] = ["http://localhost:1"]
    data["routing"] = {"placement": {"dns_refresh_seconds": 0.5}}
    sim = ProviderSimulation(ttft_ms=1, per_token_ms=1)
    gateway = LocalGateway(config_data=data, default_simulation=sim, work_dir=tmp_path / "named")
    with gateway:
        yield gateway


def test_a_pool_named_by_dns_is_picked_by_address_through_a_strict_dns_cluster(named_pool):
    """The router resolves the name to its `ip:port` endpoints and picks among them; Envoy's
    cluster is STRICT_DNS over the same name (its hosts are the addresses Envoy resolved), and
    override_host reaches the picked address: every turn answers from the replica, named by
    address in `x-iris-endpoint`, while the refresh runs every 0.5 s."""
    port = named_pool.pools["iris-1"][0].port
    text = httpx.get(f"http://127.0.0.1:{named_pool.running[0].admin_port}/clusters", timeout=5).text
    assert f"iris-1::127.0.0.1:{port}::hostname::localhost" in text, "Envoy resolved the name to the replica's address"
    with httpx.Client(timeout=30) as client:
        for turn in range(3):
            for session in range(4):
                response = chat(client, named_pool.url, session, turn, {"x-gateway-destination-endpoint": "127.0.0.1:9"})
                assert response.status_code == 200, response.text
                assert response.headers["x-iris-provider"] == "iris-1"
                assert response.headers["x-iris-endpoint"] == f"127.0.0.1:{port}", "picked by the address the name resolves to"
    prefix = f"iris-1::127.0.0.1:{port}::rq_success::"
    stats = httpx.get(f"http://127.0.0.1:{named_pool.running[0].admin_port}/clusters", timeout=5).text
    assert any(line == prefix + "12" for line in stats.splitlines()), "each request reached the resolved host"
