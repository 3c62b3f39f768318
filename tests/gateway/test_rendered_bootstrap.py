"""From the routing config to a running gateway (`iris-lab up --real-providers`): the providers'
`endpoints` are servers already running (two simulators stand in for a pool of engines), and
Envoy runs the bootstrap `iris-extproc envoy-config` renders from the config (MAGLEV with Envoy's
own health check per replica, and a least-request cluster for requests without a session)."""

from __future__ import annotations

from collections import Counter

import httpx
import pytest

from irislab.local_gateway import LocalGateway, ProviderSimulation, simulator_argv
from irislab.processes import free_port, spawn, wait_for_port

MODEL = "m"


@pytest.fixture
def replicas(tmp_path):
    started = []
    try:
        for name in ("pool-a", "pool-b"):
            port = free_port()
            process = spawn(name, [*simulator_argv(name, port, ProviderSimulation(ttft_ms=1, per_token_ms=1, block_tokens=8)),
                                   "--model", MODEL], tmp_path)
            process.port = port
            started.append(process)
        for process in started:
            wait_for_port(process.port, process=process.popen)
        yield [f"http://127.0.0.1:{process.port}" for process in started]
    finally:
        for process in started:
            process.stop()


def test_a_gateway_in_front_of_the_configs_own_endpoints(replicas, tmp_path):
    config = {
        "redis": {"key_prefix": "rendered"},
        "server": {"expose_routing_headers": True},
        "providers": [
            {"name": "iris-1", "kind": "managed", "cluster": "iris-1", "endpoints": replicas, "sessionless_cluster": "iris-1-spread",
             "models": {MODEL: {"features": ["chat", "embeddings"], "limits": {"max_global_in_flight_request_slots": 16}}}},
            {"name": "tensorx", "kind": "unlimited", "cluster": "tensorx", "models": {MODEL: {"features": ["chat", "embeddings"]}}},
        ],
    }
    with LocalGateway(config_data=config, real_providers=True, work_dir=tmp_path / "gateway") as gateway:
        assert set(gateway.pools) == {"tensorx"}  # iris-1 is the config's own endpoints: no simulator
        homes: dict[str, str] = {}
        with httpx.Client(timeout=30) as client:
            for turn in range(3):
                for session in range(12):
                    body = {"model": MODEL, "messages": [{"role": "user", "content": f"session {session} turn {turn}"}], "max_tokens": 2}
                    response = client.post(f"{gateway.url}/v1/chat/completions", json=body, headers={"x-session-id": f"s{session}"})
                    assert response.status_code == 200 and response.headers["x-iris-provider"] == "iris-1", response.text
                    assert homes.setdefault(f"s{session}", response.headers["x-simulator-name"]) == response.headers["x-simulator-name"]
            assert set(homes.values()) == {"pool-a", "pool-b"}
            spread = Counter()
            for i in range(20):
                response = client.post(f"{gateway.url}/v1/embeddings", json={"model": MODEL, "input": f"text {i}"})
                assert response.status_code == 200, response.text
                spread[response.headers["x-simulator-name"]] += 1
            assert set(spread) == {"pool-a", "pool-b"}, spread
        envoy_file = (gateway.work_dir / "envoy-0.yaml").read_text()
        assert "iris-1-spread" in envoy_file and "MAGLEV" in envoy_file
