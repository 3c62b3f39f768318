"""The spec's routing algorithm (execute_request and the functions it calls) over the model.

Written from ../shared/spec/admission-and-pinning.seed.txt, function by function and in the same
order. Where the spec calls ROUTING_STATE, a function here *yields* the call (one of the small
operation classes below) and receives the answer, so the same code can be driven two ways:
`run` answers every call from a RoutingModel with an explicit time; the differential tests
answer each call from the log of a real run and check, on the way, that the model would have
made the very same call and got the very same answer.

Where the spec runs the request, the algorithm returns a Decision (provider, reason, lease, pin,
whether a success refreshes the pin) or a Rejection, like extproc.routing.Router.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass

from tests.model_based.model import state as S

# Why a provider serves a request (the name of the spec path that chose it).
PINNED = "pinned"
NEW_PIN = "new_pin"
REPINNED = "repinned"
OFFLOADED = "offloaded"
UNPINNED = "unpinned"

# Why no provider serves it.
UNSUPPORTED = "unsupported"  # no provider supports the model with the request's features
UNAVAILABLE = "unavailable"  # every supporting provider is degraded, or routing never settled
CAPACITY = "capacity"  # otherwise: the supporting providers are full


@dataclass(frozen=True)
class Request:
    model: str
    feature: str
    sub_features: frozenset[str]
    session: str | None


@dataclass(frozen=True)
class Provider:
    name: str
    managed: bool
    features: dict[str, frozenset[str]]  # model -> features
    limited: dict[str, bool]  # model -> the pair has a limits block
    pin_capped: dict[str, bool]  # model -> the pair's pin limit is max_pinned_sessions_unlimited

    def supports(self, model: str, feature: str, sub_features: frozenset[str]) -> bool:
        if model not in self.features:
            return False
        features = self.features[model]
        if feature not in features:
            return False
        for sub in sub_features:
            if sub not in features:
                return False
        return True


def providers_from_config(config) -> list[Provider]:
    """all_providers_in_priority_order(): the managed ones, then the unlimited ones, each in the
    configuration's order."""
    managed, unlimited = [], []
    for p in config.providers:
        provider = Provider(
            p.name,
            p.kind.value == "managed",
            {m: frozenset(e.features) for m, e in p.models.items()},
            {m: e.limits is not None for m, e in p.models.items()},
            {
                m: config.max_pinned_sessions_unlimited is not None
                and (e.limits is None or e.limits.max_pinned_sessions is None)
                for m, e in p.models.items()
            },
        )
        (managed if provider.managed else unlimited).append(provider)
    return managed + unlimited


@dataclass(frozen=True)
class Decision:
    provider: str
    reason: str
    lease: S.Lease | None
    pin: S.Pin | None
    refresh_pin_on_success: bool


@dataclass(frozen=True)
class Rejection:
    kind: str


# The routing state calls the algorithm makes.
@dataclass(frozen=True)
class GetPin:
    model: str
    session: str


@dataclass(frozen=True)
class AdmitUnpinned:
    provider: str
    model: str
    session: str


@dataclass(frozen=True)
class AdmitPinned:
    model: str
    session: str


@dataclass(frozen=True)
class CompareAndSwap:
    expected_pin: S.Pin
    model: str
    session: str
    provider: str


@dataclass(frozen=True)
class AdmitWithoutPin:
    provider: str
    model: str


@dataclass(frozen=True)
class Release:
    lease: S.Lease
    refresh: bool


RETRY_ROUTING = object()


class ModelRouter:
    """execute_request for one configuration, a set of degraded (provider, model) pairs, and the
    configuration's max_routing_attempts."""

    def __init__(self, config, degraded: set[tuple[str, str]]):
        self.providers = providers_from_config(config)
        self.degraded = degraded
        self.max_attempts = config.max_routing_attempts

    def execute_request(self, request: Request) -> Generator:
        if request.session is None:
            return (yield from self.execute_request_without_pinning(request))
        for _ in range(self.max_attempts):
            pin = yield GetPin(request.model, request.session)
            if pin is None:
                result = yield from self.execute_not_yet_pinned_request(request)
            else:
                result = yield from self.execute_pinned_request(request, pin)
            if result is not RETRY_ROUTING:
                return result
        return Rejection(UNAVAILABLE)

    def execute_request_without_pinning(self, request: Request) -> Generator:
        return (yield from self.execute_temporary_fallback(request, excluded_provider=None, reason=UNPINNED))

    def execute_not_yet_pinned_request(self, request: Request) -> Generator:
        refused_by_cap = False
        for provider in self.providers:
            if not provider.supports(request.model, request.feature, request.sub_features):
                continue
            if self.provider_is_degraded(provider, request.model):
                continue
            admission = yield AdmitUnpinned(provider.name, request.model, request.session)
            if admission.result == S.ALREADY_PINNED:
                return RETRY_ROUTING
            if admission.result == S.ADMITTED:
                return self.execute_on_pinned_provider(admission, NEW_PIN)
            # A capacity result: try the next provider.
            if admission.result == S.PIN_LIMIT_REACHED and provider.pin_capped[request.model]:
                refused_by_cap = True
        if refused_by_cap:
            # Issue 15: refused a pin only by the cap on pairs without a pin limit, the session
            # is routed as a request without one.
            return (yield from self.execute_request_without_pinning(request))
        return self.reject_request_as_unsupported_or_unavailable(request)

    def execute_pinned_request(self, request: Request, pin: S.Pin) -> Generator:
        provider = self.provider_named(pin.provider, request.model)
        if (
            provider is None  # this configuration no longer routes the model to the pin's provider
            or not provider.supports(request.model, request.feature, request.sub_features)
            or self.provider_is_degraded(provider, request.model)
        ):
            return (yield from self.try_repin_to_other_provider_and_retry_execute(request, pin))

        admission = yield AdmitPinned(request.model, request.session)
        if admission.result == S.SESSION_NOT_PINNED:
            return RETRY_ROUTING
        if admission.pin is None or admission.pin.id != pin.id:
            if admission.result == S.ADMITTED:
                yield Release(admission.lease, refresh=False)
            return RETRY_ROUTING
        if admission.result in (
            S.PER_SESSION_IN_FLIGHT_REQUEST_LIMIT_REACHED,
            S.GLOBAL_IN_FLIGHT_REQUEST_LIMIT_REACHED,
        ):
            return (yield from self.execute_temporary_fallback(request, excluded_provider=provider, reason=OFFLOADED))
        if admission.result != S.ADMITTED:
            # Not reachable with this configuration: a pinned admission may use the reserved
            # slots (no UNRESERVED_...), needs no new pin (no PIN_LIMIT_...), and the provider
            # was found above (no PROVIDER_NOT_CONFIGURED). The spec would run the request
            # anyway; we retry, which is what extproc.routing.router does.
            return RETRY_ROUTING
        return self.execute_on_pinned_provider(admission, PINNED)

    def try_repin_to_other_provider_and_retry_execute(self, request: Request, current_pin: S.Pin) -> Generator:
        refused_by_cap = False
        for provider in self.providers:
            if provider.name == current_pin.provider:
                continue
            if not provider.supports(request.model, request.feature, request.sub_features):
                continue
            if self.provider_is_degraded(provider, request.model):
                continue
            result = yield CompareAndSwap(current_pin, request.model, request.session, provider.name)
            if result.pin_match != S.MATCHED:
                return RETRY_ROUTING
            if result.admission.result == S.ADMITTED:
                return self.execute_on_pinned_provider(result.admission, REPINNED)
            if result.admission.result == S.ALREADY_PINNED:
                return RETRY_ROUTING
            # A capacity result: the pin is unchanged, try the next provider.
            if result.admission.result == S.PIN_LIMIT_REACHED and provider.pin_capped[request.model]:
                refused_by_cap = True
        if refused_by_cap:
            # Issue 15: the pin is kept and the request served once elsewhere.
            excluded = self.provider_named(current_pin.provider, request.model)
            reason = UNPINNED if excluded is None else OFFLOADED
            return (yield from self.execute_temporary_fallback(request, excluded_provider=excluded, reason=reason))
        return self.reject_request_as_unsupported_or_unavailable(request)

    def execute_temporary_fallback(self, request: Request, excluded_provider: Provider | None, reason: str) -> Generator:
        for provider in self.providers:
            if excluded_provider is not None and provider.name == excluded_provider.name:
                continue
            if not provider.supports(request.model, request.feature, request.sub_features):
                continue
            if self.provider_is_degraded(provider, request.model):
                continue
            if provider.limited[request.model]:
                admission = yield AdmitWithoutPin(provider.name, request.model)
                if admission.result != S.ADMITTED:
                    continue
                return Decision(provider.name, reason, admission.lease, None, refresh_pin_on_success=False)
            # Pairs without limits need no lease for a request not tied to one of their pins.
            return Decision(provider.name, reason, None, None, refresh_pin_on_success=False)
        return self.reject_request_as_unsupported_or_unavailable(request)

    def execute_on_pinned_provider(self, admission: S.Admission, reason: str) -> Decision:
        return Decision(admission.pin.provider, reason, admission.lease, admission.pin, refresh_pin_on_success=True)

    def reject_request_as_unsupported_or_unavailable(self, request: Request) -> Rejection:
        supporting = []
        for provider in self.providers:
            if provider.supports(request.model, request.feature, request.sub_features):
                supporting.append(provider)
        if not supporting:
            return Rejection(UNSUPPORTED)
        for provider in supporting:
            if not self.provider_is_degraded(provider, request.model):
                return Rejection(CAPACITY)
        return Rejection(UNAVAILABLE)

    def provider_is_degraded(self, provider: Provider, model: str) -> bool:
        if not provider.managed:
            return False
        return (provider.name, model) in self.degraded

    def provider_named(self, name: str, model: str) -> Provider | None:
        for provider in self.providers:
            if provider.name == name and model in provider.features:
                return provider
        return None


def apply(state: S.RoutingModel, op, now: int, lease_id: str):
    """Answer one routing state call from the model."""
    if isinstance(op, GetPin):
        return state.get_pin(op.model, op.session, now)
    if isinstance(op, AdmitUnpinned):
        return state.try_admit_unpinned_session_request(op.provider, op.model, op.session, lease_id, now)
    if isinstance(op, AdmitPinned):
        return state.try_admit_pinned_session_request(op.model, op.session, lease_id, now)
    if isinstance(op, CompareAndSwap):
        return state.try_compare_and_swap_pin_and_admit_request(
            op.expected_pin.id, op.model, op.session, op.provider, lease_id, now
        )
    if isinstance(op, AdmitWithoutPin):
        return state.try_admit_request_without_pin(op.provider, op.model, lease_id, now)
    if isinstance(op, Release):
        lease = op.lease
        return state.release_request_lease(lease.model, lease.provider, lease.id, op.refresh, now)
    raise TypeError(op)


def run(router: ModelRouter, state: S.RoutingModel, request: Request, now: int, new_lease_id: Callable[[], str]):
    """Route one request against the model at time `now` (ms): a Decision or a Rejection."""
    steps = router.execute_request(request)
    try:
        op = next(steps)
        while True:
            op = steps.send(apply(state, op, now, new_lease_id()))
    except StopIteration as done:
        return done.value
