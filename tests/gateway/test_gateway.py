"""The gateway end to end: openai SDK -> real Envoy -> ext_proc server -> real Redis -> simulated
providers. Limits are small (tests/support/gateway.py) so every path is reached. Every test runs
twice: the routing scripts over the pipelined client (the default) and over redis-py
(`redis.hot_path_client: redis-py`)."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.support.gateway import (
    LIMITS,
    MODEL,
    chat_body,
    clear_routing_state,
    live_leases,
    post,
    provider_stats,
    redis_client,
    start_gateway,
    wait_for_no_leases,
)

# Lease timeout is 30 s: a lease gone within this bound was released, not expired.
RELEASE_BOUND_SECONDS = 3.0


@pytest.fixture(scope="module", params=["pipelined", "redis-py"])
def gateway(tmp_path_factory, request):
    """The module's gateway, once with each client of the routing scripts (redis.hot_path_client)."""
    gw = start_gateway(tmp_path_factory.mktemp("gateway"), redis={"key_prefix": "e2e", "hot_path_client": request.param})
    yield gw
    gw.stop()


@pytest.fixture
def gw(gateway):
    """The shared gateway with empty routing state and reset provider counters."""
    clear_routing_state(redis_client(gateway))
    for name in gateway.providers:
        httpx.post(f"{gateway.provider_url(name)}/control/clear", timeout=5)
    yield gateway
    for name in gateway.providers:
        stats = provider_stats(gateway, name)
        limit = LIMITS["max_global_in_flight_request_slots"]
        if name != "tensorx":
            assert stats["max_in_flight_by_model"].get(MODEL, 0) <= limit, (name, stats)


def client(gateway, user: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="k", default_headers={"x-user-id": user}, max_retries=0)


def turn(api: openai.OpenAI, messages: list) -> tuple[str, str, str]:
    raw = api.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=2)
    answer = raw.parse().choices[0].message.content
    return raw.headers["x-iris-provider"], raw.headers["x-iris-route-reason"], answer


def test_three_turn_conversation_stays_on_the_first_provider(gw):
    api = client(gw, "alice")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    seen = []
    for i in range(3):
        provider, reason, answer = turn(api, messages)
        seen.append((provider, reason))
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"more {i}"}]
    assert seen == [("iris-1", "new_pin"), ("iris-1", "pinned"), ("iris-1", "pinned")]
    assert provider_stats(gw, "iris-1")["requests"] == 3
    assert wait_for_no_leases(redis_client(gw), RELEASE_BOUND_SECONDS) == 0


def test_new_sessions_overflow_in_priority_order(gw):
    served = []
    for i in range(5):
        response = post(gw, "/v1/chat/completions", user=f"user{i}", json=chat_body("hi"))
        assert response.status_code == 200
        served.append(response.headers["x-iris-provider"])
    # two pins each on iris-1 and iris-2, then the third party
    assert served == ["iris-1", "iris-1", "iris-2", "iris-2", "tensorx"]


def test_full_per_session_slots_offload_once_and_keep_the_pin(gw):
    body = chat_body("long", max_tokens=200, stream=True)
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{gw.url}/v1/chat/completions", json=body, headers={"x-user-id": "carol"}) as running:
            assert running.headers["x-iris-provider"] == "iris-1"
            lines = running.iter_lines()  # kept: a dropped iterator closes the response
            next(lines)
            second = post(gw, "/v1/chat/completions", user="carol", json=chat_body("long"))
            assert (second.headers["x-iris-provider"], second.headers["x-iris-route-reason"]) == ("iris-2", "offloaded")
    third = post(gw, "/v1/chat/completions", user="carol", json=chat_body("long"))
    assert (third.headers["x-iris-provider"], third.headers["x-iris-route-reason"]) == ("iris-1", "pinned")


def test_streamed_completion_releases_its_lease_at_the_end(gw):
    api = client(gw, "dave")
    stream = api.chat.completions.create(model=MODEL, messages=chat_body("x")["messages"], max_tokens=5, stream=True)
    chunks = list(stream)
    assert len(chunks) >= 5
    assert wait_for_no_leases(redis_client(gw), RELEASE_BOUND_SECONDS) == 0


def test_client_disconnect_mid_stream_releases(gw):
    body = chat_body("long", max_tokens=500, stream=True)
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{gw.url}/v1/chat/completions", json=body, headers={"x-user-id": "erin"}) as response:
            lines = response.iter_lines()  # kept: a dropped iterator closes the response
            next(lines)
            assert live_leases(redis_client(gw)) == 1
    assert wait_for_no_leases(redis_client(gw), RELEASE_BOUND_SECONDS) == 0


def test_upstream_reset_releases(gw):
    httpx.post(f"{gw.provider_url('iris-1')}/control/fail", json={"mode": "reset", "count": 1}, timeout=5)
    body = chat_body("reset me", max_tokens=50, stream=True)
    with pytest.raises(httpx.HTTPError):
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", f"{gw.url}/v1/chat/completions", json=body, headers={"x-user-id": "frank"}) as r:
                for _ in r.iter_lines():
                    pass
    assert wait_for_no_leases(redis_client(gw), RELEASE_BOUND_SECONDS) == 0


def test_upstream_error_does_not_refresh_the_pin_but_releases(gw):
    httpx.post(f"{gw.provider_url('iris-1')}/control/fail", json={"status": 500, "count": 1}, timeout=5)
    response = post(gw, "/v1/chat/completions", user="gina", json=chat_body("x"))
    assert response.status_code == 500
    assert wait_for_no_leases(redis_client(gw), RELEASE_BOUND_SECONDS) == 0


def test_embeddings_are_served_without_a_pin(gw):
    response = post(gw, "/v1/embeddings", json={"model": "bge-m3", "input": "some text"})
    assert response.status_code == 200
    assert response.json()["data"][0]["embedding"]
    assert (response.headers["x-iris-provider"], response.headers["x-iris-route-reason"]) == ("iris-1", "unpinned")
    assert redis_client(gw).keys("*:pin:*") == []


def test_client_sent_routing_header_never_chooses_the_cluster(gw):
    response = post(gw, "/v1/chat/completions", user="mallory", json=chat_body("x"), headers={"x-iris-cluster": "tensorx"})
    assert response.headers["x-iris-provider"] == "iris-1"
    assert response.headers["x-simulator-name"] == "iris-1"
    received = provider_stats(gw, "iris-1")["last_request_headers"][-1]
    assert "x-iris-cluster" not in received


@pytest.mark.parametrize(
    ("content", "status", "code"),
    [
        (b"{not json", 400, "invalid_json"),
        (b'{"messages": [{"role": "user", "content": "x"}]}', 400, "missing_model"),
        (b'{"model": "gpt-unknown", "messages": [{"role": "user", "content": "x"}]}', 404, "model_not_found"),
        (b'{"model": "llama-3.1-70b", "messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, "invalid_json"),
        (b"[1, 2]", 400, "invalid_json"),
    ],
)
def test_bad_requests_get_openai_errors_and_leave_no_lease(gw, content, status, code):
    response = post(gw, "/v1/chat/completions", content=content, headers={"content-type": "application/json"})
    assert response.status_code == status
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["code"] == code and error["message"] and error["type"]
    assert live_leases(redis_client(gw)) == 0


def test_oversized_body_gets_413(gw):
    # Over server.max_body_bytes (16 MiB) but within Envoy's buffer (16 MiB + 64 KiB): the
    # ext_proc server's own 413, which names the limit.
    big = b'{"model": "llama-3.1-70b", "messages": [{"role": "user", "content": "' + b"a" * (16 * 1024 * 1024) + b'"}]}'
    response = post(gw, "/v1/chat/completions", content=big, headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"
    assert "larger than 16777216 bytes" in response.json()["error"]["message"]
    assert live_leases(redis_client(gw)) == 0


def test_body_over_envoys_buffer_gets_envoys_413_as_openai_json(gw):
    huge = b'{"model": "llama-3.1-70b", "prompt": "' + b"a" * (40 * 1024 * 1024) + b'"}'
    response = post(gw, "/v1/completions", content=huge, headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert response.headers["content-type"] == "application/json"
    assert response.json()["error"]["code"] == "request_too_large"


def test_ten_megabyte_prompt_passes(gw):
    words = " ".join(["w"] * (5 * 1024 * 1024))  # 10 MiB of text
    response = post(gw, "/v1/chat/completions", json=chat_body(words))
    assert response.status_code == 200, response.text[:300]


def test_unknown_path_and_wrong_method(gw):
    missing = post(gw, "/v1/nothing", json={"model": MODEL})
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "unknown_url")
    wrong = httpx.get(f"{gw.url}/v1/chat/completions", timeout=10)
    assert (wrong.status_code, wrong.json()["error"]["code"]) == (405, "method_not_allowed")


def test_capacity_rejection_is_429_with_retry_after(gw):
    first = post(gw, "/v1/chat/completions", user="a", json={**chat_body("x"), "model": "solo"})
    assert first.status_code == 200
    second = post(gw, "/v1/chat/completions", user="b", json={**chat_body("x"), "model": "solo"})
    assert second.status_code == 429
    assert second.headers["retry-after"] == "1"
    assert second.json()["error"]["code"] == "capacity_exceeded"
