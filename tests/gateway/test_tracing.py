"""Tracing and token accounting through the whole gateway (issue 22): real Envoy, Redis and
simulated providers, and a real OTLP/gRPC collector (irislab.otlp_collector) the ext_proc server
exports its spans to.

- every routed request gives one span with the documented GenAI and routing attributes, and
  nothing of the client's identity;
- a client's `traceparent` becomes the span's parent; the provider receives a `traceparent`
  whose trace id is the span's and whose parent is the span; a third party receives none;
- a request the router answers itself gives an error span;
- `iris_tokens_total` equals the usage the provider reported, streamed and not; a stream without
  usage counts in `iris_usage_unreported_total`; an own provider's answers are not read by default.
"""

from __future__ import annotations

import secrets

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from irislab.local_gateway import LocalGateway, ProviderSimulation
from irislab.otlp_collector import OtlpCollector, ReceivedSpan
from tests.support.gateway import MODEL, chat_body, gateway_config, post, provider_stats, wait_until

BOUND = 20.0  # seconds: a generous bound for a span to arrive (the batch processor exports every 0.1 s here)


def vision_body(text: str, max_tokens: int = 5, **extra) -> dict:
    """A chat request with an image: only the third party (tensorx) serves vision here."""
    content = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, **extra}


@pytest.fixture(scope="module")
def collector():
    with OtlpCollector() as running:
        yield running


@pytest.fixture(scope="module")
def gw(tmp_path_factory, collector):
    config = gateway_config(tracing={"otlp_endpoint": collector.endpoint, "service_name": "iris-test"})
    sims = {name: ProviderSimulation(ttft_ms=5, per_token_ms=2, block_tokens=8) for name in ("iris-1", "iris-2", "tensorx")}
    gateway = LocalGateway(config_data=config, simulations=sims, work_dir=tmp_path_factory.mktemp("tracing"),
                           env={"OTEL_BSP_SCHEDULE_DELAY": "100"})
    with gateway:
        yield gateway


def traceparent() -> tuple[str, str, str]:
    """(header value, trace id, parent span id) of a fresh sampled client context."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def span_of(collector: OtlpCollector, trace_id: str) -> ReceivedSpan:
    spans = collector.wait_for(lambda spans: any(s.trace_id == trace_id for s in spans), BOUND)
    found = [s for s in spans if s.trace_id == trace_id]
    assert len(found) == 1, found
    return found[0]


def last_headers(gw: LocalGateway, provider: str) -> dict[str, str]:
    return provider_stats(gw, provider)["last_request_headers"][-1]


def reset(gw: LocalGateway) -> None:
    for name in gw.providers:
        httpx.post(f"{gw.provider_url(name)}/stats/reset", timeout=5)


def tokens(gw: LocalGateway) -> dict[tuple, float]:
    """iris_tokens_total and iris_usage_unreported_total samples: {(name, provider, token type or ""): value}."""
    text = httpx.get(gw.running[0].metrics_url, timeout=10).text
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in ("iris_tokens_total", "iris_usage_unreported_total"):
                assert sample.labels["gen_ai_request_model"] == MODEL
                key = (sample.name, sample.labels["provider"], sample.labels.get("gen_ai_token_type", ""))
                found[key] = sample.value
    return found


def delta(before: dict, after: dict) -> dict:
    return {key: after[key] - before.get(key, 0) for key in after if after[key] != before.get(key, 0)}


def test_a_routed_request_gives_one_span_with_the_genai_and_routing_attributes(gw, collector):
    reset(gw)
    header, trace_id, client_span = traceparent()
    user = f"alice-{secrets.token_hex(4)}"
    response = post(gw, "/v1/chat/completions", user=user, json=chat_body("hello there"), headers={"traceparent": header})
    assert response.status_code == 200 and response.headers["x-iris-provider"] == "iris-1"
    span = span_of(collector, trace_id)
    assert (span.name, span.kind, span.status, span.parent_span_id) == (f"chat {MODEL}", "CLIENT", "UNSET", client_span)
    provider_saw = last_headers(gw, "iris-1")
    assert span.attributes == {
        "gen_ai.operation.name": "chat", "gen_ai.provider.name": "openai", "gen_ai.request.model": MODEL,
        "iris.routing.provider": "iris-1", "iris.routing.provider_kind": "managed", "iris.routing.reason": "new_pin",
        "iris.routing.decision_ms": span.attributes["iris.routing.decision_ms"],
        "gen_ai.conversation.id": provider_saw["x-iris-affinity"],  # the opaque session key, never the identity
        "http.response.status_code": 200,
    }
    assert span.attributes["iris.routing.decision_ms"] > 0
    assert span.resource["service.name"] == "iris-test"
    assert user not in orjson.dumps(span.attributes).decode()
    # The provider's parent is the span: same trace, the span's id, sampled.
    assert provider_saw["traceparent"] == f"00-{trace_id}-{span.span_id}-01"


def test_without_a_client_trace_the_span_is_a_root_and_still_reaches_the_provider(gw, collector):
    reset(gw)
    before = {s.span_id for s in collector.spans()}
    response = post(gw, "/v1/chat/completions", user="bob", json=chat_body("no trace here"))
    assert response.status_code == 200
    received = last_headers(gw, response.headers["x-iris-provider"])["traceparent"]
    _, trace_id, parent, flags = received.split("-")
    span = span_of(collector, trace_id)
    assert (span.span_id, span.parent_span_id, int(flags, 16) & 1) == (parent, "", 1)  # bit 0: sampled
    assert span.span_id not in before


def test_a_third_party_gets_no_trace_context_and_its_usage_is_on_the_span(gw, collector):
    reset(gw)
    header, trace_id, _ = traceparent()
    response = post(gw, "/v1/chat/completions", user="carol", json=vision_body("look"),
                    headers={"traceparent": header, "tracestate": "vendor=1"})
    assert response.status_code == 200 and response.headers["x-iris-provider"] == "tensorx"
    seen = last_headers(gw, "tensorx")
    assert "traceparent" not in seen and "tracestate" not in seen
    span = span_of(collector, trace_id)
    usage = response.json()["usage"]
    assert (span.attributes["gen_ai.usage.input_tokens"], span.attributes["gen_ai.usage.output_tokens"]) == (
        usage["prompt_tokens"], usage["completion_tokens"])


def test_a_request_the_router_answers_gives_an_error_span(gw, collector):
    header, trace_id, client_span = traceparent()
    body = {"model": "bge-m3", "messages": [{"role": "user", "content": "hi"}]}  # bge-m3 is an embeddings model
    response = post(gw, "/v1/chat/completions", user="dave", json=body, headers={"traceparent": header})
    assert response.status_code == 400 and response.json()["error"]["code"] == "unsupported_feature"
    span = span_of(collector, trace_id)
    assert (span.name, span.status, span.parent_span_id) == ("chat bge-m3", "ERROR", client_span)
    assert {k: span.attributes[k] for k in ("iris.routing.reason", "error.type", "http.response.status_code")} == {
        "iris.routing.reason": "rejected", "error.type": "unsupported_feature", "http.response.status_code": 400}
    assert "iris.routing.provider" not in span.attributes


def test_tokens_equal_the_usage_the_third_party_reported_streamed_or_not(gw):
    reset(gw)
    before = tokens(gw)
    plain = post(gw, "/v1/chat/completions", user="erin", json=vision_body("one two three", max_tokens=7))
    assert plain.status_code == 200 and plain.headers["x-iris-provider"] == "tensorx"
    with httpx.Client(timeout=30) as http:
        streamed = http.post(f"{gw.url}/v1/chat/completions", headers={"x-user-id": "erin"},
                             json=vision_body("four five six seven", max_tokens=9, stream=True, stream_options={"include_usage": True}))
    assert streamed.status_code == 200 and streamed.headers["x-iris-provider"] == "tensorx"
    chunks = [orjson.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    reported = [plain.json()["usage"], chunks[-1]["usage"]]
    stats = provider_stats(gw, "tensorx")
    assert (stats["prompt_tokens"], stats["completion_tokens"]) == (
        sum(u["prompt_tokens"] for u in reported), sum(u["completion_tokens"] for u in reported))
    expected = {
        ("iris_tokens_total", "tensorx", "input"): stats["prompt_tokens"],
        ("iris_tokens_total", "tensorx", "output"): stats["completion_tokens"],
    }
    # Counted when Envoy hands the server the body's end, which may come after the client read it.
    wait_until(lambda: delta(before, tokens(gw)) == expected, within_seconds=10)
    assert delta(before, tokens(gw)) == expected


def test_a_stream_without_usage_is_counted_as_unreported_and_own_answers_are_not_read(gw):
    before = tokens(gw)
    with httpx.Client(timeout=30) as http:
        streamed = http.post(f"{gw.url}/v1/chat/completions", headers={"x-user-id": "frank"},
                             json=vision_body("no usage asked", stream=True))
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
    own = post(gw, "/v1/chat/completions", user="frank", json=chat_body("served at home", max_tokens=4))
    assert own.status_code == 200 and own.headers["x-iris-provider"].startswith("iris-")
    expected = {("iris_usage_unreported_total", "tensorx", ""): 1}
    wait_until(lambda: delta(before, tokens(gw)) == expected, within_seconds=10)
    assert delta(before, tokens(gw)) == expected
