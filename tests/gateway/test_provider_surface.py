"""What a provider receives of a client's request, and which paths reach one at all (issue 29,
items 7, 10, 15 and 16), through real Envoy, Redis and simulated providers, tracing on:

- a third party gets no trace context nor W3C `baggage`, on a generation and on every lookup of
  a stored response by id (GET, input_items, cancel, DELETE); an own provider gets them;
- a provider that compresses when the client accepts it (as public APIs do; the openai SDK sends
  `accept-encoding: gzip, deflate`) is asked for plain bytes when the router reads the answer,
  so the model is renamed, the usage counted and the chain recorded (`responses.retrieve()`);
- a trailing slash is another path: 404 `unknown_url` from the router, no slot, no pin, nothing
  sent to a provider;
- on a provider with its own router (`affinity: own_router`), a request without a session loses
  the client's own copy of the header that router reads, and one with a session gets the
  session's key in it, never the client's value.
"""

from __future__ import annotations

import secrets

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from irislab.local_gateway import LocalGateway, ProviderSimulation
from irislab.otlp_collector import OtlpCollector
from tests.support.gateway import MODEL, clear_routing_state, live_leases, provider_stats, redis_client, wait_until

EXTERNAL = "ext-chat"  # served by the third party only, under its own name UPSTREAM
UPSTREAM = "vendor/chat-large"
OWN_EMBED, OWN_CHAT = "own-embed", "own-chat"  # served by iris-2 only, behind its own (SGLang) router
ROUTER_HEADER = "x-smg-routing-key"
LIMITS = {"max_pinned_sessions": 8, "max_global_in_flight_request_slots": 8}
WITHHELD = ("traceparent", "tracestate", "baggage")
BOUND = 20.0  # seconds: a generous bound for a metric or a span to show


@pytest.fixture(scope="module")
def collector():
    with OtlpCollector() as running:
        yield running


@pytest.fixture(scope="module")
def gw(tmp_path_factory, collector):
    data = {
        "lease_timeout_seconds": 30,
        "redis": {"key_prefix": "surface"},
        "session": {"trusted_identity_headers": ["x-user-id"]},
        "server": {"expose_routing_headers": True},
        "tracing": {"otlp_endpoint": collector.endpoint, "service_name": "iris-surface"},
        "providers": [
            {"name": "iris-1", "kind": "managed", "cluster": "iris-1",
             "models": {MODEL: {"features": ["chat", "responses"], "limits": LIMITS}}},
            {"name": "iris-2", "kind": "managed", "cluster": "iris-2", "affinity": "own_router", "router_session_header": "sglang",
             "models": {OWN_EMBED: {"features": ["embeddings"], "limits": LIMITS},
                        OWN_CHAT: {"features": ["chat"], "limits": LIMITS}}},
            {"name": "tensorx", "kind": "unlimited", "cluster": "tensorx",
             "models": {EXTERNAL: {"features": ["chat", "responses"], "upstream_model": UPSTREAM}}},
        ],
    }
    sims = {name: ProviderSimulation(ttft_ms=1, per_token_ms=1) for name in ("iris-1", "iris-2")}
    sims["tensorx"] = ProviderSimulation(ttft_ms=1, per_token_ms=1, gzip=True)  # compresses whenever the client accepts it
    with LocalGateway(config_data=data, simulations=sims, work_dir=tmp_path_factory.mktemp("surface"),
                      env={"OTEL_BSP_SCHEDULE_DELAY": "100"}) as gateway:
        yield gateway


def sdk(gw: LocalGateway, user: str, **headers: str) -> openai.OpenAI:
    """The openai SDK as an application uses it (its default `accept-encoding: gzip, deflate`)."""
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key="sk-client", default_headers={"x-user-id": user, **headers}, max_retries=0)


def seen(gw: LocalGateway, provider: str) -> dict[str, str]:
    """The headers of the last request `provider` received."""
    return provider_stats(gw, provider)["last_request_headers"][-1]


def received(gw: LocalGateway, provider: str) -> int:
    stats = provider_stats(gw, provider)
    return stats["requests"] + stats["in_flight"] + sum(stats["response_lookups"].values())


def trace_headers() -> dict[str, str]:
    return {"traceparent": f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01", "tracestate": "vendor=1",
            "baggage": "user.id=alice,session.id=s-42"}


def tokens(gw: LocalGateway, provider: str) -> float:
    """iris_tokens_total of `provider`, every model and token type."""
    text = httpx.get(gw.running[0].metrics_url, timeout=10).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "iris_tokens_total" and sample.labels["provider"] == provider)


def test_a_third_party_gets_no_trace_context_nor_baggage_on_a_generation_or_a_lookup(gw):
    client = sdk(gw, "alice", **trace_headers())
    created = client.responses.with_raw_response.create(model=EXTERNAL, input="remember this", max_output_tokens=2)
    assert created.headers["x-iris-provider"] == "tensorx"
    response_id = created.parse().id
    assert not set(WITHHELD) & set(seen(gw, "tensorx"))
    lookups = {
        "retrieve": lambda: client.responses.retrieve(response_id),
        "input_items": lambda: client.responses.input_items.list(response_id),
        "delete": lambda: client.responses.delete(response_id),
    }
    for action, lookup in lookups.items():
        lookup()
        assert not set(WITHHELD) & set(seen(gw, "tensorx")), action
    background = client.responses.create(model=EXTERNAL, input="slow", max_output_tokens=5000, background=True)
    assert client.responses.cancel(background.id).status == "cancelled"
    assert not set(WITHHELD) & set(seen(gw, "tensorx"))
    own = client.responses.with_raw_response.create(model=MODEL, input="remember this", max_output_tokens=2)
    assert own.headers["x-iris-provider"] == "iris-1"
    client.responses.retrieve(own.parse().id)
    assert set(WITHHELD) <= set(seen(gw, "iris-1"))  # an own provider gets them (its traceparent: the client's, as no span runs)


def test_a_compressing_provider_still_gets_its_answers_renamed_counted_and_chained(gw):
    client = sdk(gw, "bob")
    before = tokens(gw, "tensorx")
    chat = client.chat.completions.with_raw_response.create(model=EXTERNAL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert chat.headers["x-iris-provider"] == "tensorx"
    assert seen(gw, "tensorx")["accept-encoding"] == "identity"  # the router reads this answer
    answer = chat.parse()
    assert answer.model == EXTERNAL  # renamed: the answer was plain bytes
    counted = answer.usage.prompt_tokens + answer.usage.completion_tokens
    assert wait_until(lambda: tokens(gw, "tensorx") - before == counted, BOUND), (tokens(gw, "tensorx") - before, counted)
    chunks = list(client.chat.completions.create(model=EXTERNAL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                                 stream=True, stream_options={"include_usage": True}))
    assert {chunk.model for chunk in chunks} == {EXTERNAL}
    stored = client.responses.create(model=EXTERNAL, input="keep me", max_output_tokens=2)
    retrieved = client.responses.with_raw_response.retrieve(stored.id)  # found: the chain was recorded
    assert retrieved.headers["x-iris-provider"] == "tensorx" and retrieved.parse().model == EXTERNAL
    assert seen(gw, "tensorx")["accept-encoding"] == "identity"
    assert client.responses.create(model=EXTERNAL, input="and then", previous_response_id=stored.id, max_output_tokens=2).model == EXTERNAL


def test_an_answer_the_router_does_not_read_keeps_the_clients_accept_encoding(gw):
    client = sdk(gw, "carol")
    client.chat.completions.create(model=OWN_CHAT, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert seen(gw, "iris-2")["accept-encoding"] != "identity"  # an own provider's chat answer is not read


@pytest.mark.parametrize("method, path, body", [
    ("POST", "/v1/chat/completions/", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("POST", "/v1/responses/", {"model": MODEL, "input": "hi", "max_output_tokens": 2}),
    ("GET", "/v1/responses/resp_1/", None),
])
def test_a_trailing_slash_is_an_unknown_url_that_takes_no_slot_nor_pin(gw, method, path, body):
    redis = redis_client(gw)
    clear_routing_state(redis)
    before = received(gw, "iris-1")
    refused = httpx.request(method, f"{gw.url}{path}", json=body, headers={"x-user-id": "dave", "x-session-id": "s1"}, timeout=30)
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "unknown_url", refused.text
    assert live_leases(redis) == 0
    assert redis.keys("*:pin:*") == [] and redis.keys("*:pins:*") == []
    assert received(gw, "iris-1") == before
    if body is not None:  # the exact path routes, pins and is answered
        routed = httpx.post(f"{gw.url}{path.rstrip('/')}", json=body, headers={"x-user-id": "dave", "x-session-id": "s1"}, timeout=30)
        assert routed.status_code == 200 and routed.headers["x-iris-provider"] == "iris-1"
        assert len(redis.keys("*:pin:*")) == 1


def test_a_client_cannot_pick_the_replica_behind_a_providers_own_router(gw):
    client = sdk(gw, "erin", **{ROUTER_HEADER: "replica-3"})
    embedded = client.embeddings.with_raw_response.create(model=OWN_EMBED, input="no session here")
    assert embedded.headers["x-iris-provider"] == "iris-2"
    assert ROUTER_HEADER not in seen(gw, "iris-2")  # sessionless: the client's copy is gone
    client.chat.completions.create(model=OWN_CHAT, messages=[{"role": "user", "content": "a session"}], max_tokens=2)
    key = seen(gw, "iris-2")[ROUTER_HEADER]
    assert key != "replica-3" and len(key) == 32  # the session's opaque key, set over the client's
