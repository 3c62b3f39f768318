"""Any JSON in any position of a request body (issue 20, item 6): extproc.openai_api.request
parses it or refuses it with a 400 and a code of the closed set, never another exception (a 500
and a traceback in the log per request), and the session key of whatever it parsed never raises.

Valid chat, completions, embeddings and Responses bodies are taken apart: a generated JSON value
(null, boolean, number, string, list or object, nested) replaces the value at any position, or
is added under a field name the parser knows in any object, up to three times per body."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.config import parse_config
from extproc.openai_api.request import ParsedRequest, RequestError, parse_request
from extproc.openai_api.sessions import SessionKeys, conversation_id, previous_response_id
from extproc.protocol.messages import ROUTER_ERROR_CODES
from tests.support.configs import small_config_data

Path = tuple[str | int, ...]

IMAGE = {"url": "data:image/png;base64,AAAA"}
TEMPLATES: dict[str, list[dict[str, Any]]] = {
    "chat": [
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": IMAGE}]},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "42"}]},
            ],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}},
            "stream": True,
            "max_tokens": 5,
            "user": "u1",
            "prompt_cache_key": "pk",
        },
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "input": [{"role": "user", "content": [{"type": "input_text"}]}]},
    ],
    "completions": [
        {"model": "m", "prompt": "once upon a time", "stream": False, "max_tokens": 5, "safety_identifier": "h1"},
        {"model": "m", "prompt": ["first", "second"]},
        {"model": "m", "prompt": [1, 2, 3], "prompt_cache_key": "pk"},
    ],
    "embeddings": [
        {"model": "e", "input": "embed me", "encoding_format": "float"},
        {"model": "e", "input": ["a", "b"], "dimensions": 8},
    ],
    "responses": [
        {
            "model": "m",
            "instructions": "be brief",
            "input": [
                {"role": "developer", "content": "rules"},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "what?"}, {"type": "input_image", "image_url": "x"}]},
                {"type": "function_call_output", "call_id": "c1", "output": "42"},
            ],
            "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}}},
            "tools": [{"type": "function", "name": "f"}],
            "conversation": {"id": "conv_1"},
            "previous_response_id": "resp_1",
            "store": False,
        },
        {"model": "m", "input": "hi", "conversation": "conv_2", "stream": True},
    ],
}

# Field names the parser or the session key read: added to objects that lack them.
FIELDS = [
    "model", "messages", "role", "content", "type", "text", "image_url", "input", "prompt", "instructions", "tools",
    "functions", "response_format", "format", "stream", "user", "safety_identifier", "prompt_cache_key", "conversation",
    "id", "previous_response_id",
]
WORDS = ["image_url", "input_image", "image", "json_schema", "user", "system", "developer", "text", "m"]

_text = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=12)  # orjson writes no lone surrogate
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False, allow_infinity=False)
    | _text | st.sampled_from(WORDS),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.sampled_from(FIELDS) | _text, children, max_size=3),
    max_leaves=8,
)

KEYS = [
    SessionKeys(parse_config(small_config_data()), b"s3cret"),
    SessionKeys(parse_config({**small_config_data(), "session": {"signals": ["prefix"], "identity_sources": ["body"]}}), b"s3cret"),
]
CHAINED = "0123456789abcdef0123456789abcdef"  # a session id chains.lookup found
HEADERS = [{}, {"authorization": "Bearer sk-1", "x-claude-code-session-id": "cc-1"}]


def positions(value: Any, path: Path = ()) -> Iterator[Path]:
    """Every position of a value in the JSON `value`, as a path (the root's is ())."""
    yield path
    if isinstance(value, dict):
        for key, child in value.items():
            yield from positions(child, (*path, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield from positions(child, (*path, index))


def new_positions(value: Any) -> list[Path]:
    """Every position where the JSON `value` has room for one more: in each object, each field of
    FIELDS it lacks; in each list, the position past its end."""
    out = []
    for path in positions(value):
        inner = value
        for step in path:
            inner = inner[step]
        if isinstance(inner, dict):
            out.extend((*path, key) for key in FIELDS if key not in inner)
        elif isinstance(inner, list):
            out.append((*path, len(inner)))
    return out


def replaced(body: Any, path: Path, value: Any) -> Any:
    """A copy of `body` with `value` at `path` (a list index one past the end appends)."""
    if not path:
        return value
    out = copy.deepcopy(body)
    parent = out
    for step in path[:-1]:
        parent = parent[step]
    if isinstance(parent, list) and path[-1] == len(parent):
        parent.append(value)
    else:
        parent[path[-1]] = value
    return out


@st.composite
def fuzzed(draw: st.DrawFn) -> tuple[str, Any]:
    """(feature, body): a template of the feature with generated JSON at 1 to 3 positions, each
    either replacing a value or added (a field of FIELDS in an object, an item after a list's last)."""
    feature = draw(st.sampled_from(sorted(TEMPLATES)))
    body = draw(st.sampled_from(TEMPLATES[feature]))
    for _ in range(draw(st.integers(1, 3))):
        # Half the time a value replaced, else one added (sampled apart: the added ones are many more).
        added = new_positions(body)
        replacing = draw(st.booleans()) or not added
        path = draw(st.sampled_from(list(positions(body)) if replacing else added))
        body = replaced(body, path, draw(json_values))
    return feature, body


def parsed_or_refused(feature: str, raw: bytes) -> ParsedRequest | None:
    """parse_request's answer, or None when it refused the body as it should: a RequestError
    with status 400 and a code of the closed set. Any other exception fails the test."""
    try:
        return parse_request(feature, raw, 16)
    except RequestError as exc:
        assert exc.status == 400, (exc.status, exc.code, exc.message)
        assert exc.code in ROUTER_ERROR_CODES, exc.code
        assert exc.message, exc.code
        return None


def assert_session_keys_hold(request: ParsedRequest) -> None:
    """Identity and session key of `request` under each configuration and header set, with and
    without a chained session: no exception, and a session id that is None or 32 hex digits."""
    conversation_id(request)
    previous_response_id(request)
    for keys in KEYS:
        for headers in HEADERS:
            signals = keys.read_headers(headers)
            identity = keys.identity(signals, request)
            for chained in (None, CHAINED):
                key = keys.session(signals, request, identity, chained)
                assert key.session_id is None or re.fullmatch(r"[0-9a-f]{32}", key.session_id), key


@settings(max_examples=1500, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=fuzzed())
def test_any_json_in_any_position_is_parsed_or_refused_with_a_400(case):
    feature, body = case
    request = parsed_or_refused(feature, orjson.dumps(body))
    if request is not None:
        assert_session_keys_hold(request)


@settings(max_examples=200, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))
@given(feature=st.sampled_from(sorted(TEMPLATES)), body=json_values)
def test_any_json_as_the_whole_body_is_parsed_or_refused_with_a_400(feature, body):
    request = parsed_or_refused(feature, orjson.dumps(body))
    if request is not None:
        assert_session_keys_hold(request)


ALL_SUB_FEATURES = {"tools", "json_schema", "vision"}
TEMPLATE_SUB_FEATURES = {
    "chat": [ALL_SUB_FEATURES, set()], "responses": [ALL_SUB_FEATURES, set()], "completions": [set()] * 3, "embeddings": [set()] * 2,
}


@pytest.mark.parametrize(("feature", "index"), [(f, i) for f, bodies in TEMPLATES.items() for i in range(len(bodies))])
def test_the_templates_are_valid_requests(feature, index):
    request = parse_request(feature, orjson.dumps(TEMPLATES[feature][index]), 16)
    assert request.sub_features == TEMPLATE_SUB_FEATURES[feature][index]
    assert_session_keys_hold(request)


@pytest.mark.parametrize(
    ("feature", "body", "where"),
    [
        ("chat", {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": ["x"]}]}]},
         "messages[0].content[1].type"),
        ("chat", {"model": "m", "messages": [{"role": "user", "content": [{"type": {"a": 1}}]}]}, "messages[0].content[0].type"),
        ("chat", {"model": "m", "messages": [{"role": "user", "content": "hi", "type": 1}]}, "messages[0].type"),
        ("responses", {"model": "m", "input": [{"role": "user", "content": [{"type": ["input_image"]}]}]}, "input[0].content[0].type"),
        ("responses", {"model": "m", "input": ["x", {"type": True}]}, "input[1].type"),
        ("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "input": [{"type": {}}]}, "input[0].type"),
        ("embeddings", {"model": "e", "input": [{"content": [{"type": [1]}]}]}, "input[0].content[0].type"),
    ],
)
def test_a_type_that_is_not_a_string_is_a_400_naming_the_field(feature, body, where):
    with pytest.raises(RequestError) as caught:
        parse_request(feature, orjson.dumps(body), 16)
    assert (caught.value.status, caught.value.code, caught.value.param) == (400, "invalid_type", where)
    assert caught.value.message == f"{where} must be a string"


@pytest.mark.parametrize("kind", [None, "image_url", "input_image", "image", "text", ""])
def test_a_string_or_null_type_keeps_its_meaning(kind):
    part = {"type": kind} if kind is not None else {"type": None, "image_url": IMAGE}
    chat = parse_request("chat", orjson.dumps({"model": "m", "messages": [{"role": "user", "content": [part]}]}), 16)
    responses = parse_request("responses", orjson.dumps({"model": "m", "input": [{"role": "user", "content": [part]}]}), 16)
    vision = kind in ("image_url", "input_image", "image")
    assert ("vision" in chat.sub_features) is ("vision" in responses.sub_features) is vision
