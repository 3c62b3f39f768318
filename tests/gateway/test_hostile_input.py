"""Bad input never costs anything (issue 5): fuzzed bodies, methods, paths and header values go
through real Envoy; every answer is an OpenAI-style error or a normal response, the ext_proc
server stays up, and no lease is left. Every error the gateway itself gives (the router's and
Envoy's local replies) carries a code of the closed set (issue 12), with a provider that rewrites
the model name configured, so the body rewrite meets every hostile body. Plus the security
checks: no client-chosen cluster, keyed session ids, and no secret in any answer or log."""

from __future__ import annotations

import gzip

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.openai_api.request import ParsedRequest, session_id
from extproc.protocol.messages import CLIENT_ERROR_CODES, ROUTER_ERROR_CODES
from tests.support.gateway import (
    LIMITS,
    MODEL,
    chat_body,
    clear_routing_state,
    gateway_config,
    post,
    redis_client,
    start_gateway,
    wait_for_no_leases,
    wait_until,
)

PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"]
CLIENT_SECRET = "sk-client-credential-0123456789"


UPSTREAM_MODEL = "vendor/llama-3.1-70b-instruct"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    providers = gateway_config()["providers"]
    providers[0]["models"][MODEL] = {"features": ["chat", "completions", "tools"], "limits": LIMITS, "upstream_model": UPSTREAM_MODEL}
    gw = start_gateway(tmp_path_factory.mktemp("hostile"), providers=providers)
    yield gw
    gw.stop()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20,
)


def request_like() -> st.SearchStrategy[dict]:
    """Bodies shaped like OpenAI requests with wrong types and values in their fields."""
    return st.fixed_dictionaries(
        {},
        optional={
            "model": st.sampled_from([MODEL, "bge-m3", "nope", ""]) | json_values,
            "messages": st.lists(
                st.fixed_dictionaries({}, optional={"role": st.sampled_from(["system", "user", "tool"]) | json_values, "content": json_values}),
                max_size=3,
            ) | json_values,
            "prompt": json_values,
            "input": json_values,
            "stream": json_values,
            "max_tokens": st.integers(-5, 3) | json_values,
            "tools": json_values,
            "response_format": json_values,
        },
    )


bodies = st.one_of(
    request_like().map(orjson.dumps),
    request_like().map(orjson.dumps).flatmap(lambda b: st.integers(0, max(0, len(b) - 1)).map(lambda n: b[:n])),
    st.binary(max_size=300),
    st.integers(1, 5000).map(lambda depth: b"[" * depth + b"]" * depth),
    st.integers(1, 3000).map(lambda depth: b'{"model":' * depth),
    # Valid objects nested deeper than orjson writes (254 levels): the body rewrite cannot write them.
    st.integers(240, 1100).map(lambda depth: b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": '
                               + b"[" * depth + b"]" * depth + b"}]}"),
    st.just(b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "\xc3\x28\xff"}]}'),
    st.just(orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 200_000}], "max_tokens": 1})),
)

# What an HTTP client can send at all (h11 refuses control characters and edge whitespace).
header_values = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=300).map(str.strip) | st.just(
    "\u00e9\u00ff".encode("latin-1")
)


def assert_openai_answer(response: httpx.Response) -> None:
    if response.status_code == 200:
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            assert response.text.rstrip().endswith("data: [DONE]")
        else:
            assert isinstance(response.json(), dict)
        return
    assert response.headers["content-type"] == "application/json", (response.status_code, response.text[:200])
    error = response.json()["error"]
    assert isinstance(error["message"], str) and isinstance(error["type"], str) and "code" in error
    if "x-simulator-name" in response.headers:
        # A provider's own answer. It never says the adaptation failed (model name or key).
        assert error["code"] not in ("model_not_found", "invalid_api_key"), error
    else:
        assert error["code"] in CLIENT_ERROR_CODES, (response.status_code, error)


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(PATHS), body=bodies, user=header_values)
def test_fuzzed_bodies_get_openai_answers(gateway, path, body, user):
    response = post(gateway, path, content=body, headers={"content-type": "application/json", "x-user-id": user})
    assert_openai_answer(response)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    method=st.sampled_from(["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "POST"]),
    path=st.sampled_from(PATHS + ["/", "/v1", "/v1/models", "/v1/chat/completions/../../admin", "/%00", "/v1/chat/completions?x=1"])
    | st.text(alphabet="abcdefghijklmnopqrstuvwxyz/%._-0123456789", max_size=40).map(lambda p: "/" + p),
    header=header_values,
)
def test_wrong_methods_paths_and_headers_get_openai_errors(gateway, method, path, header):
    response = httpx.request(
        method,
        f"{gateway.url}{path}",
        content=orjson.dumps(chat_body("x")),
        headers={"x-user-id": header, "x-iris-cluster": header, "content-type": "application/json"},
        timeout=30,
    )
    assert_openai_answer(response)


@pytest.mark.parametrize("depth", [200, 253, 254, 255, 300, 1000])
def test_nesting_deeper_than_the_body_rewrite_is_a_400(gateway, depth):
    nested = b"[" * depth + b"]" * depth
    body = b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "x": ' + nested + b"}"
    response = post(gateway, "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert_openai_answer(response)
    assert response.status_code in (200, 400)
    if response.status_code == 400:
        assert response.json()["error"]["code"] == "invalid_json"
    else:
        assert response.headers["x-iris-provider"] in ("iris-1", "iris-2", "tensorx")


def test_an_empty_chunked_body_is_a_missing_body_as_an_empty_one_is(gateway):
    chunked = post(gateway, "/v1/chat/completions", content=iter([b""]), headers={"content-type": "application/json"})
    sized = post(gateway, "/v1/chat/completions", content=b"", headers={"content-type": "application/json"})
    assert (chunked.status_code, chunked.json()["error"]["code"]) == (sized.status_code, sized.json()["error"]["code"]) == (400, "missing_body")


def test_a_body_that_is_not_utf8_is_named_so_not_by_the_parser_s_words(gateway):
    compressed = gzip.compress(orjson.dumps(chat_body("x")))
    response = post(gateway, "/v1/chat/completions", content=compressed, headers={"content-type": "application/json", "content-encoding": "gzip"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "invalid_json" and "not UTF-8" in error["message"] and "surrogate" not in error["message"], error


def chat_with_parts(*parts: dict) -> dict:
    return {**chat_body("x"), "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, *parts]}]}


# A part whose `type` is an array or an object once made the parser fail (unhashable) with a 500
# and a traceback in the log per request (issue 20, item 6).
UNHASHABLE_TYPES = [
    pytest.param("/v1/chat/completions", chat_with_parts({"type": ["x"]}), "messages[0].content[1].type", id="chat-part-array"),
    pytest.param("/v1/chat/completions", chat_with_parts({"type": {"a": 1}}), "messages[0].content[1].type", id="chat-part-object"),
    pytest.param("/v1/responses", {"model": MODEL, "input": [{"role": "user", "content": [{"type": ["input_image"]}]}]},
                 "input[0].content[0].type", id="responses-part-array"),
    pytest.param("/v1/chat/completions", {**chat_body("x"), "input": [{"type": {}}]}, "input[0].type", id="chat-stray-input"),
]


@pytest.mark.parametrize(("path", "body", "field"), UNHASHABLE_TYPES)
def test_a_type_that_is_not_a_string_is_a_400_without_a_traceback(gateway, path, body, field):
    log_path = gateway.work_dir / "extproc-0.log"
    logged_before = log_path.stat().st_size
    response = post(gateway, path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_type" and error["code"] in ROUTER_ERROR_CODES
    assert (error["param"], error["message"]) == (field, f"{field} must be a string")
    assert wait_for_no_leases(redis_client(gateway), within_seconds=5) == 0
    with open(log_path, "rb") as log:
        log.seek(logged_before)
        logged = log.read().decode(errors="replace")
    assert "Traceback" not in logged and "unexpected error" not in logged.lower(), logged[-2000:]


def test_nothing_was_lost_to_hostile_input(gateway):
    """Runs after the fuzz tests of this module: the server is alive, serves, and holds nothing."""
    assert all(instance.extproc.alive() for instance in gateway.running)
    response = post(gateway, "/v1/chat/completions", json=chat_body("still there?"))
    assert response.status_code == 200
    assert wait_for_no_leases(redis_client(gateway), within_seconds=5) == 0
    log = gateway.running[0].extproc.log_tail(2_000_000)
    assert "Traceback" not in log and "Unexpected error" not in log


def test_secrets_are_never_echoed_or_logged(gateway):
    headers = {"authorization": f"Bearer {CLIENT_SECRET}", "x-user-id": "eve"}
    answers = [
        post(gateway, "/v1/chat/completions", json=chat_body("x"), headers=headers),
        post(gateway, "/v1/chat/completions", content=b"{broken", headers=headers),
        post(gateway, "/v1/chat/completions", json={**chat_body("x"), "model": "unknown"}, headers=headers),
        post(gateway, "/v1/nothing", json=chat_body("x"), headers=headers),
    ]
    secrets = [CLIENT_SECRET, gateway.secret]
    for response in answers:
        for secret in secrets:
            assert secret not in response.text and secret not in str(response.headers)
    logs = [gateway.running[0].extproc.log_tail(10_000_000), gateway.running[0].envoy.log_tail(10_000_000)]
    for log in logs:
        for secret in secrets:
            assert secret not in log


def test_routing_header_from_a_client_is_stripped_everywhere(gateway):
    clear_routing_state(redis_client(gateway))
    response = post(gateway, "/v1/chat/completions", json=chat_body("spoof"), headers={"x-iris-cluster": "tensorx", "x-user-id": "spoofer"})
    assert response.headers["x-simulator-name"] == response.headers["x-iris-provider"] == "iris-1"


def parsed(prefix: bytes, model: str = MODEL, feature: str = "chat") -> ParsedRequest:
    return ParsedRequest(feature, model, False, frozenset(), prefix, {})


def test_session_ids_are_keyed_per_user():
    request = parsed(b'[["user","hello"]]')
    alice = session_id(b"secret", "alice", request)
    assert alice == session_id(b"secret", "alice", request)
    assert alice != session_id(b"secret", "bob", request)
    assert alice != session_id(b"another-secret", "alice", request)
    assert alice != session_id(b"secret", "alice", parsed(b'[["user","hello"]]', model="other"))
    assert alice != session_id(b"secret", "alice", parsed(b'[["user","hello"]]', feature="completions"))
    # Fields are length-prefixed: moving bytes between user id and prefix changes the id.
    assert session_id(b"s", "ab", parsed(b"c")) != session_id(b"s", "a", parsed(b"bc"))
    assert session_id(b"secret", "alice", parsed(None)) is None


def test_an_unreachable_provider_gets_a_closed_code_and_the_details_stay_in_the_access_log(gateway):
    """Last in this module: it stops the iris-1 simulator. Envoy's own 503 carries
    upstream_unavailable; its details (upstream_reset_before_response_started{...}) are only in
    the access log."""
    clear_routing_state(redis_client(gateway))
    gateway.providers["iris-1"].stop()
    response = post(gateway, "/v1/chat/completions", json=chat_body("nobody home"), user="stranded")
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "upstream_unavailable"
    assert "upstream_reset" not in response.text and "connection" not in response.text
    envoy = gateway.running[0].envoy
    assert wait_until(lambda: "upstream_reset_before_response_started" in envoy.log_tail(20_000), within_seconds=30)
