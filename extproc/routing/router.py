"""The routing algorithm of ../shared/spec/admission-and-pinning.seed.txt, function by function.

Where the spec calls `run(request, provider)`, this module returns a `Decision` instead: the
caller runs the request on the decision's cluster, and the lease table (`extproc.routing.lease_table`)
keeps the lease renewed and releases it when the response ends. The lease and pin ids every
admission of one decision uses come from the caller (`Ids`), minted before any call reaches
Redis, so a decision abandoned mid-call can be undone. The functions keep the
spec's names and order; only Redis details live in `extproc.routing.state`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from extproc import metrics
from extproc.config import Config, Provider, ProviderKind
from extproc.routing.degraded import DegradedFlags
from extproc.routing.previous_provider import PreviousProviders
from extproc.routing.state import Admission, Lease, Pin, PinMatch, Result, RoutingState, new_id


@dataclass(frozen=True, slots=True)
class RoutingRequest:
    """What routing needs to know of a request: the model, the feature class (chat, completions,
    embeddings, responses), its sub-features (tools, vision, ...) and the session id (None: the
    request never forms a session, for example embeddings).

    `required_provider`: not the spec's. A Responses turn whose previous response is stored on
    one provider can only be served there (extproc.openai_api.chains); routing then treats every other
    provider as unfit. None (every other request) leaves the spec's algorithm exactly as it is.

    `share_key`: not the spec's either. With routing.third_party_share on, every admission of the
    request is counted in its identity's share, and one on an unlimited provider the share
    refuses (THIRD_PARTY_SHARE_REACHED) is a refusal for capacity: a new pin or a repin tries
    the next provider, a pinned request is offloaded (its pin kept), a temporary one tries the
    next. None leaves the spec's algorithm exactly as it is."""

    model: str
    feature: str
    sub_features: frozenset[str]
    session_id: str | None
    required_provider: str | None = None
    share_key: str | None = None  # the identity's key for routing.third_party_share (None: no share checked)


class Reason(str, enum.Enum):
    """Why a provider serves a request."""

    PINNED = "pinned"  # the session's existing pin
    NEW_PIN = "new_pin"  # the session was not pinned; now it is, here
    REPINNED = "repinned"  # the pinned provider no longer fits: compare-and-swap moved the pin
    OFFLOADED = "offloaded"  # the pin's capacity is full: served elsewhere once, the pin is kept
    UNPINNED = "unpinned"  # a request without a session


@dataclass(frozen=True, slots=True)
class Decision:
    """Where a request goes. `lease` is None only for a temporary request on a pair without
    limits (the spec: no lease is needed there). `refresh_pin_on_success` tells the release
    whether a successful response restarts the pin's inactivity deadline."""

    provider: Provider
    reason: Reason
    lease: Lease | None
    pin: Pin | None
    refresh_pin_on_success: bool


class RejectionKind(str, enum.Enum):
    """Why no provider serves a request: no provider supports the model and features; every
    supporting provider is degraded; or they are at capacity (the client may retry soon)."""

    UNSUPPORTED = "unsupported"
    UNAVAILABLE = "unavailable"
    CAPACITY = "capacity"


@dataclass(frozen=True, slots=True)
class Rejection:
    """The spec's reject_request_as_unsupported_or_unavailable, with the reason spelled out."""

    kind: RejectionKind
    message: str
    param: str | None = None  # the request field at fault, for an UNSUPPORTED rejection


@dataclass(frozen=True, slots=True)
class Ids:
    """The ids one decision's admissions record a lease and a new pin under (extproc.state.new_id).
    One decision holds at most one lease and makes at most one pin, so every attempt uses the
    same pair of ids: an attempt refused or released leaves nothing under them."""

    lease_id: str
    pin_id: str

    @classmethod
    def fresh(cls) -> Ids:
        return cls(new_id(), new_id())


class _Retry:
    """The spec's RETRY_ROUTING sentinel."""


RETRY_ROUTING = _Retry()

Outcome = Decision | Rejection


class Router:
    """The spec's execute_request and the functions it calls, over a RoutingState.

    With `routing.prefer_previous_provider` enabled (off by default: the spec exactly), a session
    without a pin tries its previous pin's provider first (`pin_order`).

    Every method may raise redis.exceptions.RedisError when Redis cannot be reached."""

    def __init__(self, config: Config, state: RoutingState, degraded: DegradedFlags):
        self.config = config
        self.state = state
        self.degraded = degraded
        self._providers = config.providers_in_priority_order()
        self._by_name = {p.name: p for p in self._providers}
        prefer = config.routing.prefer_previous_provider
        self.previous = PreviousProviders(prefer.remember_seconds, prefer.max_sessions) if prefer.enabled else None

    async def execute_request(self, request: RoutingRequest, ids: Ids | None = None) -> Outcome:
        """Decide where `request` goes: the spec's execute_request, with its retry loop. `ids`:
        the lease and pin ids to admit under (fresh ones when None)."""
        ids = ids or Ids.fresh()
        if not self.config.providers_for(request.model):
            # No provider serves the model at all: every path of the spec ends in this rejection.
            return self.reject_request_as_unsupported_or_unavailable(request)
        if request.session_id is None:
            return await self.execute_request_without_pinning(request, ids)
        for attempt in range(self.config.max_routing_attempts):
            order = None
            if attempt == 0:  # get_pin fused with the admission the spec tries next: one round trip
                order = self.pin_order(request)
                names = [p.name for p in order]
                pin, admission = await self.state.get_pin_and_try_admit(
                    request.model, request.session_id, names, lease_id=ids.lease_id, pin_id=ids.pin_id, share=request.share_key
                )
            else:
                pin, admission = await self.state.get_pin(request.model, request.session_id), None
            if pin is None:
                outcome = await self.execute_not_yet_pinned_request(request, ids, admission, order)
            else:
                outcome = await self.execute_pinned_request(request, ids, pin, admission)
            if outcome is not RETRY_ROUTING:
                if self.previous is not None and isinstance(outcome, Decision) and outcome.pin is not None:
                    self.previous.remember(request.session_id, outcome.provider.name)
                return outcome
        return Rejection(RejectionKind.UNAVAILABLE, "routing did not settle: the session's pin kept changing")

    async def execute_request_without_pinning(self, request: RoutingRequest, ids: Ids) -> Outcome:
        return await self.execute_temporary_fallback(request, ids, excluded_provider=None)

    async def execute_not_yet_pinned_request(
        self, request: RoutingRequest, ids: Ids, first_admission: Admission | None = None,
        order: list[Provider] | None = None,
    ) -> Outcome | _Retry:
        """`first_admission`: the first candidate's answer, when already fetched, with `order`,
        the candidates it was fetched for (default: `pin_order` computed now).

        Beyond the spec: when no provider pins the session and one refused only because of the
        `max_pinned_sessions_unlimited` cap, the request is routed as one without a session
        (execute_request_without_pinning): a pair without limits has room for any request, the
        spec says, so the cap costs the session its pin, never its answer."""
        capped = False
        for index, provider in enumerate(order if order is not None else self.pin_order(request)):
            if index == 0 and first_admission is not None:
                admission = first_admission
            else:
                admission = await self.state.try_admit_unpinned_session_request(
                    provider.name, request.model, request.session_id, lease_id=ids.lease_id, pin_id=ids.pin_id, share=request.share_key
                )
            _count_share_refusal(provider, request.model, admission.result)
            if admission.result is Result.ALREADY_PINNED:
                return RETRY_ROUTING
            if admission.result is Result.ADMITTED:
                return self.execute_on_pinned_provider(admission, Reason.NEW_PIN)
            capped = capped or self._refused_by_pin_cap(provider, request.model, admission)
        if capped:
            return await self.execute_request_without_pinning(request, ids)
        return self.reject_request_as_unsupported_or_unavailable(request)

    async def execute_pinned_request(
        self, request: RoutingRequest, ids: Ids, pin: Pin, admission: Admission | None = None
    ) -> Outcome | _Retry:
        """`admission`: the pinned admission's answer, when already fetched with the pin."""
        provider = self._by_name.get(pin.provider)
        if provider is None or not self._fits(provider, request):
            return await self.try_repin_to_other_provider_and_retry_execute(request, ids, pin)

        if admission is None:
            admission = await self.state.try_admit_pinned_session_request(
                request.model, request.session_id, lease_id=ids.lease_id, share=request.share_key
            )
        if admission.result is Result.SESSION_NOT_PINNED:
            return RETRY_ROUTING
        if admission.pin is None or admission.pin.id != pin.id:
            if admission.result is Result.ADMITTED:
                await self.state.release_request_lease(admission.lease, refresh_pin=False)
            return RETRY_ROUTING
        if admission.result in (
            Result.PER_SESSION_IN_FLIGHT_REQUEST_LIMIT_REACHED,
            Result.GLOBAL_IN_FLIGHT_REQUEST_LIMIT_REACHED,
            Result.THIRD_PARTY_SHARE_REACHED,  # beyond the spec: see RoutingRequest.share_key
        ):
            _count_share_refusal(provider, request.model, admission.result)
            return await self.execute_temporary_fallback(request, ids, excluded_provider=provider)
        if admission.result is not Result.ADMITTED:
            return RETRY_ROUTING
        return self.execute_on_pinned_provider(admission, Reason.PINNED)

    async def try_repin_to_other_provider_and_retry_execute(
        self, request: RoutingRequest, ids: Ids, current_pin: Pin
    ) -> Outcome | _Retry:
        """Beyond the spec, as in execute_not_yet_pinned_request: when the only refusals were
        the `max_pinned_sessions_unlimited` cap's, the request is offloaded (its pin kept)."""
        capped = False
        for provider in self.eligible(request):
            if provider.name == current_pin.provider:
                continue
            cas = await self.state.try_compare_and_swap_pin_and_admit_request(
                current_pin, request.model, request.session_id, provider.name, lease_id=ids.lease_id, pin_id=ids.pin_id,
                share=request.share_key,
            )
            _count_share_refusal(provider, request.model, cas.admission.result)
            if cas.pin_match is not PinMatch.MATCHED:
                return RETRY_ROUTING
            if cas.admission.result is Result.ADMITTED:
                return self.execute_on_pinned_provider(cas.admission, Reason.REPINNED)
            if cas.admission.result is Result.ALREADY_PINNED:
                return RETRY_ROUTING
            # Not enough pin or request capacity there; the pin is unchanged: try the next one.
            capped = capped or self._refused_by_pin_cap(provider, request.model, cas.admission)
        if capped:
            pinned = self._by_name.get(current_pin.provider)
            excluded = pinned if pinned is not None and request.model in pinned.models else None
            return await self.execute_temporary_fallback(request, ids, excluded_provider=excluded)
        return self.reject_request_as_unsupported_or_unavailable(request)

    async def execute_temporary_fallback(
        self, request: RoutingRequest, ids: Ids, excluded_provider: Provider | None
    ) -> Outcome:
        reason = Reason.UNPINNED if excluded_provider is None else Reason.OFFLOADED
        for provider in self.eligible(request):
            if provider is excluded_provider:
                continue
            if self.provider_has_configured_limits(provider, request.model):
                admission = await self.state.try_admit_request_without_pin(
                    provider.name, request.model, lease_id=ids.lease_id, share=request.share_key
                )
                _count_share_refusal(provider, request.model, admission.result)
                if admission.result is not Result.ADMITTED:
                    continue
                return Decision(provider, reason, admission.lease, None, refresh_pin_on_success=False)
            # Pairs without limits need no capacity lease for requests not tied to one of their pins.
            if request.share_key is not None and self.config.routing.third_party_share is not None:
                result = await self.state.try_admit_share(provider.name, request.model, request.share_key, lease_id=ids.lease_id)
                _count_share_refusal(provider, request.model, result)
                if result is not Result.ADMITTED:
                    continue
            return Decision(provider, reason, None, None, refresh_pin_on_success=False)
        return self.reject_request_as_unsupported_or_unavailable(request)

    def execute_on_pinned_provider(self, admission: Admission, reason: Reason) -> Decision:
        provider = self._by_name[admission.pin.provider]
        return Decision(provider, reason, admission.lease, admission.pin, refresh_pin_on_success=True)

    def reject_request_as_unsupported_or_unavailable(self, request: RoutingRequest) -> Rejection:
        supporting = [p for p in self._providers if self._supports(p, request)]
        if not supporting:
            return unsupported_feature_rejection(self._providers, request)
        if all(self.provider_is_degraded(p, request.model) for p in supporting):
            return Rejection(RejectionKind.UNAVAILABLE, f"every provider of model '{request.model}' is degraded")
        return Rejection(RejectionKind.CAPACITY, f"every provider of model '{request.model}' is at capacity")

    def provider_is_degraded(self, provider: Provider, model: str) -> bool:
        """The spec: only managed providers can be degraded."""
        if provider.kind is not ProviderKind.MANAGED:
            return False
        return self.degraded.is_degraded(provider.name, model)

    def provider_has_configured_limits(self, provider: Provider, model: str) -> bool:
        return provider.limits(model) is not None

    def _refused_by_pin_cap(self, provider: Provider, model: str, admission: Admission) -> bool:
        """Whether `admission` refused a new pin because of max_pinned_sessions_unlimited."""
        capped = admission.result is Result.PIN_LIMIT_REACHED and self.config.pin_limit(provider, model)[1]
        if capped:
            metrics.PIN_CAP_REACHED.labels(provider.name, model).inc()
        return capped

    def _supports(self, provider: Provider, request: RoutingRequest) -> bool:
        return provider.supports(request.model, request.feature, request.sub_features)

    def _fits(self, provider: Provider, request: RoutingRequest) -> bool:
        if request.required_provider is not None and provider.name != request.required_provider:
            return False
        return self._supports(provider, request) and not self.provider_is_degraded(provider, request.model)

    def eligible(self, request: RoutingRequest) -> list[Provider]:
        """Providers in priority order that support the request and are not degraded."""
        return [p for p in self._providers if self._fits(p, request)]

    def pin_order(self, request: RoutingRequest, eligible: list[Provider] | None = None) -> list[Provider]:
        """The order in which a session without a pin tries to pin: `eligible` (default: computed),
        unless `routing.prefer_previous_provider` is on and the session was pinned to one of them
        before; that provider then moves to the front of the providers of its kind (managed ones
        still first). The same providers either way: only their order changes."""
        if eligible is None:
            eligible = self.eligible(request)
        if self.previous is None or request.session_id is None:
            return eligible
        previous = self.previous.get(request.session_id)
        for provider in eligible:
            if provider.name == previous:
                front = next(i for i, p in enumerate(eligible) if p.kind is provider.kind)
                return [*eligible[:front], provider, *(p for p in eligible[front:] if p is not provider)]
        return eligible


def _count_share_refusal(provider: Provider, model: str, result: Result) -> None:
    """Count an admission routing.third_party_share refused (iris_third_party_share_refusals_total)."""
    if result is Result.THIRD_PARTY_SHARE_REACHED:
        metrics.THIRD_PARTY_SHARE_REFUSALS.labels(provider.name, model).inc()


_FEATURE_PARAMS = {"tools": "tools", "vision": "messages", "json_schema": "response_format"}


def unsupported_feature_rejection(providers: list[Provider], request: RoutingRequest) -> Rejection:
    """The 400 answer when no provider serves the model with every feature the request uses: it
    names the features no provider of the model offers at all, or else the combination."""
    offered: set[str] = set()
    for provider in providers:
        entry = provider.models.get(request.model)
        if entry is not None:
            offered |= entry.features
    wanted = sorted({request.feature, *request.sub_features})
    missing = [f for f in wanted if f not in offered]
    if missing:
        names = " and ".join(missing)
        message = f"model '{request.model}' does not support {names}: no provider serves it with {names}"
    else:
        names = " and ".join(wanted)
        message = f"model '{request.model}' does not support {names} together: no provider serves that combination"
    param = next((_FEATURE_PARAMS[f] for f in (missing or wanted) if f in _FEATURE_PARAMS), None)
    return Rejection(RejectionKind.UNSUPPORTED, message, param)
