"""The routing state's transitions (lua/*.lua) against a real Redis, with explicit times (ms)."""

from __future__ import annotations

from extproc.config import parse_config
from extproc.routing.state import PinMatch, Result, RoutingState
from tests.support.configs import small_config_data

T0 = 1_000_000_000
LEASE_MS = 30_000
PIN_MS = 300_000


async def pin_new_session(state, session="s1", provider="iris-1", now=T0):
    admission = await state.try_admit_unpinned_session_request(provider, "m", session, now_ms=now)
    assert admission.result is Result.ADMITTED
    return admission


async def live_leases(redis_client, state, provider, now):
    return await redis_client.zcount(state.keys.provider_leases("m", provider), f"({now}", "+inf")


async def test_unpinned_admission_pins_the_session(state):
    admission = await pin_new_session(state)
    assert admission.pin.provider == "iris-1"
    assert admission.pin.deadline_ms == T0 + PIN_MS
    assert admission.lease.deadline_ms == T0 + LEASE_MS
    assert admission.lease.pin_id == admission.pin.id
    assert await state.get_pin("m", "s1", now_ms=T0 + 1) == admission.pin


async def test_second_unpinned_admission_answers_already_pinned(state):
    first = await pin_new_session(state)
    second = await state.try_admit_unpinned_session_request("iris-2", "m", "s1", now_ms=T0 + 1)
    assert second.result is Result.ALREADY_PINNED
    assert second.pin == first.pin
    assert second.lease is None


async def test_pinned_admission_takes_a_lease_on_the_pin(state, redis_client):
    first = await pin_new_session(state)
    again = await state.try_admit_pinned_session_request("m", "s1", now_ms=T0 + 5)
    assert again.result is Result.ADMITTED
    assert again.pin.id == first.pin.id
    assert await live_leases(redis_client, state, "iris-1", T0 + 5) == 2


async def test_pinned_admission_without_pin(state):
    admission = await state.try_admit_pinned_session_request("m", "nobody", now_ms=T0)
    assert admission.result is Result.SESSION_NOT_PINNED


async def test_per_session_limit(state):
    await pin_new_session(state)
    assert (await state.try_admit_pinned_session_request("m", "s1", now_ms=T0)).result is Result.ADMITTED
    third = await state.try_admit_pinned_session_request("m", "s1", now_ms=T0)
    assert third.result is Result.PER_SESSION_IN_FLIGHT_REQUEST_LIMIT_REACHED
    assert third.pin is not None


async def test_reserved_slots_serve_pinned_sessions_only(state):
    # global 4, reserved 1: new requests may fill 3, the 4th slot is for pinned sessions.
    await pin_new_session(state, "a")
    await pin_new_session(state, "b")
    temp = await state.try_admit_request_without_pin("iris-1", "m", now_ms=T0)
    assert temp.result is Result.ADMITTED
    refused = await state.try_admit_request_without_pin("iris-1", "m", now_ms=T0)
    assert refused.result is Result.UNRESERVED_IN_FLIGHT_REQUEST_LIMIT_REACHED
    pinned = await state.try_admit_pinned_session_request("m", "a", now_ms=T0)
    assert pinned.result is Result.ADMITTED
    full = await state.try_admit_pinned_session_request("m", "b", now_ms=T0)
    assert full.result is Result.GLOBAL_IN_FLIGHT_REQUEST_LIMIT_REACHED


async def test_pin_limit(state):
    await pin_new_session(state, "a")
    await pin_new_session(state, "b")
    third = await state.try_admit_unpinned_session_request("iris-1", "m", "c", now_ms=T0)
    assert third.result is Result.PIN_LIMIT_REACHED
    assert await state.get_pin("m", "c", now_ms=T0) is None


async def test_pin_outlives_its_deadline_while_a_lease_is_live(state):
    admission = await pin_new_session(state)
    now = T0
    # keep renewing past the inactivity deadline
    while now < T0 + PIN_MS + 2 * LEASE_MS:
        now += LEASE_MS // 3
        renewed = await state.renew_request_lease(admission.lease, now_ms=now)
        assert renewed.result is Result.RENEWED
        assert await state.get_pin("m", "s1", now_ms=now) is not None
    released = await state.release_request_lease(admission.lease, refresh_pin=False, now_ms=now + 1)
    assert released.result is Result.RELEASED
    assert await state.get_pin("m", "s1", now_ms=now + 1) is None


async def test_release_with_refresh_restarts_the_inactivity_deadline(state):
    admission = await pin_new_session(state)
    later = T0 + LEASE_MS - 1
    released = await state.release_request_lease(admission.lease, refresh_pin=True, now_ms=later)
    assert released.result is Result.RELEASED
    pin = await state.get_pin("m", "s1", now_ms=later)
    assert pin.deadline_ms == later + PIN_MS
    assert await state.get_pin("m", "s1", now_ms=later + PIN_MS - 1) is not None
    assert await state.get_pin("m", "s1", now_ms=later + PIN_MS) is None


async def test_release_without_refresh_keeps_the_deadline(state):
    admission = await pin_new_session(state)
    await state.release_request_lease(admission.lease, refresh_pin=False, now_ms=T0 + 20_000)
    pin = await state.get_pin("m", "s1", now_ms=T0 + 20_000)
    assert pin.deadline_ms == T0 + PIN_MS


async def test_expired_pins_stop_counting_against_the_pin_limit(state):
    for session in ("a", "b"):
        admission = await pin_new_session(state, session)
        await state.release_request_lease(admission.lease, refresh_pin=False, now_ms=T0 + 1)
    after = T0 + PIN_MS + 1
    third = await state.try_admit_unpinned_session_request("iris-1", "m", "c", now_ms=after)
    assert third.result is Result.ADMITTED


async def test_new_pin_on_same_provider_has_a_new_id(state):
    first = await pin_new_session(state)
    await state.release_request_lease(first.lease, refresh_pin=False, now_ms=T0 + 1)
    second = await pin_new_session(state, now=T0 + PIN_MS + 1)
    assert second.pin.provider == first.pin.provider
    assert second.pin.id != first.pin.id


async def test_lease_expires_without_release(state, redis_client):
    admission = await pin_new_session(state)
    assert await live_leases(redis_client, state, "iris-1", T0 + LEASE_MS - 1) == 1
    assert await live_leases(redis_client, state, "iris-1", T0 + LEASE_MS) == 0
    # The slot is free again for admission at that time.
    again = await state.try_admit_pinned_session_request("m", "s1", now_ms=T0 + LEASE_MS)
    assert again.result is Result.ADMITTED
    del admission


async def test_renewal_after_expiry_is_lost_and_never_recreates(state, redis_client):
    admission = await pin_new_session(state)
    lost = await state.renew_request_lease(admission.lease, now_ms=T0 + LEASE_MS + 1)
    assert lost.result is Result.LEASE_LOST
    assert await live_leases(redis_client, state, "iris-1", T0 + LEASE_MS + 1) == 0


async def test_admission_is_idempotent_on_the_lease_id(state, redis_client):
    first = await state.try_admit_unpinned_session_request("iris-1", "m", "s1", lease_id="L1", now_ms=T0)
    again = await state.try_admit_unpinned_session_request("iris-1", "m", "s1", lease_id="L1", now_ms=T0 + 1)
    assert again.result is Result.ADMITTED and again.lease.id == "L1" and again.pin == first.pin
    pinned = await state.try_admit_pinned_session_request("m", "s1", lease_id="L1", now_ms=T0 + 2)
    assert pinned.result is Result.ADMITTED
    temp1 = await state.try_admit_request_without_pin("iris-2", "m", lease_id="T1", now_ms=T0)
    temp2 = await state.try_admit_request_without_pin("iris-2", "m", lease_id="T1", now_ms=T0)
    assert temp1.lease == temp2.lease
    assert await live_leases(redis_client, state, "iris-1", T0 + 2) == 1
    assert await live_leases(redis_client, state, "iris-2", T0 + 2) == 1


async def test_release_of_an_expired_lease_does_not_refresh_the_pin(state):
    admission = await pin_new_session(state)
    late = await state.release_request_lease(admission.lease, refresh_pin=True, now_ms=T0 + LEASE_MS + 1)
    assert late.result is Result.LEASE_EXPIRED
    assert (await state.get_pin("m", "s1", now_ms=T0 + LEASE_MS + 1)).deadline_ms == T0 + PIN_MS


async def test_release_is_idempotent(state):
    admission = await pin_new_session(state)
    assert (await state.release_request_lease(admission.lease, True, now_ms=T0 + 1)).result is Result.RELEASED
    assert (await state.release_request_lease(admission.lease, True, now_ms=T0 + 2)).result is Result.NOT_FOUND


async def test_compare_and_swap_moves_the_pin(state, redis_client):
    first = await pin_new_session(state)
    cas = await state.try_compare_and_swap_pin_and_admit_request(first.pin, "m", "s1", "iris-2", now_ms=T0 + 1)
    assert cas.pin_match is PinMatch.MATCHED
    assert cas.admission.result is Result.ADMITTED
    assert cas.admission.pin.provider == "iris-2"
    assert cas.admission.pin.id != first.pin.id
    assert (await state.get_pin("m", "s1", now_ms=T0 + 2)).provider == "iris-2"
    # the old pin no longer counts on iris-1, the old request's lease still does until released
    pins_key = state.keys.provider_pins("m", "iris-1")
    assert await redis_client.zcount(pins_key, f"({T0 + 2}", "+inf") == 0
    assert await live_leases(redis_client, state, "iris-1", T0 + 2) == 1
    await state.release_request_lease(first.lease, refresh_pin=True, now_ms=T0 + 3)
    assert (await state.get_pin("m", "s1", now_ms=T0 + 3)).id == cas.admission.pin.id


async def test_compare_and_swap_with_a_stale_pin_mismatches(state):
    first = await pin_new_session(state)
    await state.try_compare_and_swap_pin_and_admit_request(first.pin, "m", "s1", "iris-2", now_ms=T0 + 1)
    stale = await state.try_compare_and_swap_pin_and_admit_request(first.pin, "m", "s1", "tensorx", now_ms=T0 + 2)
    assert stale.pin_match is PinMatch.MISMATCHED
    assert stale.admission.pin.provider == "iris-2"


async def test_compare_and_swap_refused_by_capacity_keeps_the_pin(state):
    first = await pin_new_session(state, "s1", "iris-1")
    await pin_new_session(state, "a", "iris-2")
    await pin_new_session(state, "b", "iris-2")
    cas = await state.try_compare_and_swap_pin_and_admit_request(first.pin, "m", "s1", "iris-2", now_ms=T0 + 1)
    assert cas.pin_match is PinMatch.MATCHED
    assert cas.admission.result is Result.PIN_LIMIT_REACHED
    assert (await state.get_pin("m", "s1", now_ms=T0 + 1)).id == first.pin.id


async def test_unlimited_pairs_admit_pinned_requests_with_leases(state, redis_client):
    for i in range(20):
        admission = await state.try_admit_unpinned_session_request("tensorx", "m", f"s{i}", now_ms=T0)
        assert admission.result is Result.ADMITTED
        assert admission.lease is not None
    assert await live_leases(redis_client, state, "tensorx", T0) == 20


async def test_scripts_recover_from_script_flush(state, redis_client):
    await pin_new_session(state)
    await redis_client.script_flush()
    again = await state.try_admit_pinned_session_request("m", "s1", now_ms=T0 + 1)
    assert again.result is Result.ADMITTED


async def test_redis_time_is_used_without_an_explicit_time(state, redis_client):
    admission = await state.try_admit_unpinned_session_request("iris-1", "m", "s1")
    seconds, micros = await redis_client.time()
    redis_now = seconds * 1000 + micros // 1000
    assert redis_now - 5_000 <= admission.now_ms <= redis_now


async def test_every_key_has_a_ttl(state, redis_client):
    first = await pin_new_session(state)
    await state.try_admit_request_without_pin("iris-2", "m", now_ms=T0)
    await state.release_request_lease(first.lease, refresh_pin=True, now_ms=T0 + 1)
    keys = await redis_client.keys("*")
    assert keys
    for key in keys:
        assert await redis_client.pttl(key) > 0, key


async def test_every_key_of_a_model_shares_one_hash_tag(state, redis_client):
    await pin_new_session(state)
    await state.try_admit_request_without_pin("iris-2", "m", now_ms=T0)
    keys = [k.decode() for k in await redis_client.keys("*")]
    assert keys and all(k.startswith("{t:m}:") for k in keys)


async def test_fused_first_attempt_admits_on_the_pin(state):
    first = await pin_new_session(state)
    pin, admission = await state.get_pin_and_try_admit("m", "s1", ["iris-1", "iris-2"], now_ms=T0 + 1)
    assert pin == first.pin
    assert admission.result is Result.ADMITTED and admission.pin == first.pin


async def test_fused_first_attempt_pins_a_new_session_on_the_first_eligible(state):
    pin, admission = await state.get_pin_and_try_admit("m", "s1", ["iris-2", "tensorx"], now_ms=T0)
    assert pin is None
    assert admission.result is Result.ADMITTED and admission.pin.provider == "iris-2"
    assert (await state.get_pin("m", "s1", now_ms=T0)).provider == "iris-2"


async def test_fused_first_attempt_leaves_an_ineligible_pin_alone(state, redis_client):
    first = await pin_new_session(state)
    pin, admission = await state.get_pin_and_try_admit("m", "s1", ["iris-2"], now_ms=T0 + 1)
    assert pin == first.pin and admission is None
    assert await live_leases(redis_client, state, "iris-1", T0 + 1) == 1


async def test_fused_first_attempt_reports_capacity_results(state):
    await pin_new_session(state, "a")
    await pin_new_session(state, "b")
    pin, admission = await state.get_pin_and_try_admit("m", "c", ["iris-1"], now_ms=T0)
    assert pin is None and admission.result is Result.PIN_LIMIT_REACHED
    pin, admission = await state.get_pin_and_try_admit("m", "c", [], now_ms=T0)
    assert pin is None and admission is None


async def test_a_repeated_admission_names_the_pair_the_lease_is_on(state):
    # A retry with the same lease id replays the first answer, with the session's current pin.
    # The lease stays where it is recorded even when the pin has moved to another provider.
    first = await state.try_admit_unpinned_session_request("iris-1", "m", "s1", lease_id="L1", now_ms=T0)
    await state.try_compare_and_swap_pin_and_admit_request(first.pin, "m", "s1", "iris-2", lease_id="L2", now_ms=T0 + 1)
    again = await state.try_admit_unpinned_session_request("iris-1", "m", "s1", lease_id="L1", now_ms=T0 + 2)
    assert again.result is Result.ADMITTED and again.pin.provider == "iris-2"
    assert (again.lease.provider, again.lease.deadline_ms) == ("iris-1", T0 + LEASE_MS)
    assert (await state.release_request_lease(again.lease, False, now_ms=T0 + 3)).result is Result.RELEASED


async def test_renewing_a_lease_of_an_old_pin_never_keeps_the_new_pin_alive(state):
    first = await state.try_admit_unpinned_session_request("iris-1", "m", "s1", lease_id="L1", now_ms=T0)
    moved = await state.try_compare_and_swap_pin_and_admit_request(first.pin, "m", "s1", "iris-2", now_ms=T0 + 1)
    await state.release_request_lease(moved.admission.lease, refresh_pin=False, now_ms=T0 + 2)
    # The replayed answer carries the current (new) pin; the lease is still the old pin's.
    replayed = await state.try_admit_unpinned_session_request("iris-1", "m", "s1", lease_id="L1", now_ms=T0 + 2)
    now = T0 + 2
    while now < T0 + 1 + PIN_MS + LEASE_MS:
        now += LEASE_MS // 3
        assert (await state.renew_request_lease(replayed.lease, now_ms=now)).result is Result.RENEWED
    assert await state.get_pin("m", "s1", now_ms=now) is None


async def test_releasing_an_expired_lease_leaves_a_same_named_lease_of_the_pin_counted(state):
    first = await state.try_admit_unpinned_session_request("iris-2", "m", "s1", lease_id="L1", now_ms=T0)
    # A retry reuses the lease id on another provider: L1 is now also the new pin's lease.
    moved = await state.try_compare_and_swap_pin_and_admit_request(
        first.pin, "m", "s1", "iris-1", lease_id="L1", now_ms=T0 + LEASE_MS // 2
    )
    assert moved.admission.result is Result.ADMITTED
    late = await state.release_request_lease(first.lease, refresh_pin=False, now_ms=T0 + LEASE_MS + 1)
    assert late.result is Result.LEASE_EXPIRED
    # The pin's own L1 still counts against the per-session limit (2).
    now = T0 + LEASE_MS + 2
    assert (await state.try_admit_pinned_session_request("m", "s1", now_ms=now)).result is Result.ADMITTED
    third = await state.try_admit_pinned_session_request("m", "s1", now_ms=now)
    assert third.result is Result.PER_SESSION_IN_FLIGHT_REQUEST_LIMIT_REACHED


async def test_a_repin_by_a_proxy_that_no_longer_routes_the_old_provider_frees_its_pin(
    state, redis_client, redis_url
):
    # A configuration rollout: this proxy no longer routes model m to iris-2. The router repins
    # sessions pinned there; the old pin must stop counting on iris-2 at once.
    data = small_config_data(redis_url)
    data["providers"][1]["models"] = {"z": {"features": ["chat"]}}
    other = RoutingState(redis_client, parse_config(data))
    first = await pin_new_session(state, "s1", "iris-2")
    moved = await other.try_compare_and_swap_pin_and_admit_request(first.pin, "m", "s1", "iris-1", now_ms=T0 + 1)
    assert moved.admission.result is Result.ADMITTED
    assert await redis_client.zcount(state.keys.provider_pins("m", "iris-2"), f"({T0 + 1}", "+inf") == 0


async def test_fused_first_attempt_replaying_an_expired_lease_of_a_pinned_session(state):
    """Issue 10, item 9: the replay answers LEASE_EXPIRED without a pin; the pin seen is still
    reported (it raised AttributeError)."""
    first = await pin_new_session(state)
    later = T0 + LEASE_MS + 1
    pin, admission = await state.get_pin_and_try_admit("m", "s1", ["iris-1"], lease_id=first.lease.id, now_ms=later)
    assert admission.result is Result.LEASE_EXPIRED
    assert (pin.provider, pin.id) == ("iris-1", first.pin.id)


async def test_abandoning_a_decision_ends_its_lease_and_the_pin_it_made(state, redis_client):
    admission = await state.try_admit_unpinned_session_request("iris-1", "m", "s1", lease_id="L", pin_id="P", now_ms=T0)
    assert admission.result is Result.ADMITTED
    update = await state.abandon_request("m", "s1", "L", "P", now_ms=T0 + 5)
    assert update.result is Result.RELEASED
    assert await live_leases(redis_client, state, "iris-1", T0 + 5) == 0
    assert await state.get_pin("m", "s1", now_ms=T0 + 5) is None
    # The admission, arriving late with the same ids, never admits: the id is a tombstone.
    late = await state.try_admit_unpinned_session_request("iris-1", "m", "s1", lease_id="L", pin_id="P", now_ms=T0 + 6)
    assert late.result is Result.LEASE_EXPIRED
    assert await state.get_pin("m", "s1", now_ms=T0 + 6) is None
    assert (await state.abandon_request("m", "s1", "L", "P", now_ms=T0 + 7)).result is Result.LEASE_EXPIRED


async def test_abandoning_an_id_never_admitted_changes_no_pin(state, redis_client):
    first = await pin_new_session(state)
    update = await state.abandon_request("m", "s1", "never", "unused-pin", now_ms=T0 + 5)
    assert update.result is Result.NOT_FOUND
    assert await state.get_pin("m", "s1", now_ms=T0 + 5) == first.pin
    assert await live_leases(redis_client, state, "iris-1", T0 + 5) == 1


async def test_abandoning_a_lease_on_an_existing_pin_keeps_the_pin(state, redis_client):
    first = await pin_new_session(state)
    admission = await state.try_admit_pinned_session_request("m", "s1", lease_id="L2", now_ms=T0 + 1)
    assert admission.result is Result.ADMITTED
    assert (await state.abandon_request("m", "s1", "L2", "P-unused", now_ms=T0 + 2)).result is Result.RELEASED
    pin = await state.get_pin("m", "s1", now_ms=T0 + 2)
    assert pin.id == first.pin.id
    assert await live_leases(redis_client, state, "iris-1", T0 + 2) == 1


async def test_adoption_brings_back_an_expired_lease_and_never_shortens_one(state, redis_client):
    first = await pin_new_session(state)
    after_expiry = T0 + LEASE_MS + 10
    assert (await state.renew_request_lease(first.lease, now_ms=after_expiry)).result is Result.LEASE_LOST
    adopted = await state.adopt_request_lease(first.lease, now_ms=after_expiry)
    assert adopted.lease.deadline_ms == after_expiry + LEASE_MS
    assert (await state.renew_request_lease(first.lease, now_ms=after_expiry + 1)).result is Result.RENEWED
    again = await state.adopt_request_lease(first.lease, now_ms=after_expiry - LEASE_MS)
    assert again.lease.deadline_ms == after_expiry + 1 + LEASE_MS


async def test_adoption_within_limits_counts_the_sessions_leases_on_the_pair_only(state):
    """A lease on iris-1 expired in Redis while its request ran; the session's pin has moved to
    iris-2 meanwhile and holds max_per_session (2) leases there: they are not on iris-1, so the
    adoption within limits on iris-1 takes the lease back (it was refused as over the session's
    limit: the current pin's leases were counted whatever its provider)."""
    first = await pin_new_session(state)
    away = await state.try_compare_and_swap_pin_and_admit_request(first.pin, "m", "s1", "iris-2", now_ms=T0 + 2)
    assert away.admission.result is Result.ADMITTED
    second = await state.try_admit_pinned_session_request("m", "s1", now_ms=T0 + 3)
    assert second.result is Result.ADMITTED and second.lease.provider == "iris-2"
    for lease in (away.admission.lease, second.lease):  # the two on iris-2 stay live; the one on iris-1 expires
        assert (await state.renew_request_lease(lease, now_ms=T0 + LEASE_MS - 1)).result is Result.RENEWED
    after_expiry = T0 + LEASE_MS + 10
    adopted = await state.adopt_request_lease(first.lease, within_limits=True, now_ms=after_expiry)
    assert adopted.result is Result.ADMITTED
    assert adopted.lease.deadline_ms == after_expiry + LEASE_MS


async def test_adoption_within_limits_counts_the_leases_of_the_pin_on_the_pair(state):
    """The same expired lease while the session's pin is on its pair with max_per_session (2)
    live leases there: the adoption is refused by the session's limit."""
    first = await pin_new_session(state)
    later = T0 + LEASE_MS + 10  # the first lease expired; the session's pin lives on
    for at in (later, later + 1):
        assert (await state.try_admit_pinned_session_request("m", "s1", now_ms=at)).result is Result.ADMITTED
    refused = await state.adopt_request_lease(first.lease, within_limits=True, now_ms=later + 2)
    assert refused.result is Result.PER_SESSION_IN_FLIGHT_REQUEST_LIMIT_REACHED


async def test_repin_back_counts_the_requests_still_running_on_the_pair(state, redis_client):
    """Issue 10, item 8: 2 requests run on iris-1 (per-session limit 2), the pin moves to iris-2
    and back while they run: the session may not get more on iris-1 until they end."""
    first = await pin_new_session(state)
    second = await state.try_admit_pinned_session_request("m", "s1", now_ms=T0 + 1)
    assert second.result is Result.ADMITTED
    away = await state.try_compare_and_swap_pin_and_admit_request(first.pin, "m", "s1", "iris-2", now_ms=T0 + 2)
    assert away.admission.result is Result.ADMITTED
    await state.release_request_lease(away.admission.lease, refresh_pin=False, now_ms=T0 + 3)
    back = await state.try_compare_and_swap_pin_and_admit_request(away.admission.pin, "m", "s1", "iris-1", now_ms=T0 + 4)
    assert back.admission.result is Result.PER_SESSION_IN_FLIGHT_REQUEST_LIMIT_REACHED
    # One of the two ends: the pin may come back, with one more request, and no further.
    await state.release_request_lease(first.lease, refresh_pin=True, now_ms=T0 + 5)
    back = await state.try_compare_and_swap_pin_and_admit_request(away.admission.pin, "m", "s1", "iris-1", now_ms=T0 + 6)
    assert back.admission.result is Result.ADMITTED
    more = await state.try_admit_pinned_session_request("m", "s1", now_ms=T0 + 7)
    assert more.result is Result.PER_SESSION_IN_FLIGHT_REQUEST_LIMIT_REACHED
    # Renewals keep the earlier request counted past its first deadline.
    assert (await state.renew_request_lease(second.lease, now_ms=T0 + LEASE_MS - 1)).result is Result.RENEWED
    await state.release_request_lease(back.admission.lease, refresh_pin=True, now_ms=T0 + LEASE_MS)
    later = await state.try_admit_pinned_session_request("m", "s1", now_ms=T0 + LEASE_MS + 10)
    assert later.result is Result.ADMITTED  # the earlier one (renewed) plus this one: 2
    again = await state.try_admit_pinned_session_request("m", "s1", now_ms=T0 + LEASE_MS + 11)
    assert again.result is Result.PER_SESSION_IN_FLIGHT_REQUEST_LIMIT_REACHED


async def test_a_new_pin_counts_the_sessions_earlier_requests_on_the_pair(state):
    first = await pin_new_session(state)
    await state.try_admit_pinned_session_request("m", "s1", now_ms=T0 + 1)
    away = await state.try_compare_and_swap_pin_and_admit_request(first.pin, "m", "s1", "tensorx", now_ms=T0 + 2)
    assert away.admission.result is Result.ADMITTED
    await state.release_request_lease(away.admission.lease, refresh_pin=False, now_ms=T0 + 3)
    dead = T0 + PIN_MS + 10  # the pin on tensorx is dead; renewals keep the two on iris-1 running
    for t in range(T0 + LEASE_MS // 2, dead, LEASE_MS // 2):
        assert (await state.renew_request_lease(first.lease, now_ms=t)).result is Result.RENEWED
    assert await state.get_pin("m", "s1", now_ms=dead) is None
    # One earlier request still runs (the other expired unrenewed): one more fits, not two.
    assert (await state.try_admit_unpinned_session_request("iris-1", "m", "s1", now_ms=dead)).result is Result.ADMITTED
    assert (await state.try_admit_pinned_session_request("m", "s1", now_ms=dead + 1)).result is (
        Result.PER_SESSION_IN_FLIGHT_REQUEST_LIMIT_REACHED
    )


async def test_a_shorter_timeout_after_a_reload_never_shortens_the_shared_keys(redis_client, redis_url):
    """A reload that lowers the pin and lease timeouts: the pair's shared sets (every pin, every
    lease) keep the TTL the longer-lived pins and leases made before need (issue 20: they would
    expire under those pins and leases, and the pair's counts would drop)."""
    before = RoutingState(redis_client, parse_config(small_config_data(redis_url)))  # pins 300 s, leases 30 s
    after = RoutingState(redis_client, parse_config(small_config_data(redis_url, pin_inactivity_timeout_seconds=5, lease_timeout_seconds=2)))
    await pin_new_session(before, session="old")
    old_pins_ttl = await redis_client.pttl(before.keys.provider_pins("m", "iris-1"))
    old_leases_ttl = await redis_client.pttl(before.keys.provider_leases("m", "iris-1"))
    await pin_new_session(after, session="new")
    assert await redis_client.pttl(before.keys.provider_pins("m", "iris-1")) > old_pins_ttl - 1000
    assert await redis_client.pttl(before.keys.provider_leases("m", "iris-1")) > old_leases_ttl - 1000
