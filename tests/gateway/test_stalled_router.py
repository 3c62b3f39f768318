"""The ext_proc server stalls (SIGSTOP, as a process frozen by a long pause or a saturated loop)
while a stream runs through it. A request that arrives during the stall gets Envoy's answer at
the filter's `message_timeout` (5 s): 504 `routing_timeout`, which says the router was late,
not the provider. The running stream ends normally, the router serves again once it resumes, and
Redis keeps no lease of either."""

from __future__ import annotations

import os
import signal
import threading

import httpx

from tests.support.gateway import chat_body, live_leases, post, provider_stats, redis_client, start_gateway, wait_for_no_leases, wait_until

STREAM_TOKENS = 400  # 20 ms each: 8 s, longer than the stall and its 5 s timeout together


def test_a_stalled_router_is_a_routing_timeout_and_loses_nothing(tmp_path):
    gateway = start_gateway(tmp_path)
    extproc = gateway.running[0].extproc
    try:
        streamed: dict = {}

        def stream() -> None:
            body = chat_body("a long story", max_tokens=STREAM_TOKENS, stream=True)
            with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=body, headers={"x-user-id": "long"}, timeout=60) as response:
                streamed["status"] = response.status_code
                streamed["text"] = response.read().decode()

        thread = threading.Thread(target=stream)
        thread.start()
        assert wait_until(lambda: live_leases(redis_client(gateway)) == 1, within_seconds=10)
        os.kill(extproc.popen.pid, signal.SIGSTOP)
        try:
            late = post(gateway, "/v1/chat/completions", user="late", json=chat_body("during the stall"))
        finally:
            os.kill(extproc.popen.pid, signal.SIGCONT)
        assert late.status_code == 504
        assert late.json()["error"]["code"] == "routing_timeout", late.text
        thread.join(timeout=60)
        assert streamed["status"] == 200 and streamed["text"].rstrip().endswith("data: [DONE]")
        after = post(gateway, "/v1/chat/completions", user="after", json=chat_body("after the stall"))
        assert after.status_code == 200, after.text
        # The providers saw the stream and the request after the stall; the late one reached none.
        served = {name: provider_stats(gateway, name)["requests"] for name in ("iris-1", "iris-2", "tensorx")}
        assert sum(served.values()) == 2, served
        assert wait_for_no_leases(redis_client(gateway), within_seconds=5.0) == 0
        assert extproc.alive()
    finally:
        gateway.stop()

