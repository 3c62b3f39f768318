"""Envoy sized for long streams: 1,500 concurrent streaming requests through ONE Envoy (two
ext_proc servers behind it), more than Envoy's default circuit breakers allow per cluster (1024).
The clients speak HTTP/2 (envoy.yaml caps the listener's connections and the streams per
connection against hostile clients). The simulated providers wait long before the first token,
so every stream is in flight at once;
the providers observe all 1,500 at the same time, every request completes, and no circuit breaker
or overload action of Envoy fired."""

from __future__ import annotations

import asyncio
import resource

import aiohttp
import httpx
import pytest

from irislab.local_gateway import LocalGateway, ProviderSimulation
from tests.support.gateway import MODEL, chat_body, redis_client, wait_for_no_leases

STREAMS = 1500
BOUND = 120.0  # seconds the whole ramp may take before the test fails
STREAMS_PER_CONNECTION = 15  # under envoy.yaml's http2 max_concurrent_streams (16)
SIMULATION = ProviderSimulation(ttft_ms=30_000, per_token_ms=100, block_tokens=8)  # every stream waits 30 s


def config() -> dict:
    limits = {"max_pinned_sessions": 100_000, "max_global_in_flight_request_slots": 700}
    return {
        "redis": {"key_prefix": "cap", "max_connections": 256},
        "session": {"trusted_identity_headers": ["x-user-id"]},  # the tests stand in for an authenticating filter
        "providers": [
            {"name": "iris-1", "kind": "managed", "cluster": "iris-1", "models": {MODEL: {"features": ["chat"], "limits": limits}}},
            {"name": "iris-2", "kind": "managed", "cluster": "iris-2", "models": {MODEL: {"features": ["chat"], "limits": limits}}},
            {"name": "tensorx", "kind": "unlimited", "cluster": "tensorx", "models": {MODEL: {"features": ["chat"]}}},
        ],
    }


def raise_fd_limit(needed: int) -> None:
    """The client, Envoy and the simulators each hold a socket per stream (they inherit the limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            pytest.skip(f"the file descriptor limit ({hard}) is below the {needed} this test needs")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def envoy_stats(gw: LocalGateway) -> dict[str, int]:
    text = httpx.get(f"http://127.0.0.1:{gw.running[0].admin_port}/stats", timeout=10).text
    stats = {}
    for line in text.splitlines():
        name, _, value = line.partition(": ")
        if value.strip().lstrip("-").isdigit():
            stats[name] = int(value)
    return stats


async def providers_in_flight(http: aiohttp.ClientSession, gw: LocalGateway) -> int:
    total = 0
    for name in gw.providers:
        async with http.get(f"{gw.provider_url(name)}/stats") as response:
            total += (await response.json())["in_flight"]
    return total


async def concurrent_streams(gw: LocalGateway, count: int) -> tuple[list[tuple[int, bool]], int]:
    """`count` streaming requests over HTTP/2 (as a gateway's clients or the load balancer in
    front of it would send them: envoy.yaml caps the listener's connections and the streams per
    connection, STREAMS_PER_CONNECTION below that cap), started over a few seconds so the ext_proc
    servers answer each message within Envoy's message timeout. Returns each (status, completed
    with [DONE]) and the most requests the providers observed in flight at once (sampled while
    they all wait)."""
    peak = 0
    timeout = httpx.Timeout(300.0)
    clients = [httpx.AsyncClient(http1=False, http2=True, timeout=timeout) for _ in range(-(-count // STREAMS_PER_CONNECTION))]
    try:

        async def one(i: int) -> tuple[int, bool]:
            body = chat_body(f"stream {i}", max_tokens=2, stream=True)
            client = clients[i // STREAMS_PER_CONNECTION]
            try:
                response = await client.post(f"{gw.url}/v1/chat/completions", json=body, headers={"x-user-id": f"user-{i}"})
                return response.status_code, "data: [DONE]" in response.text
            except httpx.HTTPError:
                return 0, False

        tasks = []
        for i in range(count):
            tasks.append(asyncio.create_task(one(i)))
            if i % 50 == 49:
                await asyncio.sleep(0.1)
        async with aiohttp.ClientSession() as stats_http:
            for _ in range(int(BOUND / 0.25)):
                peak = max(peak, await providers_in_flight(stats_http, gw))
                if peak >= count or all(task.done() for task in tasks):
                    break
                await asyncio.sleep(0.25)
        results = await asyncio.gather(*tasks)
    finally:
        for client in clients:
            await client.aclose()
    return results, peak


@pytest.mark.slow
def test_1500_concurrent_streams_through_one_envoy_without_overflow(tmp_path):
    raise_fd_limit(4 * STREAMS + 1024)
    with LocalGateway(config_data=config(), extproc_servers=2, default_simulation=SIMULATION, work_dir=tmp_path) as gw:
        results, peak = asyncio.run(concurrent_streams(gw, STREAMS))
        stats = envoy_stats(gw)
        assert peak == STREAMS  # the providers saw every stream in flight at once
        failed = [r for r in results if r != (200, True)]
        assert failed == [], f"{len(failed)} of {STREAMS} failed, first: {failed[:3]}"
        overflows = {k: v for k, v in stats.items() if k.endswith("_overflow") and v}  # clusters and the listener
        assert overflows == {}
        assert stats["http.openai.downstream_rq_completed"] >= STREAMS
        assert all(v == 0 for k, v in stats.items() if k.startswith("overload.") and k.endswith(".active"))
        assert stats.get("overload.envoy.resource_monitors.global_downstream_max_connections.failed_updates", 0) == 0
        assert wait_for_no_leases(redis_client(gw), within_seconds=10.0) == 0
