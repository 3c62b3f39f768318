"""Deliberately broken routing scripts, for the mutation check (tests/test_mutants.py).

Each mutant is a list of edits (script name, original snippet, replacement) applied to
`extproc.state.script_source(name)` (lib.lua followed by <name>.lua). The script name "lib" means
the edit is in lib.lua and applies to every script (each one carries lib.lua). Every original
snippet must occur exactly once in each script it applies to, so a mutant cannot silently stop
mutating when the scripts change: `mutated_sources` raises instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from extproc.routing.state import SCRIPT_NAMES, script_source


@dataclass(frozen=True)
class Mutant:
    name: str
    why: str  # the behaviour it breaks
    edits: tuple[tuple[str, str, str], ...]


def mutated_sources(mutant: Mutant) -> dict[str, str]:
    """{script name: mutated full source} for every script the mutant changes."""
    out: dict[str, str] = {}
    for script, original, replacement in mutant.edits:
        for name in SCRIPT_NAMES if script == "lib" else (script,):
            text = out.get(name, script_source(name))
            count = text.count(original)
            if script == "lib" and count == 0:
                continue  # never happens: every script carries lib.lua
            if count != 1:
                raise ValueError(f"mutant {mutant.name}: {original!r} occurs {count} times in {name}")
            out[name] = text.replace(original, replacement)
    if not out:
        raise ValueError(f"mutant {mutant.name} changes nothing")
    return out


MUTANTS = (
    Mutant(
        "reserved_slots_ignored",
        "new, unpinned and temporary requests may use the slots reserved for pinned sessions",
        (("lib", "if not may_use_reserved and in_flight >= p.max_global - p.reserved then", "if false then"),),
    ),
    Mutant(
        "temporary_requests_use_reserved_slots",
        "a request without pin may use the reserved slots",
        (("admit_without_pin", "capacity_result(ctx, p, nil, false, false)", "capacity_result(ctx, p, nil, true, false)"),),
    ),
    Mutant(
        "repin_uses_reserved_slots",
        "a compare-and-swap repin (a new pin) may use the reserved slots",
        (("cas_repin", "capacity_result(ctx, target, earlier_in_flight(ctx, target), false, true)",
          "capacity_result(ctx, target, earlier_in_flight(ctx, target), true, true)"),),
    ),
    Mutant(
        "temporary_requests_unlimited",
        "a request without pin is admitted whatever the pair's load",
        (("admit_without_pin", "capacity_result(ctx, p, nil, false, false)", "'ADMITTED'"),),
    ),
    Mutant(
        "renew_recreates_an_expired_lease",
        "renewing an expired or forgotten lease brings it back instead of answering LEASE_LOST",
        (
            ("renew", "if not score or score <= ctx.now then", "if false then"),
            ("renew", "local deadline = math.max(score,", "local deadline = math.max(score or 0,"),
            ("renew", "redis.call('ZADD', p.leases_key, 'XX', deadline, lease_id)",
             "redis.call('ZADD', p.leases_key, deadline, lease_id)"),
        ),
    ),
    Mutant(
        "renew_revives_an_expired_lease",
        "renewing a lease that expired but is still recorded succeeds",
        (("renew", "if not score or score <= ctx.now then", "if not score then"),),
    ),
    Mutant(
        "release_refreshes_when_told_not_to",
        "a release without refresh restarts the pin's inactivity deadline",
        (("release", "if refresh then", "if true then"),),
    ),
    Mutant(
        "release_never_refreshes",
        "a release with refresh leaves the pin's inactivity deadline as it was",
        (("release", "pin.deadline = ctx.now + ctx.pin_timeout", "pin.deadline = pin.deadline"),),
    ),
    Mutant(
        "release_of_an_expired_lease_counts_as_live",
        "releasing an expired lease answers RELEASED and may refresh the pin",
        (("release", "if score <= ctx.now then\n    if on_pin then", "if score < 0 then\n    if on_pin then"),),
    ),
    Mutant(
        "pin_expiry_ignores_live_leases_on_release",
        "releasing one lease lets the pin die at its deadline although another lease is live",
        (("release", "pin.expiry = math.max(pin.deadline, latest_session_lease_deadline(ctx))",
          "pin.expiry = pin.deadline"),),
    ),
    Mutant(
        "pin_expiry_ignores_renewals",
        "renewing a lease does not keep its pin alive",
        (("renew", "redis.call('ZADD', ctx.session_leases_key, 'XX', deadline, lease_id)\n    pin.expiry = math.max(pin.expiry, deadline)",
          "redis.call('ZADD', ctx.session_leases_key, 'XX', deadline, lease_id)"),),
    ),
    Mutant(
        "pin_expiry_ignores_new_leases",
        "admitting a request on a pin does not keep the pin alive while the lease is",
        (("lib", "redis.call('ZADD', ctx.session_leases_key, deadline, lease_id)\n  pin.expiry = math.max(pin.expiry, deadline)",
          "redis.call('ZADD', ctx.session_leases_key, deadline, lease_id)"),),
    ),
    Mutant(
        "new_pin_deadline_is_the_lease_timeout",
        "a new pin's inactivity deadline uses the lease timeout",
        (("lib", "local deadline = ctx.now + ctx.pin_timeout\n  local pin = {",
          "local deadline = ctx.now + ctx.lease_timeout\n  local pin = {"),),
    ),
    Mutant(
        "dead_pins_count_against_the_pin_limit",
        "the pin count relies on cleanup: expired pins count against max_pinned_sessions",
        (
            ("lib", "live_count(p.pins_key, ctx.now) >= p.max_pins", "redis.call('ZCARD', p.pins_key) >= p.max_pins"),
            ("lib", "drop_expired(p.pins_key, ctx.now)", ""),
        ),
    ),
    Mutant(
        "housekeeping_drops_live_pins",
        "cleanup removes pins that are still live, so they stop counting against the pin limit",
        (("lib", "drop_expired(p.pins_key, ctx.now)", "drop_expired(p.pins_key, ctx.now + ctx.lease_timeout)"),),
    ),
    Mutant(
        "counts_include_what_expires_now",
        "a lease or pin whose deadline is exactly now still counts (live must be deadline > now)",
        (("lib", "return redis.call('ZCOUNT', key, '(' .. now, '+inf')", "return redis.call('ZCOUNT', key, now, '+inf')"),),
    ),
    Mutant(
        "pin_alive_at_its_expiry",
        "a pin whose expiry is exactly now is still live",
        (("lib", "if pin.expiry <= ctx.now then\n    return nil", "if pin.expiry < ctx.now then\n    return nil"),),
    ),
    Mutant(
        "repeated_admission_admits_twice",
        "an admission with a lease id already recorded admits again",
        (("lib", "local function replayed_admission(ctx, p, lease_id)\n",
          "local function replayed_admission(ctx, p, lease_id)\n  do return nil end\n"),),
    ),
    Mutant(
        "repeated_admission_of_an_expired_lease_admits",
        "a repeated admission of an expired lease answers ADMITTED instead of LEASE_EXPIRED",
        (("lib", "if score <= ctx.now then\n    return reply(ctx, 'LEASE_EXPIRED'",
          "if score < 0 then\n    return reply(ctx, 'LEASE_EXPIRED'"),),
    ),
    Mutant(
        "housekeeping_forgets_leases_at_once",
        "expired lease records are forgotten as soon as they expire, not a lease timeout later",
        (("lib", "drop_expired(p.leases_key, ctx.now - ctx.lease_timeout)", "drop_expired(p.leases_key, ctx.now)"),),
    ),
    Mutant(
        "old_pin_keeps_counting_after_repin",
        "after a compare-and-swap the old pin still counts against its provider's pin limit",
        (("cas_repin", "drop_pin(ctx, old, pin)", "redis.call('DEL', ctx.pin_key, ctx.session_leases_key)"),),
    ),
    Mutant(
        "old_pin_keeps_counting_after_repin_by_another_proxy",
        "a proxy that no longer routes the model to the pin's provider repins, and the old pin keeps counting there",
        (("cas_repin", "ctx.by_name[pin.provider] or {pins_key = KEYS[#KEYS]}", "ctx.by_name[pin.provider]"),),
    ),
    Mutant(
        "compare_and_swap_ignores_the_expected_pin",
        "a compare-and-swap with a stale expected pin moves the current pin",
        (("cas_repin", "if not pin or pin.id ~= expected_pin_id then", "if not pin then"),),
    ),
    Mutant(
        "compare_and_swap_onto_the_same_provider",
        "a compare-and-swap to the pin's own provider makes a new pin instead of ALREADY_PINNED",
        (("cas_repin", "if pin.provider == target.name then", "if false then"),),
    ),
    Mutant(
        "unpinned_admission_overwrites_a_live_pin",
        "an unpinned admission of a pinned session pins it again instead of ALREADY_PINNED",
        (("admit_unpinned", "if pin then\n  return reply(ctx, 'ALREADY_PINNED', pin)",
          "if false then\n  return reply(ctx, 'ALREADY_PINNED', pin)"),),
    ),
    Mutant(
        "per_session_limit_off_by_one",
        "a session may have one more request in flight than max_per_session",
        (("lib", "session_in_flight >= p.max_per_session", "session_in_flight > p.max_per_session"),),
    ),
    Mutant(
        "per_session_limit_counts_the_pair",
        "the per-session check counts every lease of the pair instead of the session's",
        (("admit_pinned", "return live_count(ctx.session_leases_key, ctx.now) + earlier_in_flight(ctx, p)",
          "return live_count(p.leases_key, ctx.now) + earlier_in_flight(ctx, p)"),),
    ),
    Mutant(
        "per_session_limit_forgets_earlier_pins",
        "a session repinned away and back while its requests run there is admitted on top of them (issue 10, item 8)",
        (("lib", "return live_count(ctx.session_leases_key, ctx.now) + earlier_in_flight(ctx, p)",
          "return live_count(ctx.session_leases_key, ctx.now)"),),
    ),
    Mutant(
        "repin_forgets_the_running_requests_of_the_old_pin",
        "a compare-and-swap drops the old pin's running requests from the session's count",
        (("cas_repin", "\nretire_session_leases(ctx, pin)\ndrop_pin", "\ndrop_pin"),),
    ),
    Mutant(
        "unlimited_pairs_limited",
        "a pair without limits is treated as having no in-flight slots",
        (("lib", "if p.max_global ~= NO_LIMIT then", "if true then"),),
    ),
    Mutant(
        "lease_keys_expire_without_grace",
        "the leases key's TTL leaves out the housekeeping grace",
        (("lib", "redis.call('ZADD', p.leases_key, deadline, lease_id)\n  extend_ttl(p.leases_key, ctx.lease_timeout + ctx.grace)",
          "redis.call('ZADD', p.leases_key, deadline, lease_id)\n  extend_ttl(p.leases_key, ctx.lease_timeout)"),),
    ),
    Mutant(
        "session_leases_key_without_ttl",
        "the session's lease set is left without a TTL",
        (("lib", "  redis.call('PEXPIRE', ctx.session_leases_key, ttl)  -- a no-op while the session holds no lease\n", ""),),
    ),
    Mutant(
        "renew_extends_any_pin_of_the_session",
        "renewing a lease of an old pin (or a temporary one) keeps the session's current pin alive",
        (("renew", "if lease_on_pin(ctx, p, pin, lease_id) then", "if pin then"),),
    ),
)
