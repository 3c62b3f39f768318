"""The ends of a stream that are not the response's: a lease reported lost cancels its request,
and SIGTERM drains the ext_proc server (open streams finish, their leases are released, exit 0)."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from tests.support.gateway import chat_body, live_leases, redis_client, start_gateway, wait_for_no_leases


@pytest.fixture
def gateway(tmp_path):
    gw = start_gateway(tmp_path, lease_timeout_seconds=1.5, server={"expose_routing_headers": True, "drain_grace_seconds": 20})
    yield gw
    gw.stop()


def test_a_lost_lease_cancels_its_request(gateway):
    client = redis_client(gateway)
    body = chat_body("long", max_tokens=400, stream=True)  # 400 tokens x 20 ms: 8 s
    received = []
    with pytest.raises(httpx.HTTPError):
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", f"{gateway.url}/v1/chat/completions", json=body, headers={"x-user-id": "u"}) as response:
                for line in response.iter_lines():
                    received.append(line)
                    if len(received) == 2:
                        for key in client.keys("*:leases:*"):
                            client.delete(key)  # as if the lease had expired unnoticed
    chunks = [line for line in received if line.startswith("data: {")]
    assert 0 < len(chunks) < 400  # cut short, not completed
    assert "data: [DONE]" not in received


def test_sigterm_lets_open_streams_finish_then_exits_zero(gateway):
    body = chat_body("long", max_tokens=100, stream=True)  # about 2 s of streaming
    outcome = {}

    def stream() -> None:
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", f"{gateway.url}/v1/chat/completions", json=body, headers={"x-user-id": "d"}) as response:
                outcome["lines"] = list(response.iter_lines())

    thread = threading.Thread(target=stream)
    thread.start()
    deadline = time.monotonic() + 10
    while live_leases(redis_client(gateway)) == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert live_leases(redis_client(gateway)) == 1
    extproc = gateway.running[0].extproc
    extproc.popen.send_signal(signal.SIGTERM)
    thread.join(timeout=30)
    assert "data: [DONE]" in outcome["lines"]
    assert extproc.popen.wait(timeout=30) == 0
    assert wait_for_no_leases(redis_client(gateway), within_seconds=1.0) == 0
