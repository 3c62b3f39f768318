"""No request lost to a connection the engine closes (issue 30, item 6).

llama.cpp's server announces keep-alive on a streamed answer and closes the connection right
after its last chunk (tests/support/closing_engine.py). Envoy pools the connection at that
chunk; a request it sends there before it reads the close is reset unread: Envoy's 503 (flag
UC, `upstream_reset_before_response_started{connection_termination}`), which no retry may
repeat, the request having been sent. Own providers' clusters carry one request per connection
(envoy/envoy.yaml, and what `iris-extproc envoy-config` renders): every streamed request is
answered, once, through the shipped bootstrap and the rendered one alike."""

from __future__ import annotations

import json
import threading
from collections import Counter

import httpx
import pytest
import redis

from irislab.local_gateway import LocalGateway, ProviderSimulation
from tests.support.closing_engine import ClosingEngine
from tests.support.gateway import wait_for_no_leases

MODEL = "m"
REQUESTS = 90
CLIENTS = 3
CHAT = "/v1/chat/completions"


def config(endpoints: list[str]) -> dict:
    own = {"features": ["chat"], "limits": {"max_global_in_flight_request_slots": 2 * CLIENTS}}
    iris_1 = {"name": "iris-1", "kind": "managed", "cluster": "iris-1", "models": {MODEL: own}}
    if endpoints:
        iris_1["endpoints"] = endpoints
    return {
        "redis": {"key_prefix": "reuse"},
        "server": {"expose_routing_headers": True},
        "providers": [iris_1, {"name": "tensorx", "kind": "unlimited", "cluster": "tensorx", "models": {MODEL: {"features": ["chat"]}}}],
    }


def stream_many(url: str) -> Counter:
    """REQUESTS streamed chats, CLIENTS at a time, each client on its own keep-alive connection
    to Envoy sending its next request as soon as the last ended; returns {outcome: count}, an
    outcome being `200 <provider>` (the stream complete), `<status> <error code>`, or the client's
    error. (Resets degrade the engine's pair, passive and connect: later requests then go to the
    third party.)"""
    statuses: Counter = Counter()
    lock = threading.Lock()
    remaining = iter(range(REQUESTS))

    def client() -> None:
        with httpx.Client(timeout=60) as http:
            for number in remaining:
                body = {"model": MODEL, "messages": [{"role": "user", "content": f"request {number}"}], "max_tokens": 2, "stream": True}
                try:
                    with http.stream("POST", f"{url}{CHAT}", json=body, headers={"x-session-id": f"s{number % 7}"}) as response:
                        text = response.read().decode()
                        if response.status_code == 200 and text.rstrip().endswith("data: [DONE]"):
                            outcome = f"200 {response.headers['x-iris-provider']}"
                        elif response.status_code == 200:
                            outcome = "200 incomplete"
                        else:
                            outcome = f"{response.status_code} {json.loads(text)['error']['code']}"
                except httpx.HTTPError as exc:
                    outcome = type(exc).__name__
                with lock:
                    statuses[outcome] += 1

    threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return statuses


def cluster_stats(gateway: LocalGateway, cluster: str) -> dict[str, int]:
    text = httpx.get(f"http://127.0.0.1:{gateway.running[0].admin_port}/stats", params={"filter": f"^cluster\\.{cluster}\\."}, timeout=10).text
    stats = {}
    for line in text.splitlines():
        name, _, value = line.partition(": ")
        if value.strip().isdigit():
            stats[name.removeprefix(f"cluster.{cluster}.")] = int(value)
    return stats


@pytest.mark.parametrize("bootstrap", ["shipped", "rendered"])
def test_no_streamed_request_is_lost_to_an_engine_closing_its_connection(bootstrap, tmp_path):
    """90 streamed chats, 3 at a time, to one engine that closes each connection 30 ms after a
    streamed answer: every one answered 200 by the engine, exactly once (never generated twice),
    no upstream connection closed under a request, no lease left. `shipped`: envoy/envoy.yaml's
    own cluster; `rendered`: the cluster `iris-extproc envoy-config` renders from `endpoints`."""
    with ClosingEngine(close_delay_seconds=0.03) as engine:
        rendered = bootstrap == "rendered"
        gateway = LocalGateway(
            config_data=config([engine.url] if rendered else []), real_providers=rendered,
            engines={} if rendered else {"iris-1": [engine.url]},
            default_simulation=ProviderSimulation(ttft_ms=1, per_token_ms=1), work_dir=tmp_path / "gateway",
        )
        with gateway:
            statuses = stream_many(gateway.url)
            stats = cluster_stats(gateway, "iris-1")
            leases = wait_for_no_leases(redis.Redis.from_url(gateway.redis_url), within_seconds=10)
        assert statuses == Counter({"200 iris-1": REQUESTS}), (statuses, stats)
        assert engine.answered[CHAT] == REQUESTS  # each once: no request retried after it was sent
        assert stats["upstream_cx_destroy_remote_with_active_rq"] == 0, stats
        assert stats["upstream_rq_retry"] == 0, stats
        assert leases == 0
