"""Reading an OpenAI API request: endpoint, model, stream flag, features, and the session id.

The session id is the spec's determine_session_id: a keyed hash (HMAC-BLAKE2b with a configured
secret) of the user id, the model, the feature class and the stable prompt prefix. The stable
prefix is what stays the same over a conversation: for chat, the system/developer messages and
the first user message; for completions, a leading slice of the prompt; for responses, the
instructions and the first input item. Embeddings have none, so they never form sessions.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import orjson


class RequestError(Exception):
    """A request that cannot be routed. Carries the HTTP status and OpenAI error fields."""

    def __init__(self, status: int, message: str, code: str, error_type: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.error_type = error_type
        self.param = param


ENDPOINTS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
    "/v1/responses": "responses",
}

MODELS_PATH = "/v1/models"
RESPONSES_PATH = "/v1/responses"

# What may follow `/v1/responses/{id}` and the method each serves (OpenAI's API reference:
# retrieve, delete, list input items, cancel a background response).
RESPONSE_ACTIONS = {
    ("", "GET"): "retrieve",
    ("", "DELETE"): "delete",
    ("/input_items", "GET"): "input_items",
    ("/cancel", "POST"): "cancel",
}
MAX_RESPONSE_ID_CHARS = 512  # as the chain record's reader (extproc.openai_api.chains)

_IMAGE_PART_TYPES = frozenset({"image_url", "input_image", "image"})
_STRING_OR_NULL = (str, type(None))  # what a message's, an input item's or a content part's `type` may be


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """An OpenAI request as routing sees it. `stable_prefix` is canonical bytes, or None when the
    request forms no session. `body` is the decoded JSON object."""

    feature: str
    model: str
    stream: bool
    sub_features: frozenset[str]
    stable_prefix: bytes | None
    body: dict[str, Any]


def feature_for_path(path: str, passthrough: Mapping[str, str] | None = None) -> str:
    """The feature class served at `path` (query string ignored): one of ENDPOINTS, else the
    feature of a configured passthrough endpoint (`passthrough`: path -> feature). The path is
    matched exactly: a trailing slash is another path, which a provider would refuse with a 404
    of its own after the request took a slot (docs/endpoints.md). Raises RequestError (404)."""
    bare = path.split("?", 1)[0]
    feature = ENDPOINTS.get(bare)
    if feature is None and passthrough:
        feature = passthrough.get(bare)
    if feature is None:
        raise RequestError(404, f"unknown endpoint {path[:200]!r}", "unknown_url")
    return feature


@dataclass(frozen=True, slots=True)
class ResponseLookup:
    """A request for a stored response by id: `action` is `retrieve` (GET
    /v1/responses/{id}), `delete` (DELETE /v1/responses/{id}), `input_items` (GET
    /v1/responses/{id}/input_items) or `cancel` (POST /v1/responses/{id}/cancel)."""

    response_id: str
    action: str


def response_lookup(method: str, path: str) -> ResponseLookup | None:
    """The stored-response request `method` `path` makes (query string ignored; the path matched
    exactly, as `feature_for_path` matches it), or None when `path` is not under
    `/v1/responses/`. Raises RequestError: 405 (method_not_allowed) for a method the path does
    not serve, 404 (unknown_url) for another path below `/v1/responses/` (a trailing slash, an
    empty id), 404 (response_not_found) for an id longer than MAX_RESPONSE_ID_CHARS."""
    bare = path.split("?", 1)[0]
    if not bare.startswith(RESPONSES_PATH + "/"):
        return None
    response_id, slash, rest = bare[len(RESPONSES_PATH) + 1:].partition("/")
    suffix = slash + rest
    methods = [m for (s, m) in RESPONSE_ACTIONS if s == suffix]
    if not methods or not response_id:
        raise RequestError(404, f"unknown endpoint {path[:200]!r}", "unknown_url")
    action = RESPONSE_ACTIONS.get((suffix, method))
    if action is None:
        allowed = " or ".join(methods)
        raise RequestError(405, f"method {method[:20]!r} is not allowed here: use {allowed}", "method_not_allowed")
    if len(response_id) > MAX_RESPONSE_ID_CHARS:
        raise RequestError(404, "no response with that id was found", "response_not_found", param="response_id")
    return ResponseLookup(response_id, action)


def parse_request(feature: str, raw: bytes, completions_prefix_chars: int) -> ParsedRequest:
    """Decode and check the body of a request for `feature` (a feature class, or the feature of a
    passthrough endpoint: then only `model` and `stream` are read, the request has no stable
    prefix and no sub-feature). Raises RequestError (400) for a body
    that is not a JSON object (invalid JSON, not UTF-8, nested too deep), lacks required fields or
    holds a message, input item or content part whose `type` is not a string (`invalid_type`,
    naming the field: `messages[0].content[1].type must be a string`)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RequestError(400, _json_error_text(exc), "invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError(400, "request body must be a JSON object", "invalid_json")
    _check_writable_depth(raw, body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError(400, "'model' is required and must be a non-empty string", "missing_model", param="model")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(400, "'stream' must be a boolean", "invalid_type", param="stream")
    stable_prefix = _STABLE_PREFIX.get(feature)
    if stable_prefix is None:  # a passthrough endpoint: no prompt to key a session, no sub-feature
        return ParsedRequest(feature, model, stream, frozenset(), None, body)
    return ParsedRequest(feature, model, stream, _sub_features(body), stable_prefix(body, completions_prefix_chars), body)


# orjson reads 1024 levels of nesting but writes fewer (254 in orjson 3.10): a body the provider
# adaptation could not write again is refused here. A body with fewer brackets than this, counted
# at C speed, cannot be deeper, so only suspicious bodies pay for the trial encoding.
_BRACKETS_SURELY_WRITABLE = 200


def _json_error_text(exc: orjson.JSONDecodeError) -> str:
    """What is wrong with a body orjson refused, and where, in the client's words (orjson calls
    every byte that is not UTF-8 a surrogate; a compressed body is full of them)."""
    if exc.msg.startswith("str is not valid UTF-8"):
        return "request body is not UTF-8 text (a compressed body must be decompressed before the router)"
    return f"request body is not valid JSON: {exc.msg} (at position {exc.pos})"


def _check_writable_depth(raw: bytes, body: dict[str, Any]) -> None:
    """Raises RequestError (400, invalid_json) for a body nested deeper than orjson writes."""
    if raw.count(b"[") + raw.count(b"{") <= _BRACKETS_SURELY_WRITABLE:
        return
    try:
        orjson.dumps(body)
    except TypeError:  # orjson.JSONEncodeError: "Recursion limit reached"
        raise RequestError(400, "request body is nested too deeply", "invalid_json") from None


def session_id(secret: bytes, user_id: str, request: ParsedRequest) -> str | None:
    """The spec's determine_session_id: None when the request has no stable prompt prefix, else
    a hex keyed hash of (user id, model, feature class, stable prefix). Without the secret a
    client can neither compute nor guess another user's session id."""
    if request.stable_prefix is None:
        return None
    return keyed_hash(secret, user_id.encode(), request.model.encode(), request.feature.encode(), request.stable_prefix)


def keyed_hash(secret: bytes, *parts: bytes) -> str:
    """HMAC-BLAKE2b of the length-prefixed `parts` with `secret`, as 32 hex characters: no two
    different part lists give the same input."""
    mac = hmac.new(secret, digestmod=hashlib.blake2b)
    for part in parts:
        mac.update(len(part).to_bytes(8, "big"))
        mac.update(part)
    return mac.hexdigest()[:32]


def _chat_prefix(body: dict[str, Any], _: int) -> bytes | None:
    messages = _require_list(body, "messages")
    stable = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError(400, "each message needs a string 'role'", "invalid_type", param="messages")
        role = message["role"]
        if role in ("system", "developer"):
            stable.append([role, message.get("content")])
        elif role == "user":
            stable.append([role, message.get("content")])
            break
    return _canonical(stable) if stable else None


def _completions_prefix(body: dict[str, Any], prefix_chars: int) -> bytes | None:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompt = prompt[0]
    if isinstance(prompt, list):  # token ids
        if not all(isinstance(t, int) for t in prompt):
            raise RequestError(400, "'prompt' must be a string, strings or token ids", "invalid_type", param="prompt")
        return _canonical(prompt[:prefix_chars]) if prompt else None
    if not isinstance(prompt, str):
        raise RequestError(400, "'prompt' is required and must be a string", "invalid_type", param="prompt")
    return prompt[:prefix_chars].encode() if prompt else None


def _embeddings_prefix(body: dict[str, Any], _: int) -> None:
    if not isinstance(body.get("input"), (str, list)):
        raise RequestError(400, "'input' is required and must be a string or a list", "invalid_type", param="input")
    return None


def _responses_prefix(body: dict[str, Any], _: int) -> bytes | None:
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise RequestError(400, "'input' is required and must be a string or a list", "invalid_type", param="input")
    stable: list[Any] = [["instructions", body.get("instructions")]] if body.get("instructions") else []
    for item in items:
        if isinstance(item, dict) and item.get("role") in ("system", "developer"):
            stable.append([item["role"], item.get("content")])
        elif isinstance(item, dict) and item.get("role") == "user":
            stable.append(["user", item.get("content")])
            break
    return _canonical(stable) if stable else None


_STABLE_PREFIX = {
    "chat": _chat_prefix,
    "completions": _completions_prefix,
    "embeddings": _embeddings_prefix,
    "responses": _responses_prefix,
}


def _require_list(body: dict[str, Any], field: str) -> list[Any]:
    value = body.get(field)
    if not isinstance(value, list) or not value:
        raise RequestError(400, f"'{field}' is required and must be a non-empty list", "invalid_type", param=field)
    return value


def _canonical(value: Any) -> bytes:
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except TypeError:
        raise RequestError(400, "request holds a value that cannot be read", "invalid_type") from None


def _sub_features(body: dict[str, Any]) -> frozenset[str]:
    """The sub-features `body` uses (tools, json_schema, vision). Raises RequestError (400,
    invalid_type) for a message, input item or content part whose `type` is not a string."""
    found = set()
    if body.get("tools") or body.get("functions"):
        found.add("tools")
    response_format = body.get("response_format")
    text_format = body.get("text", {}).get("format") if isinstance(body.get("text"), dict) else None
    for fmt in (response_format, text_format):
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
            found.add("json_schema")
    # Both lists are always walked (no short cut), so a malformed `type` in either is refused.
    in_messages = _has_image(body.get("messages"), "messages")
    in_input = _has_image(body.get("input"), "input")
    if in_messages or in_input:
        found.add("vision")
    return frozenset(found)


def _has_image(items: Any, field: str) -> bool:
    """Whether `items` (the value of the body's `field`: chat messages or Responses input items)
    is a list holding an image content part (`items[i].content[j].type`). Other shapes are
    ignored: `items` not a list, an item not an object, a `content` not a list, a part not an
    object. Raises RequestError (400, invalid_type) for an item or a part whose `type` is not a
    string (nor null)."""
    if not isinstance(items, list):
        return False
    found = False
    for item in items:  # the hot path: no index counted, no call made unless a `type` is wrong
        if not isinstance(item, dict):
            continue
        if not isinstance(item.get("type"), _STRING_OR_NULL):
            raise _type_error(items, field)
        content = item.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str):
                found = found or kind in _IMAGE_PART_TYPES
            elif kind is not None:  # a list or an object cannot even be looked up (unhashable)
                raise _type_error(items, field)
    return found



def _type_error(items: list[Any], field: str) -> RequestError:
    """The 400 (invalid_type) naming the first item or part of `items` (the body's `field`) whose
    `type` is neither a string nor null, for example `messages[0].content[1].type must be a string`."""
    for where, value in _typed_objects(items, field):
        if not isinstance(value.get("type"), _STRING_OR_NULL):
            return RequestError(400, f"{where}.type must be a string", "invalid_type", param=f"{where}.type")
    return RequestError(400, f"'{field}' holds a 'type' that is not a string", "invalid_type", param=field)  # not reached


def _typed_objects(items: list[Any], field: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(location, object) for each object item of `items` and each object part of its `content`
    list, in order: (`messages[0]`, item), (`messages[0].content[0]`, part), ..."""
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            continue
        yield f"{field}[{i}]", item
        content = item.get("content")
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if isinstance(part, dict):
                yield f"{field}[{i}].content[{j}]", part
