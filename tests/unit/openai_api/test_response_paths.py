"""Which requests are lookups of a stored response by id (`/v1/responses/{id}` and below), and
the passthrough endpoints' paths and bodies."""

from __future__ import annotations

import pytest

from extproc.openai_api.request import (
    MAX_RESPONSE_ID_CHARS,
    RequestError,
    ResponseLookup,
    feature_for_path,
    parse_request,
    response_lookup,
)


@pytest.mark.parametrize(("method", "path", "expected"), [
    ("GET", "/v1/responses/resp_1", ResponseLookup("resp_1", "retrieve")),
    ("GET", "/v1/responses/resp_1?include[]=message.output_text.logprobs&stream=false", ResponseLookup("resp_1", "retrieve")),
    ("DELETE", "/v1/responses/resp_1", ResponseLookup("resp_1", "delete")),
    ("GET", "/v1/responses/resp_1/input_items?limit=2&order=asc", ResponseLookup("resp_1", "input_items")),
    ("POST", "/v1/responses/resp_1/cancel", ResponseLookup("resp_1", "cancel")),
    ("GET", "/v1/responses/resp:with.odd~chars-1", ResponseLookup("resp:with.odd~chars-1", "retrieve")),
])
def test_lookup_paths(method, path, expected):
    assert response_lookup(method, path) == expected


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/responses?x=1", "/v1/chat/completions",
                                  "/v1/responsesX/resp_1", "/v2/responses/resp_1"])
def test_other_paths_are_not_lookups(path):
    assert response_lookup("GET", path) is None


@pytest.mark.parametrize(("method", "path", "status", "code"), [
    ("POST", "/v1/responses/resp_1", 405, "method_not_allowed"),
    ("PUT", "/v1/responses/resp_1", 405, "method_not_allowed"),
    ("DELETE", "/v1/responses/resp_1/input_items", 405, "method_not_allowed"),
    ("GET", "/v1/responses/resp_1/cancel", 405, "method_not_allowed"),
    ("GET", "/v1/responses/resp_1/output_items", 404, "unknown_url"),
    ("GET", "/v1/responses/resp_1/input_items/x", 404, "unknown_url"),
    ("GET", "/v1/responses//input_items", 404, "unknown_url"),
    ("GET", "/v1/responses/resp_1/", 404, "unknown_url"),  # paths match exactly: a trailing slash is another path
    ("POST", "/v1/responses/resp_1/cancel/", 404, "unknown_url"),
    ("POST", "/v1/responses/", 404, "unknown_url"),
    ("GET", "/v1/responses/" + "r" * (MAX_RESPONSE_ID_CHARS + 1), 404, "response_not_found"),
])
def test_bad_lookups_get_the_routers_errors(method, path, status, code):
    with pytest.raises(RequestError) as error:
        response_lookup(method, path)
    assert (error.value.status, error.value.code) == (status, code)


def test_a_405_names_the_methods_the_path_serves():
    with pytest.raises(RequestError) as error:
        response_lookup("PATCH", "/v1/responses/resp_1")
    assert "use GET or DELETE" in error.value.message


def test_passthrough_paths_serve_their_feature_and_only_when_configured():
    passthrough = {"/tokenize": "tokenize", "/v1/rerank": "rerank"}
    assert feature_for_path("/tokenize", passthrough) == "tokenize"
    assert feature_for_path("/v1/rerank?x=1", passthrough) == "rerank"
    assert feature_for_path("/v1/chat/completions", passthrough) == "chat"
    with pytest.raises(RequestError) as error:
        feature_for_path("/tokenize")
    assert error.value.code == "unknown_url"


@pytest.mark.parametrize("path", ["/v1/chat/completions/", "/v1/embeddings//", "/v1/responses/?x=1", "/v1/rerank/", "//v1/completions"])
def test_paths_match_exactly_and_a_trailing_slash_is_another_path(path):
    """A provider answers such a path with a 404 of its own, after the request took a slot."""
    with pytest.raises(RequestError) as error:
        feature_for_path(path, {"/v1/rerank": "rerank"})
    assert (error.value.status, error.value.code) == (404, "unknown_url")


def test_a_passthrough_body_needs_only_a_model_and_forms_no_prefix_session():
    parsed = parse_request("rerank", b'{"model": "m", "query": "q", "documents": ["a"], "response_format": {"type": "json_schema"}}', 2048)
    assert (parsed.feature, parsed.model, parsed.stable_prefix, parsed.sub_features) == ("rerank", "m", None, frozenset())
    with pytest.raises(RequestError) as error:
        parse_request("tokenize", b'{"prompt": "no model"}', 2048)
    assert error.value.code == "missing_model"
