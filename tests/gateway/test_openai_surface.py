"""The OpenAI surface beyond generation, end to end (real Envoy, real Redis, simulated providers,
the openai SDK): stored responses by id reach the provider that stores them, answers carry the
model name the client asked for, engine endpoints pass through.

Responses are served by iris-2 and tensorx only (iris-1, first in priority, lacks `responses`),
and tensorx names the model its own way: a lookup sent anywhere else gets a 404 from the
simulator, and a model name left unrewritten shows. A second gateway makes iris-1 a pool of three
replicas: a lookup must reach the one replica that holds the response."""

from __future__ import annotations

import itertools
import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from irislab.local_gateway import LocalGateway, ProviderSimulation
from tests.support.gateway import (
    MODEL,
    clear_routing_state,
    live_leases,
    provider_stats,
    redis_client,
    start_gateway,
    wait_until,
)

UPSTREAM = "tensorx/llama-3.1-70b-instruct"
LIMITS = {"max_pinned_sessions": 8, "max_global_in_flight_request_slots": 8, "max_per_session_in_flight_request_slots": 2}
_users = itertools.count()
# vLLM's four (the default) and one that no model lists.
PASSTHROUGH = {"/tokenize": "tokenize", "/detokenize": "detokenize", "/v1/rerank": "rerank", "/v1/score": "score",
               "/v2/rerank": "rerank_v2"}


def surface_providers() -> list[dict]:
    return [
        {"name": "iris-1", "kind": "managed", "cluster": "iris-1",
         "models": {MODEL: {"features": ["chat", "tokenize", "detokenize"], "limits": LIMITS}}},
        {"name": "iris-2", "kind": "managed", "cluster": "iris-2",
         "models": {MODEL: {"features": ["chat", "responses", "json_schema", "rerank"], "limits": LIMITS}}},
        {"name": "tensorx", "kind": "unlimited", "cluster": "tensorx", "credentials": {"api_key_env": "SURFACE_TX_KEY"},
         "models": {MODEL: {"features": ["chat", "responses", "tools", "score"], "upstream_model": UPSTREAM}}},
    ]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    passthrough = [{"path": p, "feature": f} for p, f in PASSTHROUGH.items()]
    gw = start_gateway(tmp_path_factory.mktemp("surface"), providers=surface_providers(), redis={"key_prefix": "surf"},
                       passthrough_endpoints=passthrough)
    yield gw
    gw.stop()


@pytest.fixture
def gw(gateway):
    clear_routing_state(redis_client(gateway))
    for name in gateway.providers:
        httpx.post(f"{gateway.provider_url(name)}/stats/reset", timeout=5)
    yield gateway
    assert wait_until(lambda: live_leases(redis_client(gateway)) == 0, within_seconds=5), "a lease leaked"


def client(gateway, user: str | None = None) -> openai.OpenAI:
    """An SDK client whose trusted identity (x-user-id, the tests' stand-in for an authenticating
    filter) is `user`, a new one by default."""
    user = user or f"user-{next(_users)}"
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="sk-client", default_headers={"x-user-id": user}, max_retries=0)


def lookups(gateway, name: str) -> dict[str, int]:
    return provider_stats(gateway, name)["response_lookups"]


def counted(gateway, family: str) -> float:
    """The sum of a counter family's samples on the (only) ext_proc server's /metrics."""
    families = text_string_to_metric_families(httpx.get(gateway.running[0].metrics_url, timeout=5).text)
    return sum(s.value for f in families if f.name == family.removesuffix("_total") for s in f.samples if s.name == family)


TOOL = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}


@pytest.mark.parametrize(("provider", "fields"), [("iris-2", {}), ("tensorx", {"tools": [TOOL]})])
def test_a_stored_response_is_retrieved_listed_and_deleted_on_the_provider_that_stores_it(gw, provider, fields):
    alice = client(gw)
    created = alice.responses.with_raw_response.create(model=MODEL, input="hello there", max_output_tokens=2, **fields)
    assert created.headers["x-iris-provider"] == provider
    response_id = created.parse().id

    decisions, routed = counted(gw, "iris_routing_decisions_total"), counted(gw, "iris_response_lookups_total")
    raw = alice.responses.with_raw_response.retrieve(response_id)
    found = raw.parse()
    assert raw.headers["x-simulator-name"] == provider and raw.headers["x-iris-route-reason"] == "response_lookup"
    assert (found.id, found.status, found.output_text, found.model) == (response_id, "completed", "tok0 tok1", MODEL)
    items = alice.responses.input_items.list(response_id)
    assert [(item.role, item.content[0].text) for item in items.data] == [("user", "hello there")]

    with pytest.raises(openai.NotFoundError) as other:  # another identity: the router's 404, no provider asked
        client(gw).responses.retrieve(response_id)
    assert other.value.code == "response_not_found"

    alice.responses.delete(response_id)
    assert redis_client(gw).keys("{surf:*}:response:*") == []  # the chain record went with it
    with pytest.raises(openai.NotFoundError) as gone:
        alice.responses.retrieve(response_id)
    assert gone.value.code == "response_not_found"
    assert lookups(gw, provider) == {"retrieve": 1, "input_items": 1, "delete": 1}
    # three lookups routed, none of them a routing decision: no slot, no lease, no pin touched
    assert (counted(gw, "iris_routing_decisions_total"), counted(gw, "iris_response_lookups_total")) == (decisions, routed + 3)
    assert all(not lookups(gw, name) for name in gw.providers if name != provider)


def test_a_background_response_is_polled_and_cancelled_through_the_gateway(gw):
    bob = client(gw)
    queued = bob.responses.create(model=MODEL, input="poll me", max_output_tokens=2, background=True)
    assert queued.status == "queued"
    done = wait_until(lambda: (r := bob.responses.retrieve(queued.id)).status == "completed" and r, within_seconds=10)
    assert done and done.output_text == "tok0 tok1"
    slow = bob.responses.create(model=MODEL, input="cancel me", max_output_tokens=400, background=True)
    assert bob.responses.cancel(slow.id).status == "cancelled"
    assert lookups(gw, "iris-2")["cancel"] == 1 and provider_stats(gw, "iris-2")["requests"] == 2


def test_lookups_of_unknown_paths_methods_and_ids_get_the_routers_errors(gw):
    url, headers = f"{gw.url}/v1/responses", {"x-user-id": "carol"}
    assert httpx.get(f"{url}/resp_unknown", headers=headers).json()["error"]["code"] == "response_not_found"
    for method, path, status, code in [
        ("PUT", "/resp_1", 405, "method_not_allowed"),
        ("GET", "/resp_1/cancel", 405, "method_not_allowed"),
        ("GET", "/resp_1/other", 404, "unknown_url"),
        ("POST", "/resp_1/cancel", 404, "response_not_found"),
    ]:
        answer = httpx.request(method, url + path, headers=headers)
        assert (answer.status_code, answer.json()["error"]["code"]) == (status, code), (method, path)
    assert all(provider_stats(gw, name)["requests"] == 0 and not lookups(gw, name) for name in gw.providers)


def ext_proc_messages(gateway) -> int:
    text = httpx.get(f"http://127.0.0.1:{gateway.running[0].admin_port}/stats?filter=ext_proc.stream_msgs_sent$", timeout=5).text
    return int(text.split(":")[1])


def test_answers_carry_the_clients_model_name_streamed_and_not(gw):
    dave = client(gw)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]}
    before = ext_proc_messages(gw)
    plain = dave.chat.completions.with_raw_response.create(**chat)
    assert plain.headers["x-iris-provider"] == "tensorx" and plain.parse().model == MODEL
    assert ext_proc_messages(gw) - before == 4  # request headers and body, response headers and body
    chunks = list(dave.chat.completions.create(**chat, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "tok0 tok1 tok2"
    assert chunks[-1].usage.completion_tokens == 3 and {c.model for c in chunks} == {MODEL}

    streamed = list(dave.responses.create(model=MODEL, input="hi", max_output_tokens=2, tools=[TOOL], stream=True))
    models = [e.response.model for e in streamed if e.type in ("response.created", "response.in_progress", "response.completed")]
    assert models == [MODEL] * 3
    assert dave.responses.create(model=MODEL, input="hi", max_output_tokens=2, tools=[TOOL]).model == MODEL
    assert set(provider_stats(gw, "tensorx")["last_request_models"]) == {UPSTREAM}  # the provider did get its own name

    before = ext_proc_messages(gw)  # a provider with the client's name: no body read, as before
    own = client(gw).chat.completions.with_raw_response.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert own.headers["x-iris-provider"] == "iris-1" and own.parse().model == MODEL
    assert ext_proc_messages(gw) - before == 3


def test_engine_endpoints_pass_through_to_the_models_that_list_them(gw):
    headers = {"x-user-id": "erin", "x-session-id": "s-1"}
    for _ in range(3):
        tokens = httpx.post(f"{gw.url}/tokenize", headers=headers, json={"model": MODEL, "prompt": "a b a"})
        assert tokens.status_code == 200 and tokens.headers["x-iris-provider"] == "iris-1"
    assert tokens.json()["tokens"] == [0, 1, 0] and tokens.headers["x-iris-route-reason"] == "pinned"
    text = httpx.post(f"{gw.url}/detokenize", headers=headers, json={"model": MODEL, "tokens": [1, 0]})
    assert text.json() == {"prompt": "b a"}
    rerank = httpx.post(f"{gw.url}/v1/rerank", headers=headers, json={"model": MODEL, "query": "x", "documents": ["x", "y"]})
    assert rerank.headers["x-iris-provider"] == "iris-2" and rerank.json()["results"][0]["index"] == 0
    score = httpx.post(f"{gw.url}/v1/score", headers=headers, json={"model": MODEL, "text_1": "x", "text_2": "x"})
    assert score.headers["x-iris-provider"] == "tensorx" and score.json()["model"] == MODEL  # renamed there and back
    assert json.loads(score.content)["data"][0]["score"] == 1.0
    missing = httpx.post(f"{gw.url}/tokenize", headers=headers, json={"model": "bge-m3", "prompt": "a"})
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "model_not_found")
    unlisted = httpx.post(f"{gw.url}/v2/rerank", headers=headers, json={"model": MODEL, "query": "x", "documents": ["x"]})
    assert (unlisted.status_code, unlisted.json()["error"]["code"]) == (400, "unsupported_feature")
    assert "rerank_v2" in unlisted.json()["error"]["message"]
    wrong = httpx.get(f"{gw.url}/tokenize", headers=headers)
    assert (wrong.status_code, wrong.json()["error"]["code"]) == (405, "method_not_allowed")


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """iris-1 is a pool of three replicas, each keeping its own responses in memory."""
    limits = {"max_pinned_sessions": 100, "max_global_in_flight_request_slots": 16}
    data = {
        "redis": {"key_prefix": "surfpool"},
        "session": {"trusted_identity_headers": ["x-user-id"]},
        "server": {"expose_routing_headers": True},
        "providers": [
            {"name": "iris-1", "kind": "managed", "cluster": "iris-1", "models": {MODEL: {"features": ["chat", "responses"], "limits": limits}}},
            {"name": "tensorx", "kind": "unlimited", "cluster": "tensorx", "models": {MODEL: {"features": ["chat", "responses"]}}},
        ],
    }
    sim = ProviderSimulation(ttft_ms=1, per_token_ms=1)
    with LocalGateway(config_data=data, replicas={"iris-1": 3}, default_simulation=sim, work_dir=tmp_path_factory.mktemp("surfpool")) as gw:
        yield gw


def test_a_lookup_reaches_the_replica_of_a_pool_that_holds_the_response(pool):
    """The lookup carries the session's affinity key: the replica that produced a response (and
    alone holds it) answers for it, whichever of the three that was."""
    frank = client(pool, "frank")
    made = {}
    for session in range(12):
        raw = frank.responses.with_raw_response.create(model=MODEL, input=f"conversation {session} opens", max_output_tokens=1)
        made[raw.parse().id] = raw.headers["x-simulator-name"]
    assert len(set(made.values())) > 1  # the sessions spread over the replicas
    for response_id, replica in made.items():
        raw = frank.responses.with_raw_response.retrieve(response_id)
        assert raw.headers["x-simulator-name"] == replica and raw.parse().id == response_id
