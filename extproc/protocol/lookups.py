"""Requests for a stored response by id: `GET` and `DELETE /v1/responses/{id}`, `GET
/v1/responses/{id}/input_items`, `POST /v1/responses/{id}/cancel` (docs/endpoints.md).

They carry no body (Envoy sends the request headers with end_of_stream), so they are routed in the
request-headers answer: to the provider that stores the response, found in its chain record
(extproc.openai_api.chains) under the client's identity, with the session's affinity key so a
pool sends it to the replica that holds the response; on a provider with affinity pick, to the
endpoint the record names (`x-gateway-destination-endpoint` and the `envoy.lb` metadata, the
endpoint-picker protocol), whatever the session's pin says now. A request whose identity has no record of
the id gets 404 `response_not_found` from the router, never a provider's 404 from elsewhere.

A lookup takes no in-flight slot and holds no lease: it generates nothing, and a poll of a
background response must not wait behind (or crowd out) generations. It goes to the storing
provider whatever that provider's state (drained or degraded pairs still hold their responses);
only a provider the configuration no longer routes to is refused (503).

A lookup the provider answers (2xx) starts the chain record's TTL again (`refresh_looked_up`), so
a client polling a background response never outlives its record: an answer that says the
response still runs (`queued`, `in_progress`) keeps it for the background TTL, one that says it
ended gives it the chain TTL from then on (extproc.openai_api.chains).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingResponse

from extproc import metrics
from extproc.config import Provider
from extproc.openai_api.chains import RUNNING_STATUSES, ResponseChains
from extproc.openai_api.request import ResponseLookup
from extproc.protocol import answers, tracing
from extproc.protocol import messages as msg
from extproc.protocol.live import LiveConfig
from extproc.routing.lease_table import Refusal
from extproc.routing.outage import RedisBreaker
from extproc.storage.client import REDIS_FAILURES, in_own_task

log = logging.getLogger(__name__)

REASON = "response_lookup"  # the access log's `reason` (and x-iris-route-reason) of a lookup
RENAMED_ACTIONS = ("retrieve", "cancel")  # answered with the response object, whose `model` is the client's


@dataclass(frozen=True, slots=True)
class RoutedLookup:
    """A lookup sent to `provider`: the stored response's `model` (the client's name), the
    client's `identity`, and `upstream_model` when the provider names the model its own way and
    answers are to carry the client's name."""

    lookup: ResponseLookup
    provider: Provider
    model: str
    identity: str
    upstream_model: str | None


async def route_lookup(
    live: LiveConfig, breaker: RedisBreaker, lookup: ResponseLookup, identity: str, routing_header: str, remove: list[str],
    tracing_on: bool = False,
) -> tuple[ProcessingResponse, RoutedLookup | None]:
    """The request-headers answer for `lookup` by `identity`: routed to the provider that stores
    the response (with the RoutedLookup), or the router's own error (and None): 404
    `response_not_found`, 503 `no_provider_available`, 503 `routing_unavailable` while Redis
    cannot be asked. `remove`: headers a client may not send (the routing header's own copy).
    `tracing_on`: a provider that gets no trace context loses the client's, as a generation
    does (extproc.protocol.tracing)."""
    retry_after = live.config.server.retry_after_seconds
    if breaker.fleet_open:
        return answers.refusal(Refusal.UNAVAILABLE, "", retry_after, 0.0), None
    try:
        found = await in_own_task(live.chains.find(identity, lookup.response_id, live.responses_models))
    except REDIS_FAILURES:  # every model's keys: not one model's failure (the breaker counts per model)
        return answers.refusal(Refusal.UNAVAILABLE, "", retry_after, 0.0), None
    if found is None or found[1].provider is None:  # unknown, expired, another identity's, or not stored
        return answers.response_not_found(lookup.response_id), None
    model, link = found
    provider = next((p for p in live.config.providers_for(model) if p.name == link.provider), None)
    if provider is None:
        return answers.response_provider_gone(link.provider, retry_after), None
    change = live.adapter.adapt(provider, model, None, link.session_id)
    upstream = live.adapter.upstream_model(provider, model) if live.config.adaptation.restore_model_name else None
    metadata = {"provider": provider.name, "reason": REASON}
    set_headers = change.set_headers
    if lookup.action in RENAMED_ACTIONS:  # the answer is read (its status, its model name): not compressed
        set_headers = {**set_headers, **msg.UNENCODED_ANSWER}
    overwritten = {routing_header, *set_headers}  # set below, over any copy a client sent
    removed = [h for h in remove if h not in overwritten] + change.remove
    if tracing_on and not tracing.receives_trace_context(provider):
        removed += tracing.WITHHELD_HEADERS
    answer = msg.route_headers_to_cluster(routing_header, change.cluster, set_headers, removed, metadata)
    answer = msg.with_destination(answer, storing_endpoint(provider, link.endpoint))
    metrics.child(metrics.RESPONSE_LOOKUPS, lookup.action).inc()
    return answer, RoutedLookup(lookup, provider, model, identity, upstream)


def storing_endpoint(provider: Provider, endpoint: str | None) -> tuple[str, ...]:
    """The endpoint-picker answer of a lookup: the replica (`ip:port`) the chain record says
    stores the response, alone (no other replica holds it), when `provider` has affinity pick;
    else () and Envoy's fallback hash on the session key chooses. An endpoint the cluster no longer
    has is not honoured by Envoy's override_host either: its fallback hash chooses then."""
    if endpoint is None or not provider.picks:
        return ()
    return (endpoint,)


async def refresh_looked_up(chains: ResponseChains, routed: RoutedLookup, status: str | None) -> None:
    """After the provider answered `routed` (2xx): start its chain record's TTL again. `status`:
    the response's status the answer gives (None: not read): running (RUNNING_STATUSES) keeps
    the record for the background TTL; any other status says the response ended, and the record
    gets the chain TTL from now; None only lengthens the record's life. A delete's record is
    gone already. Redis failures are logged, not raised: the answer passes either way."""
    if routed.lookup.action == "delete":
        return
    running = status in RUNNING_STATUSES
    try:
        await chains.refresh(routed.model, routed.identity, routed.lookup.response_id, running, ended=status is not None and not running)
    except REDIS_FAILURES as exc:
        log.warning("response chain TTL not refreshed after a lookup (redis): %s", exc)
