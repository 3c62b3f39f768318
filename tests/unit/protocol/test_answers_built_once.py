"""Issue 24: answers that depend on nothing of the request, or on a small key, are built once and
shared; what is the request's own (the routing metadata, the decision time, the session's
headers) is built per request; memoised answers are keyed by their whole content, so a reload
that changes a value (retry-after, a provider's name) gets a new answer, never a stale one.
Metric children are made once per label tuple (extproc.metrics.child)."""

from __future__ import annotations

import orjson
from prometheus_client import REGISTRY

from extproc import metrics
from extproc.protocol import answers
from extproc.protocol import messages as msg
from extproc.routing.lease_table import Refusal
from extproc.routing.router import Rejection, RejectionKind


def headers_of(mutation) -> dict[str, str]:
    return {option.header.key: option.header.raw_value.decode() for option in mutation.set_headers}


def test_constant_answers_are_shared():
    assert msg.continue_request_body() is msg.continue_request_body()
    assert msg.continue_response_body() is msg.continue_response_body()
    assert msg.continue_response_trailers() is msg.continue_response_trailers()
    assert msg.continue_request_headers(["x-a", "x-b"]) is msg.continue_request_headers(["x-a", "x-b"])
    assert list(msg.continue_request_headers(["x-a", "x-b"]).request_headers.response.header_mutation.remove_headers) == ["x-a", "x-b"]
    assert msg.internal_error() is msg.internal_error()
    assert msg.continue_response_body(b"x") is not msg.continue_response_body(b"x")  # a rewritten chunk is the request's


def test_response_headers_answers_are_keyed_by_their_content():
    first = msg.continue_response_headers({"x-iris-provider": "p1", "x-iris-route-reason": "pinned"})
    assert first is msg.continue_response_headers({"x-iris-provider": "p1", "x-iris-route-reason": "pinned"})
    other = msg.continue_response_headers({"x-iris-provider": "p2", "x-iris-route-reason": "pinned"})
    assert headers_of(other.response_headers.response.header_mutation)["x-iris-provider"] == "p2"
    read = msg.continue_response_headers(None, "STREAMED", ["content-length"])
    assert read.mode_override.response_body_mode == msg.processing_mode("STREAMED").response_body_mode
    assert list(read.response_headers.response.header_mutation.remove_headers) == ["content-length"]
    assert not msg.continue_response_headers().HasField("mode_override")


def test_the_routing_answer_is_the_requests_own():
    def route(cluster: str, decision_ms: float):
        return msg.route_to_cluster("x-iris-cluster", cluster, {"x-iris-affinity": "k", "x-iris-cluster": "forged"}, ["x-user-id"],
                                    None, {"provider": cluster, "decision_ms": decision_ms})

    one, two = route("iris-1", 1.5), route("iris-2", 2.5)
    common = one.request_body.response
    assert common.clear_route_cache and list(common.header_mutation.remove_headers) == ["x-user-id"]
    assert headers_of(common.header_mutation) == {"x-iris-cluster": "iris-1", "x-iris-affinity": "k"}  # the routing header wins
    assert headers_of(two.request_body.response.header_mutation)["x-iris-cluster"] == "iris-2"
    fields = one.dynamic_metadata.fields[msg.METADATA_NAMESPACE].struct_value.fields
    assert fields["decision_ms"].number_value == 1.5 and fields["provider"].string_value == "iris-1"
    assert two.dynamic_metadata.fields[msg.METADATA_NAMESPACE].struct_value.fields["decision_ms"].number_value == 2.5
    body = msg.route_to_cluster("x-iris-cluster", "iris-1", {"content-length": "999"}, None, b"{}")
    assert headers_of(body.request_body.response.header_mutation) == {"x-iris-cluster": "iris-1", "content-length": "2"}
    assert body.request_body.response.body_mutation.body == b"{}"


def test_fixed_refusals_are_built_once_yet_carry_their_own_metadata_and_the_configs_retry_after():
    one = answers.refusal(Refusal.OVERLOADED, "m", 1, 0.5)
    two = answers.refusal(Refusal.OVERLOADED, "m", 1, 0.7)
    assert one is not two and one.immediate_response == two.immediate_response
    assert one.dynamic_metadata.fields[msg.METADATA_NAMESPACE].struct_value.fields["decision_ms"].number_value == 0.5
    assert two.dynamic_metadata.fields[msg.METADATA_NAMESPACE].struct_value.fields["decision_ms"].number_value == 0.7
    reloaded = answers.refusal(Refusal.OVERLOADED, "m", 7, 0.5)  # server.retry_after_seconds changed by a reload
    assert headers_of(reloaded.immediate_response.headers)["retry-after"] == "7"
    assert headers_of(one.immediate_response.headers) == {"content-type": "application/json", "retry-after": "1"}
    rejected = answers.routing_rejection(Rejection(RejectionKind.CAPACITY, "every provider of model 'm' is at capacity"), "m", 2, 1.0)
    assert rejected.immediate_response.status.code == 429
    assert orjson.loads(rejected.immediate_response.body)["error"]["code"] == "capacity_exceeded"


def test_a_metric_child_is_made_once_and_counts():
    labels = {"provider": "p-trims", "kind": "managed", "gen_ai_request_model": "m-trims", "reason": "pinned"}
    before = REGISTRY.get_sample_value("iris_routing_decisions_total", labels) or 0.0
    child = metrics.child(metrics.DECISIONS, *labels.values())
    assert child is metrics.child(metrics.DECISIONS, *labels.values())
    assert child is metrics.DECISIONS.labels(*labels.values())  # prometheus-client's own child: the same series
    child.inc()
    metrics.child(metrics.DECISIONS, *labels.values()).inc(2)
    assert REGISTRY.get_sample_value("iris_routing_decisions_total", labels) == before + 3
