"""Envoy sized for long streams: 1,500 concurrent streaming requests through ONE Envoy (two
ext_proc servers behind it), more than Envoy's default circuit breakers allow per cluster (1024).
The clients speak HTTP/2 (envoy.yaml caps the streams per connection against hostile clients).
The simulated providers wait long before the first token,
so every stream is in flight at once;
the providers observe all 1,500 at the same time, every request completes, and no circuit breaker
or overload action of Envoy fired.

And 1,100 HTTP/1.1 streaming clients, one connection each, as the openai SDK and curl hold them
(issue 20, item 9): the listener used to close every connection past its 1,024th at accept
(76 resets for 1,100 clients). A limit that is reached answers what a client can retry: Envoy's
own 503 carries `retry-after`."""

from __future__ import annotations

import asyncio
import copy
import resource
import time

import aiohttp
import h11
import httpx
import orjson
import pytest

from irislab import envoy_config
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
                response = await client.post(f"{gw.url}/v1/chat/completions", json=body)
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


# -- HTTP/1.1 clients, one connection per stream ----------------------------------------------

HTTP1_CLIENTS = 1100  # over the 1,024 connections the listener used to accept
HTTP1_BOUND = 150.0  # seconds the whole run may take before the clients give up (the test fails)
HTTP1_SIMULATION = ProviderSimulation(ttft_ms=25_000, per_token_ms=20, block_tokens=8)  # every stream waits 25 s


def third_party_only_config(prefix: str) -> dict:
    """One unlimited provider (no limits: every request is admitted) for MODEL."""
    return {
        "redis": {"key_prefix": prefix, "max_connections": 256},
        "providers": [{"name": "tensorx", "kind": "unlimited", "cluster": "tensorx", "models": {MODEL: {"features": ["chat"]}}}],
    }


async def http1_stream(port: int, i: int) -> tuple[int, bool, str]:
    """One streaming chat request on a connection of its own (HTTP/1.1, `connection: close`, as
    curl sends one): (status, whether the stream ended with `data: [DONE]`, what went wrong)."""
    body = orjson.dumps(chat_body(f"http1 stream {i}", max_tokens=2, stream=True))
    connection = h11.Connection(h11.CLIENT)
    request = h11.Request(method="POST", target="/v1/chat/completions", headers=[
        ("host", "gateway"), ("content-type", "application/json"), ("content-length", str(len(body))), ("connection", "close"),
    ])
    writer = None
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(connection.send(request) + connection.send(h11.Data(data=body)) + connection.send(h11.EndOfMessage()))
        await writer.drain()
        status, chunks = 0, []
        while True:
            event = connection.next_event()
            if event is h11.NEED_DATA:
                connection.receive_data(await reader.read(65536))  # b"": the peer closed
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                chunks.append(event.data)
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                return status, b"data: [DONE]" in b"".join(chunks), ""
    except (OSError, h11.ProtocolError) as exc:
        return 0, False, type(exc).__name__
    finally:
        if writer is not None:
            writer.close()


async def provider_in_flight(http: aiohttp.ClientSession, gw: LocalGateway) -> int:
    async with http.get(f"{gw.provider_url('tensorx')}/stats") as response:
        return (await response.json())["in_flight"]


async def http1_streams(gw: LocalGateway, count: int) -> tuple[list[tuple[int, bool, str]], int]:
    """`count` HTTP/1.1 streaming clients started over a few seconds (so the ext_proc server
    answers each message within Envoy's message timeout), each on its own connection. Returns
    each (status, ended with [DONE], error) and the most requests the provider saw in flight at
    once (sampled while they all wait for their first token)."""
    port = gw.running[0].listener_port
    deadline = time.monotonic() + HTTP1_BOUND

    async def bounded(i: int) -> tuple[int, bool, str]:
        try:
            async with asyncio.timeout_at(asyncio.get_running_loop().time() + HTTP1_BOUND):
                return await http1_stream(port, i)
        except TimeoutError:
            return 0, False, "timeout"

    tasks = []
    for i in range(count):
        tasks.append(asyncio.create_task(bounded(i)))
        if i % 25 == 24:
            await asyncio.sleep(0.1)
    peak = 0
    async with aiohttp.ClientSession() as stats_http:
        while time.monotonic() < deadline and peak < count and not all(task.done() for task in tasks):
            peak = max(peak, await provider_in_flight(stats_http, gw))
            await asyncio.sleep(0.25)
    return await asyncio.gather(*tasks), peak


@pytest.mark.slow
def test_1100_http1_streaming_clients_each_on_its_own_connection_through_one_envoy(tmp_path):
    raise_fd_limit(4 * HTTP1_CLIENTS + 1024)  # the clients, Envoy (both sides) and the simulator: a socket per stream each
    with LocalGateway(config_data=third_party_only_config("cap1"), default_simulation=HTTP1_SIMULATION, work_dir=tmp_path) as gw:
        started = time.monotonic()
        results, peak = asyncio.run(http1_streams(gw, HTTP1_CLIENTS))
        print(f"{HTTP1_CLIENTS} HTTP/1.1 streams in {time.monotonic() - started:.1f} s, peak {peak} in flight")
        stats = envoy_stats(gw)
        failed = [r for r in results if r[:2] != (200, True)]
        resets = sum(v for k, v in stats.items() if k.endswith("downstream_cx_overflow") or k.endswith("downstream_global_cx_overflow"))
        assert failed == [] and resets == 0, f"{len(failed)} of {HTTP1_CLIENTS} failed ({resets} connections closed at accept), first: {failed[:3]}"
        assert peak == HTTP1_CLIENTS  # every client's connection and stream were open at once
        assert stats["http.openai.downstream_cx_http1_total"] >= HTTP1_CLIENTS
        assert all(v == 0 for k, v in stats.items() if k.startswith("overload.") and k.endswith(".active"))
        assert wait_for_no_leases(redis_client(gw), within_seconds=10.0) == 0


def test_envoys_own_503_at_a_full_circuit_breaker_says_when_to_retry(tmp_path):
    """A limit reached inside Envoy (here the third party's circuit breaker, shrunk to one request)
    answers a 503 the client can retry, with `retry-after`, not a reset."""
    bootstrap = envoy_config.load_envoy_yaml()
    tensorx = next(c for c in bootstrap["static_resources"]["clusters"] if c["name"] == "tensorx")
    tensorx["circuit_breakers"] = copy.deepcopy(tensorx["circuit_breakers"])  # a YAML alias: shared with the other providers
    tensorx["circuit_breakers"]["thresholds"][0].update(max_requests=1, max_pending_requests=1)
    source = envoy_config.write(bootstrap, tmp_path / "envoy-one-request.yaml")
    slow = ProviderSimulation(ttft_ms=3_000, per_token_ms=5, block_tokens=8)
    with LocalGateway(config_data=third_party_only_config("cap2"), default_simulation=slow, work_dir=tmp_path / "gw", envoy_source=source) as gw:
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", f"{gw.url}/v1/chat/completions", json=chat_body("first", stream=True)) as first:
                assert first.status_code == 200
                second = http.post(f"{gw.url}/v1/chat/completions", json=chat_body("second"))
                assert "data: [DONE]" in first.read().decode()
        assert second.status_code == 503
        assert second.headers["retry-after"] == "1"
        assert second.json()["error"]["code"] == "upstream_unavailable"
        assert envoy_stats(gw)["cluster.tensorx.upstream_rq_active_overflow"] == 1  # the breaker answered, nothing else
