"""An in-memory reference model of the routing state (the spec's ROUTING_STATE).

Written from ../shared/spec/admission-and-pinning.seed.txt and the semantics decided in issue #2
(listed in tests/model_based/model/README.md), not from the Lua scripts. It favours being obviously right
over being fast: the state is two plain lists, every question is answered by a loop over them,
and nothing is cached. Time is an explicit argument `now` in milliseconds everywhere.

The state:
- `leases`: every recorded request lease (a lease is "recorded" from its admission until it is
  released, or forgotten by housekeeping a lease timeout after it expired).
- `pins`: the current pin of each (model, session), at most one, live or dead. A pin replaced by
  a new one (compare-and-swap, or a new pin after the old one died) is dropped from the list.

Nothing is stored that can be computed: whether a pin is live, its expiry and every count are
computed from the two lists at the time asked.
"""

from __future__ import annotations

from dataclasses import dataclass

# Result names (the spec's, plus the answers of get_pin, renew and release).
ADMITTED = "ADMITTED"
ALREADY_PINNED = "ALREADY_PINNED"
SESSION_NOT_PINNED = "SESSION_NOT_PINNED"
PIN_LIMIT_REACHED = "PIN_LIMIT_REACHED"
PER_SESSION_IN_FLIGHT_REQUEST_LIMIT_REACHED = "PER_SESSION_IN_FLIGHT_REQUEST_LIMIT_REACHED"
GLOBAL_IN_FLIGHT_REQUEST_LIMIT_REACHED = "GLOBAL_IN_FLIGHT_REQUEST_LIMIT_REACHED"
UNRESERVED_IN_FLIGHT_REQUEST_LIMIT_REACHED = "UNRESERVED_IN_FLIGHT_REQUEST_LIMIT_REACHED"
PROVIDER_NOT_CONFIGURED = "PROVIDER_NOT_CONFIGURED"
PIN_MISMATCH = "PIN_MISMATCH"
LEASE_EXPIRED = "LEASE_EXPIRED"
PINNED = "PINNED"
NOT_PINNED = "NOT_PINNED"
RENEWED = "RENEWED"
LEASE_LOST = "LEASE_LOST"
RELEASED = "RELEASED"
NOT_FOUND = "NOT_FOUND"

CAPACITY_RESULTS = (
    PIN_LIMIT_REACHED,
    PER_SESSION_IN_FLIGHT_REQUEST_LIMIT_REACHED,
    GLOBAL_IN_FLIGHT_REQUEST_LIMIT_REACHED,
    UNRESERVED_IN_FLIGHT_REQUEST_LIMIT_REACHED,
)

MATCHED = "MATCHED"
MISMATCHED = "MISMATCHED"


@dataclass
class LeaseRecord:
    """A recorded request lease on the pair (model, provider). `session` and `pin_id` are those
    it was admitted with (None for a temporary lease)."""

    model: str
    provider: str
    id: str
    session: str | None
    pin_id: str | None
    deadline: int


@dataclass
class PinRecord:
    """The current pin of (model, session). `deadline` is the inactivity deadline."""

    model: str
    session: str
    provider: str
    id: str
    deadline: int


@dataclass(frozen=True)
class Pin:
    """What an answer shows of a pin: `expiry` is when it dies if nothing changes."""

    provider: str
    id: str
    deadline: int
    expiry: int


@dataclass(frozen=True)
class Lease:
    """What an answer shows of a lease."""

    model: str
    provider: str
    id: str
    session: str | None
    pin_id: str | None
    deadline: int


@dataclass(frozen=True)
class Admission:
    """The answer of an admission. `lease` is set only when ADMITTED. `replayed` tells that the
    answer is a repeated admission's (no new lease was recorded)."""

    result: str
    pin: Pin | None
    lease: Lease | None
    replayed: bool = False


@dataclass(frozen=True)
class CasResult:
    pin_match: str
    admission: Admission


@dataclass(frozen=True)
class Limits:
    """The spec's ModelLimits; None means unlimited."""

    max_pinned_sessions: int | None
    max_global_in_flight_request_slots: int | None
    global_in_flight_request_slots_reserved_for_pinned_sessions: int
    max_per_session_in_flight_request_slots: int | None


def limits_from_config(config) -> dict[tuple[str, str], Limits | None]:
    """{(provider, model): Limits or None (a pair without limits)} for every pair `config`
    (an extproc.config.Config, read as plain data) serves."""
    pairs: dict[tuple[str, str], Limits | None] = {}
    for provider in config.providers:
        for model, entry in provider.models.items():
            if entry.limits is None:
                pairs[(provider.name, model)] = None
            else:
                pairs[(provider.name, model)] = Limits(
                    entry.limits.max_pinned_sessions,
                    entry.limits.max_global_in_flight_request_slots,
                    entry.limits.global_in_flight_request_slots_reserved_for_pinned_sessions,
                    entry.limits.max_per_session_in_flight_request_slots,
                )
    return pairs


def pin_caps_from_config(config) -> dict[tuple[str, str], int | None]:
    """{(provider, model): the cap on live pins of a pair that configures no max_pinned_sessions
    (config.max_pinned_sessions_unlimited), or None} (issue 15: bounded routing state)."""
    caps: dict[tuple[str, str], int | None] = {}
    for provider in config.providers:
        for model, entry in provider.models.items():
            configured = entry.limits is not None and entry.limits.max_pinned_sessions is not None
            caps[(provider.name, model)] = None if configured else config.max_pinned_sessions_unlimited
    return caps


class RoutingModel:
    """The routing state with explicit time (ms). Operations and result names are those of
    extproc.state.RoutingState; renew and release name the lease by (model, provider, id)."""

    def __init__(self, config, pin_timeout_ms: int, lease_timeout_ms: int):
        self.pairs = limits_from_config(config)
        self.pin_caps = pin_caps_from_config(config)
        self.pin_timeout = pin_timeout_ms
        self.lease_timeout = lease_timeout_ms
        self.leases: list[LeaseRecord] = []
        self.pins: list[PinRecord] = []
        self._pin_ids = 0

    # ---- questions -------------------------------------------------------------------------

    def find_lease(self, model: str, provider: str, lease_id: str) -> LeaseRecord | None:
        for lease in self.leases:
            if lease.model == model and lease.provider == provider and lease.id == lease_id:
                return lease
        return None

    def current_pin(self, model: str, session: str | None) -> PinRecord | None:
        """The session's current pin record, live or dead."""
        for pin in self.pins:
            if pin.model == model and pin.session == session:
                return pin
        return None

    def pin_expiry(self, pin: PinRecord) -> int:
        """The latest of the pin's deadline and the deadlines of its recorded leases."""
        expiry = pin.deadline
        for lease in self.leases:
            if lease.pin_id == pin.id and lease.deadline > expiry:
                expiry = lease.deadline
        return expiry

    def is_live(self, pin: PinRecord, now: int) -> bool:
        return self.pin_expiry(pin) > now

    def live_pin_at(self, model: str, session: str | None, now: int) -> PinRecord | None:
        pin = self.current_pin(model, session)
        if pin is not None and self.is_live(pin, now):
            return pin
        return None

    def live_leases_on_pair(self, model: str, provider: str, now: int) -> list[LeaseRecord]:
        found = []
        for lease in self.leases:
            if lease.model == model and lease.provider == provider and lease.deadline > now:
                found.append(lease)
        return found

    def live_leases_on_pin(self, pin: PinRecord, now: int) -> list[LeaseRecord]:
        found = []
        for lease in self.leases:
            if lease.pin_id == pin.id and lease.deadline > now:
                found.append(lease)
        return found

    def live_pins_on_pair(self, model: str, provider: str, now: int) -> list[PinRecord]:
        found = []
        for pin in self.pins:
            if pin.model == model and pin.provider == provider and self.is_live(pin, now):
                found.append(pin)
        return found

    def view_pin(self, pin: PinRecord | None) -> Pin | None:
        if pin is None:
            return None
        return Pin(pin.provider, pin.id, pin.deadline, self.pin_expiry(pin))

    def view_lease(self, lease: LeaseRecord) -> Lease:
        return Lease(lease.model, lease.provider, lease.id, lease.session, lease.pin_id, lease.deadline)

    def forgettable(self, lease: LeaseRecord, now: int) -> bool:
        """Housekeeping may forget a lease record a further lease timeout after it expired."""
        return lease.deadline + self.lease_timeout <= now

    # ---- capacity --------------------------------------------------------------------------

    def capacity(
        self,
        model: str,
        provider: str,
        now: int,
        *,
        needs_new_pin: bool,
        session: str | None,
        may_use_reserved: bool,
    ) -> str:
        """The capacity checks, in order, for one request on the pair. `session`: the request's
        session (None for a temporary request). The per-session count is every live lease of the
        session on the pair, whichever of its pins it was admitted on (issue 10, item 8: a session
        repinned away and back while its requests run keeps its per-session limit)."""
        cap = self.pin_caps[(provider, model)]
        if needs_new_pin and cap is not None:
            if len(self.live_pins_on_pair(model, provider, now)) >= cap:
                return PIN_LIMIT_REACHED
        limits = self.pairs[(provider, model)]
        if limits is None:
            return ADMITTED
        if needs_new_pin and limits.max_pinned_sessions is not None:
            if len(self.live_pins_on_pair(model, provider, now)) >= limits.max_pinned_sessions:
                return PIN_LIMIT_REACHED
        if session is not None and limits.max_per_session_in_flight_request_slots is not None:
            in_flight_for_session = len([lease for lease in self.live_leases_on_pair(model, provider, now) if lease.session == session])
            if in_flight_for_session >= limits.max_per_session_in_flight_request_slots:
                return PER_SESSION_IN_FLIGHT_REQUEST_LIMIT_REACHED
        if limits.max_global_in_flight_request_slots is not None:
            in_flight = len(self.live_leases_on_pair(model, provider, now))
            if in_flight >= limits.max_global_in_flight_request_slots:
                return GLOBAL_IN_FLIGHT_REQUEST_LIMIT_REACHED
            unreserved = (
                limits.max_global_in_flight_request_slots
                - limits.global_in_flight_request_slots_reserved_for_pinned_sessions
            )
            if not may_use_reserved and in_flight >= unreserved:
                return UNRESERVED_IN_FLIGHT_REQUEST_LIMIT_REACHED
        return ADMITTED

    # ---- writes ----------------------------------------------------------------------------

    def _new_pin(self, model: str, session: str, provider: str, now: int) -> PinRecord:
        """Replace the session's pin (if any) by a new one with a new id."""
        old = self.current_pin(model, session)
        if old is not None:
            self.pins.remove(old)
        self._pin_ids += 1
        pin = PinRecord(model, session, provider, f"model-pin-{self._pin_ids}", now + self.pin_timeout)
        self.pins.append(pin)
        return pin

    def _new_lease(self, model, provider, lease_id, session, pin_id, now) -> LeaseRecord:
        lease = LeaseRecord(model, provider, lease_id, session, pin_id, now + self.lease_timeout)
        self.leases.append(lease)
        return lease

    def _replay(self, model: str, provider: str, session: str | None, lease_id: str, now: int):
        """The answer to a repeated admission (lease id already recorded on the pair), or None."""
        lease = self.find_lease(model, provider, lease_id)
        if lease is None:
            return None
        if lease.deadline <= now:
            return Admission(LEASE_EXPIRED, None, None, replayed=True)
        pin = self.live_pin_at(model, session, now) if session is not None else None
        return Admission(ADMITTED, self.view_pin(pin), self.view_lease(lease), replayed=True)

    # ---- the operations --------------------------------------------------------------------

    def get_pin(self, model: str, session: str, now: int) -> Pin | None:
        return self.view_pin(self.live_pin_at(model, session, now))

    def try_admit_unpinned_session_request(
        self, provider: str, model: str, session: str, lease_id: str, now: int
    ) -> Admission:
        replay = self._replay(model, provider, session, lease_id, now)
        if replay is not None:
            return replay
        pin = self.live_pin_at(model, session, now)
        if pin is not None:
            return Admission(ALREADY_PINNED, self.view_pin(pin), None)
        result = self.capacity(
            model, provider, now, needs_new_pin=True, session=session, may_use_reserved=False
        )
        if result != ADMITTED:
            return Admission(result, None, None)
        pin = self._new_pin(model, session, provider, now)
        lease = self._new_lease(model, provider, lease_id, session, pin.id, now)
        return Admission(ADMITTED, self.view_pin(pin), self.view_lease(lease))

    def try_admit_pinned_session_request(
        self, model: str, session: str, lease_id: str, now: int, pairs: dict | None = None
    ) -> Admission:
        """`pairs` (default: this model's configuration) is the configuration of the proxy that
        asks, as returned by limits_from_config: a proxy may not serve the pin's provider."""
        pairs = self.pairs if pairs is None else pairs
        pin = self.live_pin_at(model, session, now)
        if pin is None:
            return Admission(SESSION_NOT_PINNED, None, None)
        if (pin.provider, model) not in pairs:
            return Admission(PROVIDER_NOT_CONFIGURED, self.view_pin(pin), None)
        replay = self._replay(model, pin.provider, session, lease_id, now)
        if replay is not None:
            return replay
        result = self.capacity(
            model, pin.provider, now, needs_new_pin=False, session=session, may_use_reserved=True
        )
        if result != ADMITTED:
            return Admission(result, self.view_pin(pin), None)
        lease = self._new_lease(model, pin.provider, lease_id, session, pin.id, now)
        return Admission(ADMITTED, self.view_pin(pin), self.view_lease(lease))

    def try_compare_and_swap_pin_and_admit_request(
        self, expected_pin_id: str, model: str, session: str, provider: str, lease_id: str, now: int
    ) -> CasResult:
        replay = self._replay(model, provider, session, lease_id, now)
        if replay is not None:
            return CasResult(MATCHED, replay)
        pin = self.live_pin_at(model, session, now)
        if pin is None or pin.id != expected_pin_id:
            return CasResult(MISMATCHED, Admission(PIN_MISMATCH, self.view_pin(pin), None))
        if pin.provider == provider:
            return CasResult(MATCHED, Admission(ALREADY_PINNED, self.view_pin(pin), None))
        result = self.capacity(
            model, provider, now, needs_new_pin=True, session=session, may_use_reserved=False
        )
        if result != ADMITTED:
            return CasResult(MATCHED, Admission(result, self.view_pin(pin), None))
        new_pin = self._new_pin(model, session, provider, now)
        lease = self._new_lease(model, provider, lease_id, session, new_pin.id, now)
        return CasResult(MATCHED, Admission(ADMITTED, self.view_pin(new_pin), self.view_lease(lease)))

    def try_admit_request_without_pin(self, provider: str, model: str, lease_id: str, now: int) -> Admission:
        replay = self._replay(model, provider, None, lease_id, now)
        if replay is not None:
            return replay
        result = self.capacity(
            model, provider, now, needs_new_pin=False, session=None, may_use_reserved=False
        )
        if result != ADMITTED:
            return Admission(result, None, None)
        lease = self._new_lease(model, provider, lease_id, None, None, now)
        return Admission(ADMITTED, None, self.view_lease(lease))

    def renew_request_lease(self, model: str, provider: str, lease_id: str, now: int) -> tuple[str, int | None]:
        """(RENEWED, new deadline) or (LEASE_LOST, None). The pin's expiry follows by itself:
        it is computed from the deadlines of its recorded leases."""
        lease = self.find_lease(model, provider, lease_id)
        if lease is None or lease.deadline <= now:
            return LEASE_LOST, None
        lease.deadline = max(lease.deadline, now + self.lease_timeout)
        return RENEWED, lease.deadline

    def release_request_lease(self, model: str, provider: str, lease_id: str, refresh: bool, now: int) -> str:
        lease = self.find_lease(model, provider, lease_id)
        if lease is None:
            return NOT_FOUND
        self.leases.remove(lease)
        if lease.deadline <= now:
            return LEASE_EXPIRED
        pin = self.current_pin(model, lease.session)
        belongs_to_current_pin = pin is not None and lease.pin_id == pin.id
        if belongs_to_current_pin and refresh:
            pin.deadline = now + self.pin_timeout
        # Without refresh the deadline stays; if it has passed and no other lease of the pin is
        # live, the pin is dead from now on (its expiry is computed from what is left).
        return RELEASED

    def abandon_request(self, model: str, session: str | None, lease_id: str, pin_id: str, now: int) -> str:
        """A decision whose answer never arrived (issue 10): on every pair of the model the lease
        id is left as an expired record (so a late admission with it replays LEASE_EXPIRED), and
        the session's pin, if the decision made it (`pin_id`), loses its inactivity deadline.
        RELEASED if a live lease was found, LEASE_EXPIRED if only an expired one, else NOT_FOUND."""
        result = NOT_FOUND
        for provider, pair_model in self.pairs:
            if pair_model != model:
                continue
            lease = self.find_lease(model, provider, lease_id)
            if lease is not None:
                if lease.deadline > now:
                    result = RELEASED
                elif result == NOT_FOUND:
                    result = LEASE_EXPIRED
                self.leases.remove(lease)
            self.leases.append(LeaseRecord(model, provider, lease_id, None, None, now))
        pin = self.live_pin_at(model, session, now) if session is not None else None
        if pin is not None and pin.id == pin_id:
            pin.deadline = now
        return result

    def forget(self, model: str, provider: str, lease_id: str, now: int) -> None:
        """Housekeeping: forget an expired lease record. Only allowed once it is forgettable."""
        lease = self.find_lease(model, provider, lease_id)
        if lease is None:
            return
        if not self.forgettable(lease, now):
            raise AssertionError(
                f"lease {lease_id} on {provider}/{model} forgotten too early: deadline {lease.deadline}, now {now}"
            )
        self.leases.remove(lease)
