"""The reference model alone (no Redis): one scenario per rule of issue #2's semantics, so the
model the differential tests trust is itself checked against the text, not only against Lua."""

from __future__ import annotations

import itertools

import pytest

from extproc.config import parse_config
from tests.model_based.model import routing as R
from tests.model_based.model import state as S
from tests.support.configs import small_config_data

T0 = 1_000_000
LEASE = 30_000
PIN = 300_000


@pytest.fixture
def config():
    # iris-1, iris-2: pins 2, global 4, reserved 1, per session 2; tensorx unlimited.
    return parse_config(small_config_data())


@pytest.fixture
def model(config):
    return S.RoutingModel(config, PIN, LEASE)


def pin_new(model, session="s", provider="iris-1", lease="L", now=T0):
    admission = model.try_admit_unpinned_session_request(provider, "m", session, lease, now)
    assert admission.result == S.ADMITTED
    return admission


def test_new_pin_and_lease_deadlines(model):
    admission = pin_new(model)
    assert (admission.pin.deadline, admission.pin.expiry, admission.lease.deadline) == (T0 + PIN, T0 + PIN, T0 + LEASE)
    assert model.get_pin("m", "s", T0 + PIN - 1) is not None
    assert model.get_pin("m", "s", T0 + PIN) is None  # live is strict


def test_reserved_slots_serve_existing_pins_only(model):
    pin_new(model, "a", lease="a1")
    pin_new(model, "b", lease="b1")
    assert model.try_admit_request_without_pin("iris-1", "m", "t1", T0).result == S.ADMITTED
    assert model.try_admit_request_without_pin("iris-1", "m", "t2", T0).result == S.UNRESERVED_IN_FLIGHT_REQUEST_LIMIT_REACHED
    assert model.try_admit_pinned_session_request("m", "a", "a2", T0).result == S.ADMITTED
    assert model.try_admit_pinned_session_request("m", "b", "b2", T0).result == S.GLOBAL_IN_FLIGHT_REQUEST_LIMIT_REACHED


def test_check_order_pin_limit_before_in_flight_limits(model):
    pin_new(model, "a", lease="a1")
    pin_new(model, "b", lease="b1")
    assert model.try_admit_unpinned_session_request("iris-1", "m", "c", "c1", T0).result == S.PIN_LIMIT_REACHED


def test_per_session_limit_counts_the_current_pin_only(model):
    first = pin_new(model, lease="L1")
    assert model.try_admit_pinned_session_request("m", "s", "L2", T0).result == S.ADMITTED
    assert model.try_admit_pinned_session_request("m", "s", "L3", T0).result == S.PER_SESSION_IN_FLIGHT_REQUEST_LIMIT_REACHED
    # After a repin the old pin's leases no longer count for the session.
    cas = model.try_compare_and_swap_pin_and_admit_request(first.pin.id, "m", "s", "iris-2", "L4", T0 + 1)
    assert cas.admission.result == S.ADMITTED
    assert model.try_admit_pinned_session_request("m", "s", "L5", T0 + 1).result == S.ADMITTED


def test_a_live_lease_keeps_its_pin_alive_past_the_deadline(model):
    admission = pin_new(model)
    now = T0
    while now < T0 + PIN + LEASE:
        now += LEASE // 2
        assert model.renew_request_lease("m", "iris-1", "L", now) == (S.RENEWED, now + LEASE)
        assert model.get_pin("m", "s", now).expiry == max(T0 + PIN, now + LEASE)
    assert model.release_request_lease("m", "iris-1", "L", False, now + 1) == S.RELEASED
    assert model.get_pin("m", "s", now + 1) is None  # deadline long past, nothing live: dead at once
    del admission


def test_release_with_refresh_restarts_the_deadline_without_keeps_it(model):
    pin_new(model, lease="L1")
    model.try_admit_pinned_session_request("m", "s", "L2", T0)
    assert model.release_request_lease("m", "iris-1", "L1", False, T0 + 10) == S.RELEASED
    assert model.get_pin("m", "s", T0 + 10).deadline == T0 + PIN
    assert model.release_request_lease("m", "iris-1", "L2", True, T0 + 20) == S.RELEASED
    assert model.get_pin("m", "s", T0 + 20).deadline == T0 + 20 + PIN


def test_expired_leases_are_lost_never_recreated_and_release_answers_expired(model):
    pin_new(model)
    assert model.renew_request_lease("m", "iris-1", "L", T0 + LEASE) == (S.LEASE_LOST, None)
    assert model.release_request_lease("m", "iris-1", "L", True, T0 + LEASE) == S.LEASE_EXPIRED
    assert model.get_pin("m", "s", T0 + LEASE).deadline == T0 + PIN  # no refresh
    assert model.release_request_lease("m", "iris-1", "L", True, T0 + LEASE) == S.NOT_FOUND


def test_repeated_admissions_never_admit_twice(model):
    first = pin_new(model)
    again = model.try_admit_pinned_session_request("m", "s", "L", T0 + 1)
    assert (again.result, again.lease, again.replayed) == (S.ADMITTED, first.lease, True)
    assert len(model.live_leases_on_pair("m", "iris-1", T0 + 1)) == 1
    late = model.try_admit_request_without_pin("iris-1", "m", "L", T0 + LEASE)
    assert (late.result, late.pin, late.lease) == (S.LEASE_EXPIRED, None, None)


def test_housekeeping_may_forget_only_a_lease_timeout_after_expiry(model):
    pin_new(model)
    with pytest.raises(AssertionError):
        model.forget("m", "iris-1", "L", T0 + 2 * LEASE - 1)
    model.forget("m", "iris-1", "L", T0 + 2 * LEASE)
    assert model.try_admit_request_without_pin("iris-1", "m", "L", T0 + 2 * LEASE).result == S.ADMITTED


def test_compare_and_swap(model):
    first = pin_new(model, lease="L1")
    stale = model.try_compare_and_swap_pin_and_admit_request("other", "m", "s", "iris-2", "X", T0)
    assert (stale.pin_match, stale.admission.result, stale.admission.pin) == (S.MISMATCHED, S.PIN_MISMATCH, first.pin)
    same = model.try_compare_and_swap_pin_and_admit_request(first.pin.id, "m", "s", "iris-1", "X", T0)
    assert same.admission.result == S.ALREADY_PINNED
    moved = model.try_compare_and_swap_pin_and_admit_request(first.pin.id, "m", "s", "iris-2", "L2", T0 + 1)
    assert moved.pin_match == S.MATCHED and moved.admission.pin.provider == "iris-2"
    assert moved.admission.pin.id != first.pin.id
    assert model.live_pins_on_pair("m", "iris-1", T0 + 1) == []  # stops counting at once
    assert len(model.live_leases_on_pair("m", "iris-1", T0 + 1)) == 1  # its lease still counts
    # The old pin's lease keeps no pin alive and its release refreshes nothing.
    model.release_request_lease("m", "iris-2", "L2", False, T0 + 2)
    new_pin = model.get_pin("m", "s", T0 + 2)
    assert model.renew_request_lease("m", "iris-1", "L1", T0 + LEASE - 1) == (S.RENEWED, T0 + 2 * LEASE - 1)
    assert model.release_request_lease("m", "iris-1", "L1", True, T0 + LEASE) == S.RELEASED
    assert model.get_pin("m", "s", T0 + LEASE) == new_pin
    assert model.get_pin("m", "s", T0 + 1 + PIN) is None


def test_pairs_without_limits_admit_everything_with_leases(model):
    for i in range(10):
        admission = model.try_admit_unpinned_session_request("tensorx", "m", f"s{i}", f"L{i}", T0)
        assert admission.result == S.ADMITTED and admission.lease is not None


IDS = (f"R{i}" for i in itertools.count())


def route(model, config, request, degraded=frozenset(), now=T0):
    return R.run(R.ModelRouter(config, set(degraded)), model, request, now, lambda: next(IDS))


def chat(session, sub_features=()):
    return R.Request("m", "chat", frozenset(sub_features), session)


def test_algorithm_pins_offloads_and_repins(model, config):
    first = route(model, config, chat("s"))
    assert (first.provider, first.reason, first.refresh_pin_on_success) == ("iris-1", R.NEW_PIN, True)
    second = route(model, config, chat("s"))
    assert (second.provider, second.reason, second.pin) == ("iris-1", R.PINNED, first.pin)
    third = route(model, config, chat("s"))  # per-session limit: offloaded, pin kept
    assert (third.provider, third.reason, third.pin, third.refresh_pin_on_success) == ("iris-2", R.OFFLOADED, None, False)
    moved = route(model, config, chat("s"), degraded={("iris-1", "m")})
    assert (moved.provider, moved.reason) == ("iris-2", R.REPINNED)
    # iris-2 lacks tools; iris-1 still runs the session's 2 requests of its first pin (its
    # per-session limit, issue 10 item 8), so the pin moves on to the third party.
    tools = route(model, config, chat("s", ["tools"]))
    assert (tools.provider, tools.reason) == ("tensorx", R.REPINNED)


def test_algorithm_priority_fallback_and_rejections(model, config):
    names = [route(model, config, chat(f"s{i}")).provider for i in range(6)]
    assert names == ["iris-1", "iris-1", "iris-2", "iris-2", "tensorx", "tensorx"]
    embeddings = R.Request("e", "embeddings", frozenset(), None)
    degraded = route(model, config, embeddings, degraded={("iris-1", "e"), ("tensorx", "e")})
    assert (degraded.provider, degraded.reason, degraded.lease) == ("tensorx", R.UNPINNED, None)  # never degraded
    assert route(model, config, R.Request("nope", "chat", frozenset(), "s")) == R.Rejection(R.UNSUPPORTED)
