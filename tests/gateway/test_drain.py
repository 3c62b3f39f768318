"""Graceful drain: SIGTERM to one of TWO ext_proc servers behind ONE Envoy under load fails no
request. Long streams run across the SIGTERM on both servers, and new requests keep arriving
through the whole drain. The drained server reports NOT_SERVING on grpc.health.v1.Health, Envoy's
health check takes it out of rotation within server.drain_delay_seconds, its open streams finish,
it exits 0, and no lease is left."""

from __future__ import annotations

import signal
import threading

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.operations.gateway import EXT_PROC_SERVICE
from irislab.local_gateway import LocalGateway, ProviderSimulation
from tests.support.gateway import MODEL, chat_body, redis_client, wait_for_no_leases, wait_until

BOUND = 20.0  # seconds any single poll may take before the test fails
LONG_STREAMS = 8


def config() -> dict:
    limits = {"max_pinned_sessions": 100, "max_global_in_flight_request_slots": 100,
              "max_per_session_in_flight_request_slots": 10}
    return {
        "redis": {"key_prefix": "drain"},
        "session": {"trusted_identity_headers": ["x-user-id"]},  # the tests stand in for an authenticating filter
        "lease_timeout_seconds": 3,  # renewals every second: several run across the drain
        "server": {"drain_delay_seconds": 3, "drain_grace_seconds": 30},
        "providers": [
            {"name": "iris-1", "kind": "managed", "cluster": "iris-1", "models": {MODEL: {"features": ["chat"], "limits": limits}}},
            {"name": "iris-2", "kind": "managed", "cluster": "iris-2", "models": {MODEL: {"features": ["chat"], "limits": limits}}},
            {"name": "tensorx", "kind": "unlimited", "cluster": "tensorx", "models": {MODEL: {"features": ["chat"]}}},
        ],
    }


@pytest.fixture
def gateway(tmp_path):
    sim = ProviderSimulation(ttft_ms=5, per_token_ms=50, block_tokens=8)
    with LocalGateway(config_data=config(), extproc_servers=2, default_simulation=sim, work_dir=tmp_path) as gw:
        yield gw


def health(port: int, service: str) -> int | None:
    """grpc.health.v1.Health/Check of the server on `port`: the status, or None when it does not answer."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status
        except grpc.RpcError:
            return None


def extproc_hosts(gw) -> dict[int, dict[str, str]]:
    """Envoy's view of each extproc endpoint, by port: rq_active, health_flags, ..."""
    text = httpx.get(f"http://127.0.0.1:{gw.running[0].admin_port}/clusters", timeout=5).text
    hosts: dict[int, dict[str, str]] = {}
    for line in text.splitlines():
        parts = line.split("::")
        if len(parts) == 4 and parts[0] == "extproc" and parts[1].startswith("127.0.0.1:"):
            hosts.setdefault(int(parts[1].rsplit(":", 1)[1]), {})[parts[2]] = parts[3]
    return hosts


def test_sigterm_to_one_of_two_extproc_servers_under_load_fails_no_request(gateway):
    drained, kept = gateway.running[0].extprocs
    for port in (drained.port, kept.port):
        for service in ("", EXT_PROC_SERVICE):
            assert health(port, service) == health_pb2.HealthCheckResponse.SERVING
    assert wait_until(lambda: all(h["health_flags"] == "healthy" for h in extproc_hosts(gateway).values()), BOUND)

    results: list[tuple[str, int, bool]] = []  # (kind, status, completed)
    lock = threading.Lock()
    stop_new = threading.Event()

    def long_stream(user: str) -> None:
        body = chat_body("a long answer", max_tokens=160, stream=True)  # 160 x 50 ms: about 8 s
        try:
            with httpx.Client(timeout=60) as http:
                with http.stream("POST", f"{gateway.url}/v1/chat/completions", json=body, headers={"x-user-id": user}) as r:
                    lines = list(r.iter_lines())
            outcome = ("long", r.status_code, "data: [DONE]" in lines)
        except httpx.HTTPError:
            outcome = ("long", 0, False)
        with lock:
            results.append(outcome)

    def new_requests(worker: int) -> None:
        with httpx.Client(timeout=30) as http:
            for n in range(10_000):
                if stop_new.is_set():
                    return
                body = chat_body(f"short {worker} {n}", max_tokens=2)
                try:
                    r = http.post(f"{gateway.url}/v1/chat/completions", json=body, headers={"x-user-id": f"w{worker}-{n}"})
                    outcome = ("new", r.status_code, r.status_code == 200)
                except httpx.HTTPError:
                    outcome = ("new", 0, False)
                with lock:
                    results.append(outcome)

    threads = [threading.Thread(target=long_stream, args=(f"long-{i}",)) for i in range(LONG_STREAMS)]
    threads += [threading.Thread(target=new_requests, args=(w,)) for w in range(2)]
    for thread in threads:
        thread.start()
    try:
        # Both servers hold open streams when the SIGTERM comes.
        assert wait_until(lambda: all(int(h.get("rq_active", 0)) >= 2 for h in extproc_hosts(gateway).values()), BOUND)
        drained.popen.send_signal(signal.SIGTERM)
        assert wait_until(lambda: health(drained.port, EXT_PROC_SERVICE) in (health_pb2.HealthCheckResponse.NOT_SERVING, None), BOUND)
        assert wait_until(lambda: "failed_active_hc" in extproc_hosts(gateway)[drained.port]["health_flags"], BOUND)
        with lock:
            sent_before_exit = len(results)
        assert drained.popen.wait(timeout=60) == 0
        # New requests keep arriving after the drained server is gone.
        assert wait_until(lambda: len(results) >= sent_before_exit + 20, BOUND)
    finally:
        stop_new.set()
        for thread in threads:
            thread.join(timeout=60)

    failed = [r for r in results if not (r[1] == 200 and r[2])]
    assert failed == [], f"{len(failed)} of {len(results)} requests failed: {failed[:5]}"
    assert sum(1 for r in results if r[0] == "long") == LONG_STREAMS
    assert sum(1 for r in results if r[0] == "new") >= 20
    assert kept.alive()
    assert wait_for_no_leases(redis_client(gateway), within_seconds=5.0) == 0
    assert "draining: NOT_SERVING" in drained.log_tail(200_000)
