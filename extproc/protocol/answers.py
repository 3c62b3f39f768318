"""The router's own answers: every outcome that is not "route to a provider" becomes an
OpenAI-style JSON error in an ImmediateResponse, with a status, an error type and a `code` from the
closed set (extproc.protocol.messages.ROUTER_ERROR_CODES), counted in `iris_rejections_total`.

The rules are the README's "Endpoints" and docs/routing-state.md ("When Redis is gone"): 400 for a
bad request, 404 for an unknown model or URL, 429 when capacity (or this process's Redis
connections) is exhausted, 503 when no provider can serve or Redis is gone under fail_closed. Every
429 and 503 carries `retry-after` (seconds).
"""

from __future__ import annotations

from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingResponse

from extproc import metrics
from extproc.openai_api.request import MODELS_PATH, RequestError
from extproc.protocol import messages as msg
from extproc.routing.lease_table import Refusal
from extproc.routing.router import Rejection, RejectionKind


def request_error(exc: RequestError) -> ProcessingResponse:
    """A request refused before any routing: its own status and code."""
    metrics.child(metrics.REJECTIONS, exc.code, "").inc()  # before a configured model is known
    body = msg.openai_error_body(exc.message, exc.error_type, exc.code, exc.param)
    return msg.immediate_json(exc.status, body, metadata={"code": exc.code})


def too_large(limit_bytes: int) -> RequestError:
    """The error for a body over `server.max_body_bytes` (bytes)."""
    return RequestError(413, f"request body is larger than {limit_bytes} bytes", "request_too_large")


def missing_body() -> RequestError:
    """The error for a POST without a body: none announced (end_of_stream on the request
    headers), or a body of no bytes (a chunked one)."""
    return RequestError(400, "a request body is required", "missing_body")


def is_models_path(path: str) -> bool:
    """Whether `path` is `/v1/models` or `/v1/models/<id>` (query and trailing slash ignored)."""
    path = path.split("?", 1)[0].rstrip("/")
    return path == MODELS_PATH or path.startswith(MODELS_PATH + "/")


def models(method: str, path: str, model_list: bytes, configured: frozenset[str]) -> ProcessingResponse:
    """`GET /v1/models` (and `/v1/models/<id>`) from the configuration, in OpenAI's shape.
    Raises RequestError (405 for another method, 404 for a model not configured)."""
    if method != "GET":
        raise RequestError(405, f"method {method[:20]!r} is not allowed here: use GET", "method_not_allowed")
    path = path.split("?", 1)[0].rstrip("/")
    if path == MODELS_PATH:
        return msg.immediate_json(200, model_list, fixed=True)
    model = path.removeprefix(MODELS_PATH + "/")
    if path.startswith(MODELS_PATH + "/") and model in configured:
        return msg.immediate_json(200, msg.model_body(model, model_list))
    raise RequestError(404, f"the model '{model[:200]}' does not exist", "model_not_found", param="model")


def refusal(refused: Refusal, model_label: str, retry_after_seconds: int, decision_ms: float) -> ProcessingResponse:
    """The lease table refused to decide: 503 under fail_closed, 429 when this process's Redis
    connections are all busy (load: retry soon)."""
    metrics.child(metrics.REJECTIONS, refused.value, model_label).inc()
    headers = {"retry-after": str(retry_after_seconds)}
    metadata = {"code": refused.value, "decision_ms": decision_ms}
    if refused is Refusal.OVERLOADED:
        body = msg.openai_error_body("the routing service is overloaded: retry shortly", "rate_limit_error", refused.value)
        return msg.immediate_json(429, body, headers, metadata=metadata, fixed=True)
    body = msg.openai_error_body("the routing service is temporarily unavailable", "service_unavailable", refused.value)
    return msg.immediate_json(503, body, headers, metadata=metadata, fixed=True)


def chained_unavailable(
    provider: str, response_id: str | None, degraded: bool, model_label: str, retry_after_seconds: int, decision_ms: float
) -> ProcessingResponse:
    """A turn continuing a response stored on `provider`, which cannot take it now: a clear error,
    never a silent 404 from a provider that does not hold the response. `degraded`: the provider is
    degraded, drained or no longer serves the model (503); otherwise it is at capacity (429)."""
    state = "unavailable (degraded or drained)" if degraded else "at capacity"
    message = (
        f"the previous response '{(response_id or '')[:100]}' is stored on provider {provider}, which is {state}: "
        "retry later, or start a new chain without previous_response_id"
    )
    code = "previous_response_unavailable"
    metrics.child(metrics.REJECTIONS, code, model_label).inc()
    status, error_type = (503, "service_unavailable") if degraded else (429, "rate_limit_error")
    body = msg.openai_error_body(message, error_type, code, "previous_response_id")
    headers = {"retry-after": str(retry_after_seconds)}
    return msg.immediate_json(status, body, headers, metadata={"code": code, "decision_ms": decision_ms})


def routing_rejection(rejection: Rejection, model_label: str, retry_after_seconds: int, decision_ms: float) -> ProcessingResponse:
    """The router found no provider: 400 `unsupported_feature`, 429 `capacity_exceeded` or 503
    `no_provider_available`."""
    headers = {"retry-after": str(retry_after_seconds)}
    if rejection.kind is RejectionKind.UNSUPPORTED:
        status, error_type, code, param, headers = 400, "invalid_request_error", "unsupported_feature", rejection.param, None
    elif rejection.kind is RejectionKind.CAPACITY:
        status, error_type, code, param = 429, "rate_limit_error", "capacity_exceeded", None
    else:
        status, error_type, code, param = 503, "service_unavailable", "no_provider_available", None
    metrics.child(metrics.REJECTIONS, code, model_label).inc()
    body = msg.openai_error_body(rejection.message, error_type, code, param)  # its model is a configured one
    return msg.immediate_json(status, body, headers, metadata={"code": code, "decision_ms": decision_ms}, fixed=True)


def internal_error() -> ProcessingResponse:
    """The last resort's generic 500 (code internal_error): no internal text reaches the client."""
    metrics.child(metrics.REJECTIONS, "internal_error", "").inc()
    return msg.internal_error()


def response_not_found(response_id: str) -> ProcessingResponse:
    """A stored response the router has no record of for this client (unknown, expired, deleted,
    `store: false`, or another identity's): 404 `response_not_found`, as a provider that lacks it
    would answer, without asking one."""
    return request_error(RequestError(404, f"no response with id '{response_id[:100]}' was found", "response_not_found"))


def response_provider_gone(provider: str, retry_after_seconds: int) -> ProcessingResponse:
    """A stored response whose provider the configuration no longer routes to: 503
    `no_provider_available` with `retry-after` (the provider may come back with a reload)."""
    code = "no_provider_available"
    metrics.child(metrics.REJECTIONS, code, "").inc()
    message = f"the response is stored on provider {provider}, which this gateway does not route to now"
    body = msg.openai_error_body(message, "service_unavailable", code)
    return msg.immediate_json(503, body, {"retry-after": str(retry_after_seconds)}, metadata={"code": code})
