"""Endpoint health for affinity pick through real Envoy (issue 30 item 5, docs/operations.md
"Endpoint health"): a pool of three simulated replicas behind Envoy's override_host cluster; one
replica is killed while sessions run their turns over two gateway instances. Envoy's route retries
the refused connection on the pick's next endpoint and tells the server which host answered
(`upstream.address`); the server takes the dead endpoint out in Redis, so every proxy's next
placement avoids it: its sessions move (their pins' endpoint changes) and only they do. A request
Envoy retried on another endpoint counts there while it runs, and its stored response is found
there by id."""

from __future__ import annotations

import concurrent.futures
import threading

import httpx
import orjson
import pytest
import redis

from irislab.local_gateway import LocalGateway, ProviderSimulation
from tests.support.gateway import wait_until

MODEL = "m"
REPLICAS = 3
SESSIONS = 12
WORKERS = 4


def health_config() -> dict:
    limits = {"max_pinned_sessions": 1000, "max_global_in_flight_request_slots": 64}
    return {
        "redis": {"key_prefix": "health", "outage_policy": "local_share"},
        "server": {"expose_routing_headers": True},
        # Long enough that the flag still holds when the test looks (it renews at every failure).
        "degradation": {"connect": {"ttl_seconds": 120}},
        "providers": [
            {"name": "iris-1", "kind": "managed", "cluster": "iris-1", "affinity": "pick", "endpoints": ["http://127.0.0.1:1"],
             "models": {MODEL: {"features": ["chat", "responses"], "limits": limits}}},
            {"name": "tensorx", "kind": "unlimited", "cluster": "tensorx", "models": {MODEL: {"features": ["chat", "responses"]}}},
        ],
    }


@pytest.fixture
def pool(tmp_path):
    sim = ProviderSimulation(ttft_ms=5, per_token_ms=5)
    gateway = LocalGateway(config_data=health_config(), instances=2, replicas={"iris-1": REPLICAS}, default_simulation=sim,
                           work_dir=tmp_path / "health")
    with gateway:
        yield gateway


def chat(client: httpx.Client, url: str, session: int, turn: int) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"session {session} turn {turn} " + "word " * 20}],
            "max_tokens": 8}
    return client.post(f"{url}/v1/chat/completions", json=body, headers={"x-session-id": f"s{session}"})


def endpoints(gateway: LocalGateway) -> dict[str, str]:
    """Each replica's `x-simulator-name` -> its endpoint (`ip:port`)."""
    return {f"iris-1-r{i}": f"127.0.0.1:{process.port}" for i, process in enumerate(gateway.pools["iris-1"])}


@pytest.mark.slow
def test_a_killed_replica_moves_only_its_sessions(pool):
    names = endpoints(pool)
    home: dict[int, str] = {}  # session -> the endpoint its pin records
    with httpx.Client(timeout=30) as client:
        for session in range(SESSIONS):
            response = chat(client, pool.running[session % 2].url, session, 0)
            assert response.status_code == 200, response.text
            home[session] = response.headers["x-iris-endpoint"]
            assert names[response.headers["x-simulator-name"]] == home[session]
        dead = home[0]  # session 0's replica dies
        victim = next(p for p in pool.pools["iris-1"] if f"127.0.0.1:{p.port}" == dead)
        for process in pool.pools["iris-1"]:
            httpx.post(f"http://127.0.0.1:{process.port}/stats/reset", timeout=5)

        # Turns 1..3 of every session over both gateways, WORKERS at once; the replica is killed
        # once some of them have been answered, so requests run across the kill.
        answered = threading.Event()
        done: list[tuple[int, int, httpx.Response]] = []

        def turn(session: int, number: int) -> None:
            response = chat(client, pool.running[(session + number) % 2].url, session, number)
            done.append((session, number, response))
            if len(done) >= WORKERS:
                answered.set()

        with concurrent.futures.ThreadPoolExecutor(WORKERS) as workers:
            futures = [workers.submit(turn, s, n) for n in (1, 2, 3) for s in range(SESSIONS)]
            assert answered.wait(30)
            victim.kill()
            for future in futures:
                future.result()
        # A request the replica was generating when it died is lost (something was sent: never
        # retried); only the dead replica's sessions can meet that, at most one per worker.
        failed = [(s, r.status_code) for s, _, r in done if r.status_code != 200]
        assert all(home[s] == dead and code == 503 for s, code in failed), failed
        assert len(failed) <= WORKERS, failed
        assert len(done) == 3 * SESSIONS
        # Turn 4, after the kill: the dead replica's sessions have moved (the router picks a live
        # endpoint and Envoy sends them there), every other session kept its endpoint.
        for session in range(SESSIONS):
            response = chat(client, pool.running[session % 2].url, session, 4)
            assert response.status_code == 200, response.text
            picked, served = response.headers["x-iris-endpoint"], names[response.headers["x-simulator-name"]]
            assert picked == served, f"session {session}: picked {picked}, answered by {served}"
            if home[session] == dead:
                assert picked != dead, f"session {session} is still placed on the killed replica"
            else:
                assert picked == home[session], f"session {session} of a live replica moved"

    live = [p for p in pool.pools["iris-1"] if p is not victim]
    served = [httpx.get(f"http://127.0.0.1:{p.port}/stats", timeout=5).json() for p in live]
    assert all(s["max_in_flight"] <= WORKERS for s in served), served
    store = redis.Redis.from_url(pool.redis_url)
    try:
        flags = {k.decode(): v.decode() for k, v in store.hgetall("{health:m}:endpoint-health:iris-1").items()}
        assert f"{dead} connect" in flags, flags
        assert all(field.startswith(dead) for field in flags), "only the killed replica is out"

        def running_on(endpoint: str) -> int:
            now_ms = store.time()[0] * 1000
            return store.zcount(f"{{health:m}}:endpoint-leases:iris-1:{endpoint}", f"({now_ms}", "+inf")

        assert wait_until(lambda: sum(running_on(e) for e in names.values()) == 0, within_seconds=10)
    finally:
        store.close()


CHAIN_USER = {"authorization": "Bearer chain-user"}


def running_on(store: redis.Redis, endpoint: str) -> int:
    """Live leases Redis counts on `endpoint` (`ip:port`) of iris-1."""
    now_ms = store.time()[0] * 1000
    return store.zcount(f"{{health:m}}:endpoint-leases:iris-1:{endpoint}", f"({now_ms}", "+inf")


@pytest.mark.slow
def test_a_request_retried_on_another_replica_counts_and_is_stored_there(pool):
    """The session's replica is killed; its next turn (a slow streamed Responses request) is still
    picked there (nothing has failed yet), Envoy's retry serves it on the pick's next endpoint,
    and from the response headers on the lease counts on the endpoint that answered, not on the
    picked one (issue 30's closing note), and its prefix index learns the prompt;
    `x-iris-endpoint` and the chain record name the endpoint that answered, so the response is
    found there by id. Once it ends no lease is live."""
    names = endpoints(pool)
    url = pool.running[0].url
    store = redis.Redis.from_url(pool.redis_url)
    with httpx.Client(timeout=30) as client:
        prompt = "hello " * 200  # a few blocks of the placement's prefix index
        first = client.post(f"{url}/v1/responses", json={"model": MODEL, "input": prompt, "max_output_tokens": 4},
                            headers={"x-session-id": "retried", **CHAIN_USER})
        assert first.status_code == 200, first.text
        dead = first.headers["x-iris-endpoint"]
        next(p for p in pool.pools["iris-1"] if f"127.0.0.1:{p.port}" == dead).kill()
        body = {"model": MODEL, "input": prompt + "again", "max_output_tokens": 300, "stream": True}  # 5 ms a token: 1.5 s
        with client.stream("POST", f"{url}/v1/responses", json=body, headers={"x-session-id": "retried", **CHAIN_USER}) as streamed:
            assert streamed.status_code == 200
            served = names[streamed.headers["x-simulator-name"]]
            assert served != dead
            assert streamed.headers["x-iris-endpoint"] == served, "x-iris-endpoint names the endpoint that answered"
            assert (running_on(store, served), running_on(store, dead)) == (1, 0), "the lease counts where it runs"
            assert store.zcard(f"{{health:m}}:endpoint-prefixes:iris-1:{served}") > 0, "the endpoint that answered learnt the prompt"
            events = [orjson.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: {")]
        response_id = events[0]["response"]["id"]
        assert events[-1]["type"] == "response.completed"
        found = client.get(f"{url}/v1/responses/{response_id}", headers=CHAIN_USER)
        assert found.status_code == 200, found.text
        assert names[found.headers["x-simulator-name"]] == served
    try:
        assert wait_until(lambda: sum(running_on(store, e) for e in names.values()) == 0, within_seconds=10)
    finally:
        store.close()
