"""Building Envoy ext_proc ProcessingResponse messages (upb-backed types from xds-protos).

Names follow Envoy's API: CommonResponse, HeaderMutation, ImmediateResponse. See
envoy/service/ext_proc/v3/external_processor.proto.

An answer that depends on nothing of the request, or only on a small bounded key (a provider's
name, a route reason, a fixed error), is built once and the same message object is returned to
every caller: the answers returned here are shared and must never be mutated (`with_metadata`
is only ever applied to a message built for the call). Memoised builders are keyed by their
whole content, so a config reload needs no invalidation: a new value is a new key.
"""

from __future__ import annotations

from functools import lru_cache

import orjson
from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    BodyResponse,
    CommonResponse,
    HeaderMutation,
    HeadersResponse,
    HttpHeaders,
    ImmediateResponse,
    ProcessingRequest,
    ProcessingResponse,
    TrailersResponse,
)
from envoy.type.v3.http_status_pb2 import HttpStatus

_OVERWRITE = HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD

METADATA_NAMESPACE = "iris.routing"
"""The dynamic metadata namespace of the router's answers (envoy/envoy.yaml accepts it in the
ext_proc filter's metadata_options.receiving_namespaces and prints it in the access log)."""

DESTINATION_ENDPOINT_HEADER = "x-gateway-destination-endpoint"
"""The Gateway API Inference Extension's endpoint-picker protocol: the endpoints chosen for the
request, `ip:port[,ip:port...]` (the first preferred, the next ones fallbacks), in this request
header and under the same key in LB_METADATA_NAMESPACE; Envoy's override_host load-balancing
policy reads either (extproc.config.envoy_render `_pick_policy`). A client's own copy is removed."""

LB_METADATA_NAMESPACE = "envoy.lb"
"""The dynamic metadata namespace of the endpoint-picker protocol's destination."""

# The closed set of `code` values a client can get from the gateway itself: the router's answers
# (extproc) and Envoy's local replies (envoy/envoy.yaml local_reply_config, the route's
# direct_response). A provider's own error answers pass through as the provider wrote them.
ROUTER_ERROR_CODES = frozenset({
    "unknown_url", "method_not_allowed", "missing_body", "invalid_header", "request_too_large", "invalid_json",
    "missing_model", "invalid_type", "model_not_found", "unsupported_feature", "capacity_exceeded",
    "routing_overloaded", "no_provider_available", "routing_unavailable", "previous_response_unavailable", "internal_error",
    "response_not_found",
})
ENVOY_ERROR_CODES = frozenset({
    "request_too_large", "headers_too_large", "request_timeout", "routing_timeout", "upstream_timeout", "upstream_unavailable",
    "internal_error", "invalid_request", "no_route",
})
CLIENT_ERROR_CODES = ROUTER_ERROR_CODES | ENVOY_ERROR_CODES

EXT_PROC_ATTRIBUTES = "envoy.filters.http.ext_proc"
# Envoy's response flags as the `response.flags` attribute gives them (bit i = CoreResponseFlag i,
# envoy/stream_info/stream_info.h): UR, UF, UC. UO (overflow) is Envoy's own limit, not the provider.
UPSTREAM_REMOTE_RESET = 1 << 4
UPSTREAM_CONNECTION_FAILURE = 1 << 5
UPSTREAM_CONNECTION_TERMINATION = 1 << 6
_UNREACHABLE = UPSTREAM_REMOTE_RESET | UPSTREAM_CONNECTION_FAILURE | UPSTREAM_CONNECTION_TERMINATION


# Set on a request whose answer the router reads (a Responses id, a model name to restore, the
# token usage): a provider that compresses when the client accepts it (the openai SDK sends
# `accept-encoding: gzip, deflate`) answers in plain bytes instead. Envoy's compressor filter,
# placed before ext_proc, compresses toward the client if the operator wants it (docs/endpoints.md).
UNENCODED_ANSWER = {"accept-encoding": "identity"}


def header_map(headers: HttpHeaders) -> dict[str, str]:
    """The headers of a ProcessingRequest phase as a dict of lowercase name -> value. Envoy sends
    values in `raw_value` (bytes); invalid UTF-8 is replaced, never raised."""
    out = {}
    for header in headers.headers.headers:
        value = header.raw_value.decode("utf-8", "replace") if header.raw_value else header.value
        out[header.key.lower()] = value
    return out


def header_value(headers: HttpHeaders, name: str) -> str | None:
    """The value of header `name` (lowercase) of a ProcessingRequest phase, or None; the first
    one when repeated. Reads only up to that header, where `header_map` decodes them all."""
    for header in headers.headers.headers:
        if header.key == name or header.key.lower() == name:
            return header.raw_value.decode("utf-8", "replace") if header.raw_value else header.value
    return None


def upstream_unreachable(request: ProcessingRequest) -> str | None:
    """For a response-headers message: Envoy's response code details (for example
    `upstream_reset_before_response_started{remote_connection_failure|...}`) when the answer is
    Envoy's own because the provider refused the connection or reset it before the response
    headers; None for a provider's own answer. Reads the `response.flags` and
    `response.code_details` attributes that envoy/envoy.yaml asks for (`response_attributes`)."""
    attributes = request.attributes.get(EXT_PROC_ATTRIBUTES)
    if attributes is None:
        return None
    fields = attributes.fields
    flags = int(fields["response.flags"].number_value) if "response.flags" in fields else 0
    details = fields["response.code_details"].string_value if "response.code_details" in fields else ""
    if flags & _UNREACHABLE and details.startswith("upstream_reset_before_response_started"):
        return details
    return None


def upstream_address(request: ProcessingRequest) -> str | None:
    """For a response-headers message: the `ip:port` of the upstream host that answered or failed
    (Envoy's `upstream.address` attribute, asked for in envoy/envoy.yaml's `response_attributes`),
    or None when Envoy sent none (no host was selected, or the attribute is not asked for)."""
    attributes = request.attributes.get(EXT_PROC_ATTRIBUTES)
    if attributes is None or "upstream.address" not in attributes.fields:
        return None
    return attributes.fields["upstream.address"].string_value or None


def header_mutation(set_headers: dict[str, str] | None = None, remove: list[str] | None = None) -> HeaderMutation:
    """A HeaderMutation that overwrites `set_headers` and removes `remove`."""
    return HeaderMutation(
        set_headers=[_overwrite(k, v) for k, v in (set_headers or {}).items()],
        remove_headers=remove or [],
    )


def _overwrite(key: str, value: str) -> HeaderValueOption:
    """The option that overwrites header `key` with `value`."""
    return HeaderValueOption(header=HeaderValue(key=key, raw_value=value.encode()), append_action=_OVERWRITE)


# `_overwrite` built once per pair (the routing header and a cluster's name: bounded by the
# config). Shared: appended as a copy.
_header_option = lru_cache(maxsize=1024)(_overwrite)


def continue_request_headers(remove: list[str]) -> ProcessingResponse:
    """Let the request headers through, removing `remove` (the routing header a client may send).
    Shared (built once per `remove`): never mutate it."""
    return _continue_request_headers(tuple(remove))


@lru_cache(maxsize=64)
def _continue_request_headers(remove: tuple[str, ...]) -> ProcessingResponse:
    common = CommonResponse(header_mutation=header_mutation(remove=list(remove))) if remove else CommonResponse()
    return ProcessingResponse(request_headers=HeadersResponse(response=common))


def with_metadata(response: ProcessingResponse, metadata: dict[str, str | float] | None) -> ProcessingResponse:
    """`response` carrying `metadata` (string or number values) as Envoy dynamic metadata in
    METADATA_NAMESPACE, for the access log: `%DYNAMIC_METADATA(iris.routing:provider)%`."""
    if metadata:
        fields = response.dynamic_metadata.fields[METADATA_NAMESPACE].struct_value.fields
        for key, value in metadata.items():  # field by field: faster than Struct.update
            if isinstance(value, str):
                fields[key].string_value = value
            else:
                fields[key].number_value = value
    return response


def route_to_cluster(
    routing_header: str, cluster: str, extra_headers: dict[str, str] | None = None, remove: list[str] | None = None,
    body: bytes | None = None, metadata: dict[str, str | float] | None = None,
) -> ProcessingResponse:
    """The request-body answer that routes: set `routing_header` to `cluster` and clear the route
    cache in the same CommonResponse, so Envoy re-matches the route with `cluster_header`
    (a clear without a header mutation in the same response is ignored: see the notes).
    A replaced `body` gets its content-length set in the same mutation, as Envoy requires.
    `metadata`: see `with_metadata`. Built for the call (its headers and metadata are the
    request's), filled in place: the routing header's option is shared per cluster. A copy of
    the routing header in `extra_headers` (or of content-length, with a `body`) is ignored."""
    response = ProcessingResponse()
    common = response.request_body.response
    common.clear_route_cache = True
    mutation = common.header_mutation
    set_headers = mutation.set_headers
    set_headers.append(_header_option(routing_header, cluster))
    if extra_headers:
        replaced = (routing_header, "content-length") if body is not None else (routing_header,)
        for key, value in extra_headers.items():
            if key not in replaced:
                _add_header(set_headers, key, value)
    if body is not None:
        _add_header(set_headers, "content-length", str(len(body)))
        common.body_mutation.body = body
    if remove:
        mutation.remove_headers.extend(remove)
    return with_metadata(response, metadata)


def with_destination(response: ProcessingResponse, endpoints: tuple[str, ...]) -> ProcessingResponse:
    """`response` (a request-body answer from `route_to_cluster`, or a request-headers one from
    `route_headers_to_cluster`) naming `endpoints` (`ip:port`, the chosen one first) as the
    endpoint-picker protocol does: the header DESTINATION_ENDPOINT_HEADER and the same key in the
    LB_METADATA_NAMESPACE dynamic metadata. Unchanged when `endpoints` is empty (Envoy's fallback
    policy chooses)."""
    if endpoints:
        value = ",".join(endpoints)
        phase = response.request_headers if response.HasField("request_headers") else response.request_body
        option = phase.response.header_mutation.set_headers.add()
        option.header.key, option.header.raw_value = DESTINATION_ENDPOINT_HEADER, value.encode()
        option.append_action = _OVERWRITE  # never beside a copy a client slipped in
        fields = response.dynamic_metadata.fields[LB_METADATA_NAMESPACE].struct_value.fields
        fields[DESTINATION_ENDPOINT_HEADER].string_value = value
    return response


def _add_header(set_headers, key: str, value: str) -> None:
    option = set_headers.add()
    option.header.key = key
    option.header.raw_value = value.encode()
    option.append_action = _OVERWRITE


def route_headers_to_cluster(
    routing_header: str, cluster: str, extra_headers: dict[str, str] | None = None, remove: list[str] | None = None,
    metadata: dict[str, str | float] | None = None,
) -> ProcessingResponse:
    """The request-headers answer that routes a request without a body (a stored response by id):
    as `route_to_cluster`, in the headers phase, which is the last Envoy sends such a request."""
    common = CommonResponse(clear_route_cache=True)
    common.header_mutation.CopyFrom(header_mutation({routing_header: cluster, **(extra_headers or {})}, remove))
    return with_metadata(ProcessingResponse(request_headers=HeadersResponse(response=common)), metadata)


def continue_response_headers(
    extra_headers: dict[str, str] | None = None, read_body: str | None = None, remove: list[str] | None = None
) -> ProcessingResponse:
    """Let the response headers through, adding `extra_headers` and removing `remove` if any.
    `read_body` ("BUFFERED" or "STREAMED") asks Envoy to send this response's body too, by a mode
    override that keeps every other phase as envoy/envoy.yaml configures it (and that its
    allowed_override_modes lists): only /v1/responses answers (extproc.openai_api.chains) and
    answers whose model name is rewritten (extproc.openai_api.renaming) pay for that.
    Shared (built once per distinct content: the extra headers are a provider's name and a
    route reason, a retry-after): never mutate it."""
    return _continue_response_headers(
        tuple(extra_headers.items()) if extra_headers else (), read_body, tuple(remove) if remove else ()
    )


@lru_cache(maxsize=1024)
def _continue_response_headers(
    extra_headers: tuple[tuple[str, str], ...], read_body: str | None, remove: tuple[str, ...]
) -> ProcessingResponse:
    extra_headers, remove = dict(extra_headers), list(remove)
    mutated = extra_headers or remove
    common = CommonResponse(header_mutation=header_mutation(extra_headers, remove)) if mutated else CommonResponse()
    response = ProcessingResponse(response_headers=HeadersResponse(response=common))
    if read_body is not None:
        response.mode_override.CopyFrom(processing_mode(read_body))
    return response


def processing_mode(response_body_mode: str) -> ProcessingMode:
    """envoy/envoy.yaml's processing mode with another response body mode."""
    return ProcessingMode(
        request_header_mode=ProcessingMode.SEND,
        request_body_mode=ProcessingMode.BUFFERED,
        request_trailer_mode=ProcessingMode.SKIP,
        response_header_mode=ProcessingMode.SEND,
        response_body_mode=ProcessingMode.BodySendMode.Value(response_body_mode),
        response_trailer_mode=ProcessingMode.SEND,
    )


_CONTINUE_REQUEST_BODY = ProcessingResponse(request_body=BodyResponse(response=CommonResponse()))
_CONTINUE_RESPONSE_BODY = ProcessingResponse(response_body=BodyResponse(response=CommonResponse()))
_CONTINUE_REQUEST_TRAILERS = ProcessingResponse(request_trailers=TrailersResponse())
_CONTINUE_RESPONSE_TRAILERS = ProcessingResponse(response_trailers=TrailersResponse())


def continue_request_body() -> ProcessingResponse:
    """Let the request body through unchanged. Shared: never mutate it."""
    return _CONTINUE_REQUEST_BODY


def continue_response_body(body: bytes | None = None, content_length: bool = False) -> ProcessingResponse:
    """Let a response body chunk through, replaced by `body` when given; `content_length`: set
    `content-length` to its length too (a BUFFERED body, whose headers Envoy still holds: a
    length that no longer matches the body would fail the answer). Without `body`: shared,
    never mutate it."""
    if body is None:
        return _CONTINUE_RESPONSE_BODY
    common = CommonResponse()
    if body:
        common.body_mutation.body = body
    else:
        common.body_mutation.clear_body = True
    if content_length:
        common.header_mutation.CopyFrom(header_mutation({"content-length": str(len(body))}))
    return ProcessingResponse(response_body=BodyResponse(response=common))


def continue_request_trailers() -> ProcessingResponse:
    """Shared: never mutate it."""
    return _CONTINUE_REQUEST_TRAILERS


def continue_response_trailers() -> ProcessingResponse:
    """Shared: never mutate it."""
    return _CONTINUE_RESPONSE_TRAILERS


def openai_error_body(message: str, error_type: str, code: str, param: str | None = None) -> bytes:
    """An OpenAI-style error: {"error": {"message", "type", "param", "code"}}."""
    return orjson.dumps({"error": {"message": message, "type": error_type, "param": param, "code": code}})


def model_list_body(models: list[str], created: int) -> bytes:
    """OpenAI's `GET /v1/models` answer: {"object": "list", "data": [{"id", "object": "model",
    "created" (unix seconds), "owned_by"}]}."""
    data = [{"id": model, "object": "model", "created": created, "owned_by": "iris"} for model in models]
    return orjson.dumps({"object": "list", "data": data})


def model_body(model: str, model_list: bytes) -> bytes:
    """One entry of `model_list` (a model_list_body answer): `GET /v1/models/<model>`."""
    return orjson.dumps(next(entry for entry in orjson.loads(model_list)["data"] if entry["id"] == model))


@lru_cache(maxsize=1)
def internal_error() -> ProcessingResponse:
    """The generic 500 of the last-resort handler: nothing of the failure reaches the client.
    Shared (built once): never mutate it."""
    body = openai_error_body("the gateway failed to process the request", "server_error", "internal_error")
    return immediate_json(500, body, details="iris_internal_error")


def immediate_json(
    status: int, body: bytes, headers: dict[str, str] | None = None, details: str = "iris_extproc",
    metadata: dict[str, str | float] | None = None, fixed: bool = False,
) -> ProcessingResponse:
    """An ImmediateResponse: Envoy answers the client with `status` and the JSON `body` without
    going upstream. `details` (Envoy's response code details) must start with "iris_": envoy.yaml's
    local_reply_config leaves such replies untouched. `metadata`: see `with_metadata`. `fixed`:
    the status, body and headers come from a bounded set (a fixed error, a configured model's,
    the model list of the config), so that part is built once per distinct content and copied;
    never for a body that carries what a client sent."""
    all_headers = {"content-type": "application/json", **(headers or {})}
    if fixed:
        response = ProcessingResponse(immediate_response=_immediate(status, body, tuple(all_headers.items()), details))
    else:
        response = ProcessingResponse(immediate_response=ImmediateResponse(
            status=HttpStatus(code=status), headers=header_mutation(all_headers), body=body, details=details,
        ))
    return with_metadata(response, metadata)


@lru_cache(maxsize=1024)
def _immediate(status: int, body: bytes, headers: tuple[tuple[str, str], ...], details: str) -> ImmediateResponse:
    return ImmediateResponse(status=HttpStatus(code=status), headers=header_mutation(dict(headers)), body=body, details=details)
