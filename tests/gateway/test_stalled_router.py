"""The ext_proc server stalls (SIGSTOP, as a process frozen by a long pause or a saturated loop)
while a stream runs through it. A request that arrives during the stall gets Envoy's answer at
the filter's `message_timeout` (5 s): 504 `routing_timeout`, which says the router was late,
not the provider. So does a request whose response headers reach Envoy during the stall: Envoy
holds them for the router's answer (response headers SEND), and the router answers too late; the
client has seen nothing of it yet. A stream that is running (its response headers answered, its
tokens flowing) ends normally, the router serves again once it resumes, and Redis keeps no lease.

A stream counts as running once its client has its first bytes, not once its lease is in Redis:
the lease is written at the decision, before the provider's headers come back through the
router, and on a loaded machine the stall could begin between the two (issue 29 item 17: the
stream then got 504 like the request whose headers came back during the stall, below)."""

from __future__ import annotations

import os
import signal
import threading

import httpx

from tests.support.gateway import (
    chat_body,
    envoy_stat,
    live_leases,
    post,
    provider_stats,
    redis_client,
    start_gateway,
    wait_for_no_leases,
    wait_until,
)

STREAM_TOKENS = 400  # 20 ms each: 8 s, longer than the stall and its 5 s timeout together


def test_a_stalled_router_is_a_routing_timeout_and_loses_nothing(tmp_path):
    gateway = start_gateway(tmp_path)
    extproc = gateway.running[0].extproc
    provider = gateway.providers["iris-1"]
    try:
        streamed: dict = {}
        running = threading.Event()

        def stream() -> None:
            body = chat_body("a long story", max_tokens=STREAM_TOKENS, stream=True)
            with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=body, headers={"x-user-id": "long"}, timeout=60) as response:
                streamed["status"] = response.status_code
                chunks = []
                for chunk in response.iter_bytes():
                    chunks.append(chunk)
                    running.set()
                streamed["text"] = b"".join(chunks).decode()

        def answer_during_the_stall() -> None:
            answered["response"] = post(gateway, "/v1/chat/completions", user="answered", json=chat_body("answered during the stall"))

        thread = threading.Thread(target=stream)
        thread.start()
        assert running.wait(timeout=30)  # its first tokens reached the client: the stream runs
        # A request the provider answers only once the router is stalled: its response headers
        # reach Envoy during the stall.
        answered: dict = {}
        os.kill(provider.popen.pid, signal.SIGSTOP)
        try:
            answering = threading.Thread(target=answer_during_the_stall)
            answering.start()
            # Its lease is in Redis before the router's answer reaches Envoy: stall the router
            # only once Envoy has sent the request to the provider (the stream and this one).
            assert wait_until(lambda: live_leases(redis_client(gateway)) == 2, within_seconds=10)
            assert wait_until(lambda: envoy_stat(gateway, "cluster.iris-1.upstream_rq_total") == 2, within_seconds=10)
            os.kill(extproc.popen.pid, signal.SIGSTOP)
        finally:
            os.kill(provider.popen.pid, signal.SIGCONT)
        try:
            # The provider has answered it: its headers wait in Envoy for the stalled router.
            assert wait_until(lambda: envoy_stat(gateway, "cluster.iris-1.upstream_rq_200") == 2, within_seconds=10)
            late = post(gateway, "/v1/chat/completions", user="late", json=chat_body("during the stall"))
        finally:
            os.kill(extproc.popen.pid, signal.SIGCONT)
        assert late.status_code == 504
        assert late.json()["error"]["code"] == "routing_timeout", late.text
        answering.join(timeout=60)
        assert answered["response"].status_code == 504
        assert answered["response"].json()["error"]["code"] == "routing_timeout", answered["response"].text
        thread.join(timeout=60)
        assert streamed["status"] == 200 and streamed["text"].rstrip().endswith("data: [DONE]")
        after = post(gateway, "/v1/chat/completions", user="after", json=chat_body("after the stall"))
        assert after.status_code == 200, after.text
        # The providers saw the stream, the request answered during the stall and the one after
        # it; the late one reached none.
        served = {name: provider_stats(gateway, name)["requests"] for name in ("iris-1", "iris-2", "tensorx")}
        assert sum(served.values()) == 3, served
        assert wait_for_no_leases(redis_client(gateway), within_seconds=5.0) == 0
        assert extproc.alive()
    finally:
        os.kill(provider.popen.pid, signal.SIGCONT)
        gateway.stop()
