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
import time
from dataclasses import dataclass

from extproc import metrics
from extproc.config import Config, Provider, ProviderKind
from extproc.routing.degraded import DegradedFlags
from extproc.routing.previous_provider import PreviousProviders
from extproc.routing.queue import DecisionAbandoned, QueuePolicy, Ticket, Wakeups
from extproc.routing.state import Admission, Lease, Pin, PinMatch, Result, RoutingState, new_id_pair


@dataclass(frozen=True, slots=True)
class RoutingRequest:
    """What routing needs to know of a request: the model, the feature class (chat, completions,
    embeddings, responses), its sub-features (tools, vision, ...) and the session id (None: the
    request never forms a session, for example embeddings).

    `required_provider`: not the spec's. A Responses turn whose previous response is stored on
    one provider can only be served there (extproc.openai_api.chains); routing then treats every other
    provider as unfit. None (every other request) leaves the spec's algorithm exactly as it is.

    `priority` and `tenant`: the admission queue's class and fairness key (extproc.routing.queue);
    read only when the queue is on for the model.

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
    priority: str | None = None  # the admission queue's class (docs/queue.md); None: the default class
    tenant: str = ""  # the admission queue's fairness key: a keyed hash of the identity ("" anonymous)
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
        return cls(*new_id_pair())


class _Retry:
    """The spec's RETRY_ROUTING sentinel."""


RETRY_ROUTING = _Retry()

Outcome = Decision | Rejection


class Router:
    """The spec's execute_request and the functions it calls, over a RoutingState.

    With `routing.prefer_previous_provider` enabled (off by default: the spec exactly), a session
    without a pin tries its previous pin's provider first (`pin_order`).

    With the admission queue on for a request's model (`routing.queue`, off by default:
    docs/queue.md), each walk over the providers may wait, before its unlimited providers (or its
    rejection), for a slot of the managed providers that refused it for slots (`_wait_for_slot`);
    `wakeups` (extproc.routing.queue.Wakeups, one per process) wakes waiting requests. With
    the queue off no call differs from the spec's.

    Every method may raise redis.exceptions.RedisError when Redis cannot be reached."""

    def __init__(self, config: Config, state: RoutingState, degraded: DegradedFlags, wakeups: Wakeups | None = None):
        self.config = config
        self.state = state
        self.degraded = degraded
        self._providers = config.providers_in_priority_order()
        self._by_name = {p.name: p for p in self._providers}
        prefer = config.routing.prefer_previous_provider
        self.previous = PreviousProviders(prefer.remember_seconds, prefer.max_sessions) if prefer.enabled else None
        self.queue = QueuePolicy(config.routing.queue, config.models())
        self.wakeups = wakeups if wakeups is not None else Wakeups()

    def queue_wait_seconds(self, request: RoutingRequest) -> float:
        """How long `request` may wait in the admission queue (seconds; 0 while it is off)."""
        if not self.queue.enabled(request.model):
            return 0.0
        return self.queue.wait_seconds(request.model, request.priority)

    async def execute_request(self, request: RoutingRequest, ids: Ids | None = None) -> Outcome:
        """Decide where `request` goes: the spec's execute_request, with its retry loop. `ids`:
        the lease and pin ids to admit under (fresh ones when None); the lease id is also the
        ticket id of a request that waits in the admission queue."""
        ids = ids or Ids.fresh()
        if not self.config.providers_for(request.model):
            # No provider serves the model at all: every path of the spec ends in this rejection.
            return self.reject_request_as_unsupported_or_unavailable(request)
        if not self.queue.enabled(request.model):
            return await self._execute_request(request, ids, None)
        ticket = self.queue.ticket(request.model, request.priority, request.tenant, ids.lease_id)
        self.wakeups.register(ticket)
        try:
            outcome = await self._execute_request(request, ids, ticket)
            if ticket.joined:  # it ends without a slot from the queue: its ticket leaves every queue
                await self.state.leave_queue(request.model, ticket.args("none"))
                ticket.joined = False
        finally:
            self.wakeups.unregister(ticket)
        _count_wait(ticket)
        return outcome

    async def _execute_request(self, request: RoutingRequest, ids: Ids, ticket: Ticket | None) -> Outcome:
        if request.session_id is None:
            return await self.execute_request_without_pinning(request, ids, ticket)
        for attempt in range(self.config.max_routing_attempts):
            order = None
            if attempt == 0:  # get_pin fused with the admission the spec tries next: one round trip
                order = self.pin_order(request)
                names = [p.name for p in order]
                pin, admission = await self.state.get_pin_and_try_admit(
                    request.model, request.session_id, names, lease_id=ids.lease_id, pin_id=ids.pin_id, share=request.share_key,
                    **self._queued(ticket),
                )
                self._note(ticket, admission)
            else:
                pin, admission = await self.state.get_pin(request.model, request.session_id), None
            if pin is None:
                outcome = await self.execute_not_yet_pinned_request(request, ids, admission, order, ticket)
            else:
                outcome = await self.execute_pinned_request(request, ids, pin, admission, ticket)
            if outcome is not RETRY_ROUTING:
                if self.previous is not None and isinstance(outcome, Decision) and outcome.pin is not None:
                    self.previous.remember(request.session_id, outcome.provider.name)
                return outcome
        return Rejection(RejectionKind.UNAVAILABLE, "routing did not settle: the session's pin kept changing")

    async def execute_request_without_pinning(self, request: RoutingRequest, ids: Ids, ticket: Ticket | None = None) -> Outcome:
        return await self.execute_temporary_fallback(request, ids, excluded_provider=None, ticket=ticket)

    async def execute_not_yet_pinned_request(
        self, request: RoutingRequest, ids: Ids, first_admission: Admission | None = None,
        order: list[Provider] | None = None, ticket: Ticket | None = None,
    ) -> Outcome | _Retry:
        """`first_admission`: the first candidate's answer, when already fetched, with `order`,
        the candidates it was fetched for (default: `pin_order` computed now).

        Beyond the spec: when no provider pins the session and one refused only because of the
        `max_pinned_sessions_unlimited` cap, the request is routed as one without a session
        (execute_request_without_pinning): a pair without limits has room for any request, the
        spec says, so the cap costs the session its pin, never its answer. With the admission
        queue on, the request may wait for the managed providers that answered QUEUED before it
        tries the unlimited ones (`_wait_for_slot`)."""
        capped = False
        waiting: list[Provider] = []

        def attempt(provider: Provider, mode: str):
            return self.state.try_admit_unpinned_session_request(
                provider.name, request.model, request.session_id, lease_id=ids.lease_id, pin_id=ids.pin_id,
                share=request.share_key, queue=ticket.args(mode),
            )

        for index, provider in enumerate(order if order is not None else self.pin_order(request)):
            if waiting and provider.kind is ProviderKind.UNLIMITED:
                waited = await self._wait_for_slot(ticket, waiting, attempt)
                waiting = []
                if waited is not None:
                    return self._new_pin_after_wait(ticket, *waited)
            if index == 0 and first_admission is not None:
                admission = first_admission
            else:
                admission = await self.state.try_admit_unpinned_session_request(
                    provider.name, request.model, request.session_id, lease_id=ids.lease_id, pin_id=ids.pin_id,
                    share=request.share_key, **self._queued(ticket),
                )
                self._note(ticket, admission)
            _count_share_refusal(provider, request.model, admission.result)
            if admission.result is Result.ALREADY_PINNED:
                return RETRY_ROUTING
            if admission.result is Result.ADMITTED:
                return self.execute_on_pinned_provider(admission, Reason.NEW_PIN)
            if admission.result is Result.QUEUED:
                waiting.append(provider)
            capped = capped or self._refused_by_pin_cap(provider, request.model, admission)
        if waiting:
            waited = await self._wait_for_slot(ticket, waiting, attempt)
            if waited is not None:
                return self._new_pin_after_wait(ticket, *waited)
        if capped:
            return await self.execute_request_without_pinning(request, ids, ticket)
        return self.reject_request_as_unsupported_or_unavailable(request)

    def _new_pin_after_wait(self, ticket: Ticket, provider: Provider, admission: Admission) -> Outcome | _Retry:
        if admission.result is Result.ADMITTED:
            return self._admitted_after_wait(ticket, provider, self.execute_on_pinned_provider(admission, Reason.NEW_PIN))
        return RETRY_ROUTING  # ALREADY_PINNED: another request of the session pinned it meanwhile

    async def execute_pinned_request(
        self, request: RoutingRequest, ids: Ids, pin: Pin, admission: Admission | None = None, ticket: Ticket | None = None
    ) -> Outcome | _Retry:
        """`admission`: the pinned admission's answer, when already fetched with the pin. With the
        admission queue on, a pin whose provider is full (QUEUED) may wait for that provider
        before the temporary fallback, so the session keeps its cache."""
        provider = self._by_name.get(pin.provider)
        if provider is None or not self._fits(provider, request):
            return await self.try_repin_to_other_provider_and_retry_execute(request, ids, pin, ticket)

        if admission is None:
            admission = await self.state.try_admit_pinned_session_request(
                request.model, request.session_id, lease_id=ids.lease_id, share=request.share_key, **self._queued(ticket)
            )
            self._note(ticket, admission)
        if admission.result is Result.QUEUED:
            waited = await self._wait_for_slot(
                ticket, [provider],
                lambda _, mode: self.state.try_admit_pinned_session_request(
                    request.model, request.session_id, lease_id=ids.lease_id, share=request.share_key, queue=ticket.args(mode)
                ),
            )
            if waited is None:
                return await self.execute_temporary_fallback(request, ids, excluded_provider=provider, ticket=ticket)
            admission = waited[1]
            if admission.result is Result.ADMITTED and admission.pin is not None and admission.pin.id == pin.id:
                return self._admitted_after_wait(ticket, provider, self.execute_on_pinned_provider(admission, Reason.PINNED))
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
            return await self.execute_temporary_fallback(request, ids, excluded_provider=provider, ticket=ticket)
        if admission.result is not Result.ADMITTED:
            return RETRY_ROUTING
        return self.execute_on_pinned_provider(admission, Reason.PINNED)

    async def try_repin_to_other_provider_and_retry_execute(
        self, request: RoutingRequest, ids: Ids, current_pin: Pin, ticket: Ticket | None = None
    ) -> Outcome | _Retry:
        """Beyond the spec, as in execute_not_yet_pinned_request: when the only refusals were
        the `max_pinned_sessions_unlimited` cap's, the request is offloaded (its pin kept). With
        the admission queue on, it may wait for the managed providers that answered QUEUED."""
        capped = False
        waiting: list[Provider] = []

        async def attempt(provider: Provider, mode: str) -> Admission:
            cas = await self.state.try_compare_and_swap_pin_and_admit_request(
                current_pin, request.model, request.session_id, provider.name, lease_id=ids.lease_id, pin_id=ids.pin_id,
                share=request.share_key, queue=ticket.args(mode),
            )
            return cas.admission

        for provider in self.eligible(request):
            if provider.name == current_pin.provider:
                continue
            if waiting and provider.kind is ProviderKind.UNLIMITED:
                waited = await self._wait_for_slot(ticket, waiting, attempt)
                waiting = []
                if waited is not None:
                    return self._repinned_after_wait(ticket, *waited)
            cas = await self.state.try_compare_and_swap_pin_and_admit_request(
                current_pin, request.model, request.session_id, provider.name, lease_id=ids.lease_id, pin_id=ids.pin_id,
                share=request.share_key,
                **self._queued(ticket),
            )
            self._note(ticket, cas.admission)
            _count_share_refusal(provider, request.model, cas.admission.result)
            if cas.pin_match is not PinMatch.MATCHED:
                return RETRY_ROUTING
            if cas.admission.result is Result.ADMITTED:
                return self.execute_on_pinned_provider(cas.admission, Reason.REPINNED)
            if cas.admission.result is Result.ALREADY_PINNED:
                return RETRY_ROUTING
            if cas.admission.result is Result.QUEUED:
                waiting.append(provider)
            # Not enough pin or request capacity there; the pin is unchanged: try the next one.
            capped = capped or self._refused_by_pin_cap(provider, request.model, cas.admission)
        if waiting:
            waited = await self._wait_for_slot(ticket, waiting, attempt)
            if waited is not None:
                return self._repinned_after_wait(ticket, *waited)
        if capped:
            pinned = self._by_name.get(current_pin.provider)
            excluded = pinned if pinned is not None and request.model in pinned.models else None
            return await self.execute_temporary_fallback(request, ids, excluded_provider=excluded, ticket=ticket)
        return self.reject_request_as_unsupported_or_unavailable(request)

    def _repinned_after_wait(self, ticket: Ticket, provider: Provider, admission: Admission) -> Outcome | _Retry:
        if admission.result is Result.ADMITTED:
            return self._admitted_after_wait(ticket, provider, self.execute_on_pinned_provider(admission, Reason.REPINNED))
        return RETRY_ROUTING  # the pin changed (PIN_MISMATCH) or the session was pinned anew meanwhile

    async def execute_temporary_fallback(
        self, request: RoutingRequest, ids: Ids, excluded_provider: Provider | None, ticket: Ticket | None = None
    ) -> Outcome:
        """With the admission queue on, the request may wait for the managed providers that
        answered QUEUED before it goes to an unlimited one (or is rejected)."""
        reason = Reason.UNPINNED if excluded_provider is None else Reason.OFFLOADED
        waiting: list[Provider] = []

        def attempt(provider: Provider, mode: str):
            return self.state.try_admit_request_without_pin(
                provider.name, request.model, lease_id=ids.lease_id, share=request.share_key, queue=ticket.args(mode)
            )

        for provider in self.eligible(request):
            if provider is excluded_provider:
                continue
            if waiting and provider.kind is ProviderKind.UNLIMITED:
                waited = await self._wait_for_slot(ticket, waiting, attempt)
                waiting = []
                if waited is not None:
                    chosen, admission = waited
                    decision = Decision(chosen, reason, admission.lease, None, refresh_pin_on_success=False)
                    return self._admitted_after_wait(ticket, chosen, decision)
            if self.provider_has_configured_limits(provider, request.model):
                admission = await self.state.try_admit_request_without_pin(
                    provider.name, request.model, lease_id=ids.lease_id, share=request.share_key, **self._queued(ticket)
                )
                self._note(ticket, admission)
                _count_share_refusal(provider, request.model, admission.result)
                if admission.result is Result.QUEUED:
                    waiting.append(provider)
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
        if waiting:
            waited = await self._wait_for_slot(ticket, waiting, attempt)
            if waited is not None:
                chosen, admission = waited
                return self._admitted_after_wait(ticket, chosen, Decision(chosen, reason, admission.lease, None, refresh_pin_on_success=False))
        return self.reject_request_as_unsupported_or_unavailable(request)

    # ---- the admission queue (docs/queue.md; beyond the spec) ---------------------------

    def _queued(self, ticket: Ticket | None) -> dict:
        """The queue argument of an admission of the walks: none while the queue is off (the
        spec's very calls); else the ticket, which joins the queue of a pair that refuses it for
        slots while it may still wait."""
        if ticket is None:
            return {}
        may_wait = ticket.remaining > 0 and not ticket.timed_out and not self.wakeups.closing
        return {"queue": ticket.args("join" if may_wait else "none")}

    def _note(self, ticket: Ticket | None, admission: Admission | None, waiting: bool = False) -> None:
        """Keep track of whether the ticket may sit in a queue: QUEUED puts it there, ADMITTED
        (on any pair) takes it out of every queue (lua/queue.lua). A walk's admission (not
        `waiting`) that could have joined a queue but got a slot refusal found it full: shed."""
        if ticket is None or admission is None:
            return
        if admission.result is Result.QUEUED:
            ticket.joined = True
        elif admission.result is Result.ADMITTED:
            ticket.joined = False
        elif admission.result in (Result.GLOBAL_IN_FLIGHT_REQUEST_LIMIT_REACHED, Result.UNRESERVED_IN_FLIGHT_REQUEST_LIMIT_REACHED):
            if not waiting and ticket.remaining > 0 and not ticket.timed_out and not self.wakeups.closing:
                metrics.child(metrics.QUEUE_SHED, ticket.model, ticket.priority).inc()

    async def _wait_for_slot(self, ticket: Ticket, waiting: list[Provider], attempt) -> tuple[Provider, Admission] | None:
        """Wait for a slot of one of `waiting` (the managed providers whose queue holds the
        ticket), attempting the walk's admission (`attempt(provider, mode)`) on each wake-up, and
        on every `poll_ms` (the backstop, which also renews the ticket). Returns (provider, the
        answer) for an answer the walk must act on (ADMITTED, or a change of pin), or None when
        the wait ends without one: its time is spent, the ticket is lost, no provider is left to
        wait for (a pin or per-session limit holds there, its queue is full), or a drain."""
        if ticket.timed_out or self.wakeups.closing:
            return None
        ticket.begin()
        poll = self.config.routing.queue.poll_ms / 1000
        waiting = list(waiting)
        while waiting:
            remaining = ticket.remaining
            hint = await self.wakeups.wait(ticket, min(poll, remaining))
            if ticket.abandoned:
                raise DecisionAbandoned(ticket.id)
            if self.wakeups.closing:
                return None
            last = ticket.remaining <= 0
            for provider in [p for p in waiting if p.name == hint] or list(waiting):
                admission = await attempt(provider, "wait")
                self._note(ticket, admission, waiting=True)
                result = admission.result
                if result is Result.QUEUED:
                    continue
                if result is Result.TICKET_LOST:
                    ticket.joined = False
                    return None
                if result in _LEFT_THE_QUEUE:
                    waiting.remove(provider)
                    continue
                return provider, admission
            if last:
                ticket.timed_out = True
                return None
        return None

    def _admitted_after_wait(self, ticket: Ticket, provider: Provider, decision: Decision) -> Decision:
        ticket.admitted_after_wait = provider.name
        return decision


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
            metrics.child(metrics.PIN_CAP_REACHED, provider.name, provider.kind.value, model).inc()
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


# Answers of a waiting admission that end the wait on that provider (lua/queue.lua took the ticket
# out of its queue, or never put it there): a pin limit, the session's own limit, a full queue.
_LEFT_THE_QUEUE = frozenset({
    Result.PIN_LIMIT_REACHED, Result.PER_SESSION_IN_FLIGHT_REQUEST_LIMIT_REACHED,
    Result.GLOBAL_IN_FLIGHT_REQUEST_LIMIT_REACHED, Result.UNRESERVED_IN_FLIGHT_REQUEST_LIMIT_REACHED,
})


def _count_wait(ticket: Ticket) -> None:
    """The metrics of a decision's ticket once its decision is made (docs/queue.md "Observing it")."""
    if not ticket.waited:
        return
    seconds = time.monotonic() - ticket.began
    if ticket.admitted_after_wait is not None:
        metrics.child(metrics.QUEUE_WAIT_SECONDS, ticket.admitted_after_wait, ticket.model, ticket.priority, "admitted").observe(seconds)
        metrics.child(metrics.QUEUE_OFFLOADS_AVOIDED, ticket.admitted_after_wait, ticket.model, ticket.priority).inc()
    elif ticket.timed_out:
        metrics.child(metrics.QUEUE_WAIT_SECONDS, "", ticket.model, ticket.priority, "timed_out").observe(seconds)
        metrics.child(metrics.QUEUE_TIMEOUTS, ticket.model, ticket.priority).inc()
    else:
        metrics.child(metrics.QUEUE_WAIT_SECONDS, "", ticket.model, ticket.priority, "left").observe(seconds)
def _count_share_refusal(provider: Provider, model: str, result: Result) -> None:
    """Count an admission routing.third_party_share refused (iris_third_party_share_refusals_total)."""
    if result is Result.THIRD_PARTY_SHARE_REACHED:
        metrics.child(metrics.THIRD_PARTY_SHARE_REFUSALS, provider.name, model).inc()


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
