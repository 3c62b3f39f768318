"""Stateful differential test: the routing state's Lua scripts (real Redis) against the reference
model (tests/model_based/model), with an explicit virtual clock.

Hypothesis drives every transition (admit unpinned, admit pinned, compare-and-swap and admit,
admit without pin, renew, release with and without refresh, read a pin, mark a provider degraded
and healthy, route a whole request with extproc.routing.Router) and a clock that jumps by small
and large steps across the lease and pin timeouts. After every step each answer equals the
model's, Redis holds what the model holds, and the invariants of issue #4 hold
(tests/model_based/harness.py). A fixed seed (derandomize) and enough examples hit every
result name and every routing outcome; the test asserts it.

The differential run goes once with the scripts over redis-py and once over the pipelined
hot-path client (config `redis.hot_path_client`, the model's constants packed). The mutation
check runs the same machine against each deliberately broken script of
tests/model_based/mutants and asserts that every one is caught.
"""

from __future__ import annotations

import itertools
import math
import time

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.errors import HypothesisException
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from extproc.config import parse_config
from extproc.routing.degraded import DegradedFlags
from extproc.routing.router import Router, RoutingRequest
from extproc.routing.state import QUEUE_RESULTS, Admission, CasResult, Pin, Result, RoutingState
from tests.model_based import harness as H
from tests.model_based.model import routing as R
from tests.model_based.model import state as S
from tests.model_based.mutants import MUTANTS, mutated_sources

T0 = 1_000_000_000_000  # virtual ms
LEASE_MS = 3_000
# Each run draws one (pin inactivity timeout, lease timeout) regime, in ms: a pin timeout just
# above the lease timeout (leases often outlive the pin's deadline), one below it (a pin's
# expiry is mostly its leases'), and a long one as in production (pins pile up: pin limits).
TIMINGS = ((4_000, LEASE_MS), (2_000, LEASE_MS), (30_000, LEASE_MS))
GRACE_S = 1_000_000  # key TTLs never run out in real time while the virtual clock says alive
DEGRADED_TTL_S = 100_000
EXAMPLES = 200  # the differential run (fixed seed: derandomize)
STEP_COUNT = 30  # steps per example: short runs, so Hypothesis' swarm (rules off per run) varies more
MUTANT_EXAMPLES = 400  # a mutant not caught within this many examples fails the check

CONFIGS = {  # timing -> (this proxy's configuration, the other proxy's)
    timing: (
        parse_config(H.config_data(*timing, grace_seconds=GRACE_S)),
        parse_config(H.config_data(*timing, grace_seconds=GRACE_S, other_proxy=True)),
    )
    for timing in TIMINGS
}
CONFIG = CONFIGS[TIMINGS[0]][0]  # providers and limits: the same in every regime
PAIRS = sorted((p.name, m) for p in CONFIG.providers for m in p.models)
MODELS = ["m", "m", "e"]
SESSIONS = ["s1", "s2", "s3"]
# Every operation happens a little (dt) after the previous one; the clock also jumps (STEPS:
# a fixed step, or a timeout of the run's regime plus -1, 0 or +1 ms).
DT = st.sampled_from([0, 0, 0, 500, 1000])  # coarse: deadlines often fall exactly on 'now'
STEPS = [("ms", 1), ("ms", 500), ("ms", 1000), ("lease", -1), ("lease", 0), ("lease", 1),
         ("pin", -1), ("pin", 0), ("pin", 1), ("pin", 2 * 30_000)]


class DifferentialMachine(RuleBasedStateMachine):
    """Set `io` (a Loop) before running; `sources` replaces script sources (mutation check);
    `client`: the routing scripts' client ("redis-py" or "pipelined")."""

    io: H.Loop = None
    sources: dict[str, str] | None = None
    client = "redis-py"
    runs = 0  # examples started (the mutation check reports how many it took)

    def __init__(self):
        super().__init__()
        type(self).runs += 1
        self.io.run(self.io.redis.flushall())
        self.started = time.monotonic()
        self.now = T0
        self.log: list[H.Entry] = []
        self.degraded: set[tuple[str, str]] = set()
        self.leases = []  # every real Lease handed out, for renew / release / replays
        self.pins: dict[tuple[str, str], list[Pin]] = {}  # every real pin seen, per (model, session)
        self.fresh = (f"L{i}" for i in itertools.count(1))
        self.owners: dict[tuple[str, str], str | None] = {}  # (model, lease id) -> session first using it

    @initialize(
        timing=st.sampled_from(TIMINGS),
        pairs=st.lists(st.sampled_from(PAIRS) | st.none(), min_size=len(SESSIONS), max_size=len(SESSIONS)),
        degraded=st.lists(st.sampled_from(PAIRS), max_size=2),
    )
    def start(self, timing, pairs, degraded):
        """Draw the run's timing regime, start with some sessions pinned and some pairs marked
        degraded (Hypothesis may disable any rule for a whole run: the other rules still find
        pins and flags to work with)."""
        self.pin_ms, self.lease_ms = timing
        config, other_config = CONFIGS[timing]
        self.config = config
        lease_ids = (f"R{i}" for i in itertools.count(1))
        hot_path = self.io.client(self.client)
        state = RoutingState(self.io.redis, config, sources=self.sources, hot_path=hot_path)
        other = RoutingState(self.io.redis, other_config, sources=self.sources, hot_path=hot_path)
        self.real = H.Recorder(state, self.log, clock=lambda: self.now, lease_ids=lease_ids)
        self.other = H.Recorder(other, self.log, clock=lambda: self.now, proxy="other", lease_ids=lease_ids)
        self.flags = DegradedFlags(self.io.redis, config)
        self.router = Router(config, self.real, self.flags)
        self.model = S.RoutingModel(config, self.pin_ms, self.lease_ms)
        self.checker = H.Checker(self.model, other_pairs=S.limits_from_config(other_config))
        for session, pair in zip(SESSIONS, pairs):
            if pair is not None:
                provider, model = pair
                self.call(self.real.try_admit_unpinned_session_request(provider, model, session, lease_id=next(self.fresh)))
        for pair in degraded:
            self.mark(pair, True)

    # ---- helpers ----

    def call(self, coro):
        """Run one real call and check it (and every call it made) against the model."""
        start = len(self.log)
        result = self.io.run(coro)
        for entry in self.log[start:]:
            self.checker.apply(entry)
            self.remember(entry)
        return result

    def remember(self, entry: H.Entry):
        """Keep the leases handed out (to renew, release and replay them) and the pins seen (to
        compare-and-swap from them, stale or not)."""
        result = entry.result.admission if isinstance(entry.result, CasResult) else entry.result
        pin = result if isinstance(result, Pin) else getattr(result, "pin", None)
        if pin is not None:
            self.pins.setdefault((entry.args["model"], entry.args["session"]), []).append(pin)
        if isinstance(result, Admission) and result.lease is not None:
            self.leases.append(result.lease)
        if entry.lease_id is not None:
            self.owners.setdefault((entry.args["model"], entry.lease_id), entry.args.get("session"))

    def lease_id(self, model: str, session: str | None, choice: int | None) -> str:
        """A fresh lease id, or (a repeated admission) one used before by the same model and
        session: lease ids are the client's, reused only when a request is retried."""
        if choice is not None:
            used = [lease_id for (m, lease_id), owner in self.owners.items() if m == model and owner == session]
            if used:
                return used[choice % len(used)]
        return next(self.fresh)

    def session(self, model: str, who: int) -> str:
        """Mostly (2 in 3) a session that has a pin, live or just dead, when there is one."""
        pinned = [pin.session for pin in self.model.pins if pin.model == model]
        if who % 3 and pinned:
            return pinned[who % len(pinned)]
        return SESSIONS[who % len(SESSIONS)]

    def pick_lease(self, index: int):
        """Mostly a live lease of a current pin (where renew and release matter most), else a
        live lease of a session (maybe of an old pin), any live lease, or any lease at all."""
        live, of_sessions, on_pins = [], [], []
        for lease in self.leases:
            record = self.model.find_lease(lease.model, lease.provider, lease.id)
            if record is None or record.deadline <= self.now:
                continue
            live.append(lease)
            if lease.session_id is not None:
                of_sessions.append(lease)
                pin = self.model.live_pin_at(record.model, record.session, self.now)
                if pin is not None and record.pin_id == pin.id:
                    on_pins.append(lease)
        kinds = (on_pins, on_pins, on_pins, of_sessions, live, self.leases)
        for candidates in kinds[index % len(kinds):] + kinds[:index % len(kinds)]:
            if candidates:
                return candidates[index % len(candidates)]
        raise AssertionError("no lease")

    # ---- rules ----

    @rule(step=st.sampled_from(STEPS))
    def advance_time(self, step):
        unit, amount = step
        self.now += {"ms": 0, "lease": self.lease_ms, "pin": self.pin_ms}[unit] + amount

    @precondition(lambda self: self.deadlines())
    @rule(index=st.integers(0, 20), offset=st.sampled_from([-1, 0, 1]))
    def advance_to_a_deadline(self, index, offset):
        """Go to just before, at or just after a lease's deadline or a pin's deadline or expiry:
        where strict and non-strict comparisons differ."""
        deadlines = self.deadlines()
        self.now = max(self.now, deadlines[index % len(deadlines)] + offset)

    def deadlines(self) -> list[int]:
        times = {lease.deadline for lease in self.model.leases}
        for pin in self.model.pins:
            times |= {pin.deadline, self.model.pin_expiry(pin)}
        return sorted(t for t in times if t >= self.now)

    @rule(dt=DT, model=st.sampled_from(MODELS), who=st.integers(0, 8))
    def get_pin(self, model, who, dt):
        self.now += dt
        session = self.session(model, who)
        self.call(self.real.get_pin(model, session))

    @rule(dt=DT, pair=st.sampled_from(PAIRS), session=st.sampled_from(SESSIONS), choice=st.none() | st.integers(0, 9))
    def admit_unpinned(self, pair, session, choice, dt):
        self.now += dt
        provider, model = pair
        lease_id = self.lease_id(model, session, choice)
        self.call(self.real.try_admit_unpinned_session_request(provider, model, session, lease_id=lease_id))

    @rule(dt=DT, model=st.sampled_from(MODELS), who=st.integers(0, 8), choice=st.none() | st.integers(0, 9),
          count=st.integers(1, 2))
    def admit_pinned(self, model, who, choice, count, dt):
        """One or two requests of a session (the second with a fresh lease id)."""
        self.now += dt
        session = self.session(model, who)
        for _ in range(count):
            lease_id = self.lease_id(model, session, choice)
            self.call(self.real.try_admit_pinned_session_request(model, session, lease_id=lease_id))
            choice = None

    @precondition(lambda self: self.model.live_pins_on_pair("m", "iris-2", self.now))
    @rule(dt=DT, index=st.integers(0, 9), choice=st.none() | st.integers(0, 9))
    def admit_pinned_via_other_proxy(self, index, choice, dt):
        """A proxy whose configuration no longer routes model m to iris-2, asked about a session
        pinned there (a moment ago: the pin may have died since)."""
        on_iris_2 = [pin.session for pin in self.model.live_pins_on_pair("m", "iris-2", self.now)]
        session = on_iris_2[index % len(on_iris_2)]
        self.now += dt
        lease_id = self.lease_id("m", session, choice)
        self.call(self.other.try_admit_pinned_session_request("m", session, lease_id=lease_id))

    @precondition(lambda self: self.model.live_pins_on_pair("m", "iris-2", self.now))
    @rule(dt=DT, index=st.integers(0, 9), to=st.sampled_from(["iris-1", "iris-3", "tensorx"]))
    def repin_via_other_proxy(self, index, to, dt):
        """That proxy moves a session pinned on iris-2 (as the Router does when the pin's
        provider no longer serves the model there): the old pin stops counting at once."""
        pins = self.model.live_pins_on_pair("m", "iris-2", self.now)
        pin = pins[index % len(pins)]
        expected = Pin(pin.provider, self.checker.pin_ids.to_real[pin.id], 0, 0)
        self.now += dt
        self.call(self.other.try_compare_and_swap_pin_and_admit_request(
            expected, "m", pin.session, to, lease_id=next(self.fresh)))

    @rule(dt=DT, pair=st.sampled_from(PAIRS), who=st.integers(0, 8), expected=st.integers(0, 9),
          choice=st.none() | st.integers(0, 9))
    def compare_and_swap(self, pair, who, expected, choice, dt):
        self.now += dt
        provider, model = pair
        session = self.session(model, who)
        current = self.model.live_pin_at(model, session, self.now)
        current_id = self.checker.pin_ids.to_real[current.id] if current else None
        seen = [pin for pin in self.pins.get((model, session), []) if pin.id != current_id]  # stale
        if expected <= 6 and current is not None:
            pin = self.model.view_pin(current)
            expected_pin = Pin(pin.provider, self.checker.pin_ids.to_real[pin.id], pin.deadline, pin.expiry)
        elif expected <= 8 and seen:
            expected_pin = seen[expected % len(seen)]
        else:
            expected_pin = Pin(provider, f"no-such-pin-{expected}", 0, 0)
        lease_id = self.lease_id(model, session, choice)
        self.call(self.real.try_compare_and_swap_pin_and_admit_request(
            expected_pin, model, session, provider, lease_id=lease_id))

    @rule(dt=DT, pair=st.sampled_from(PAIRS), choice=st.none() | st.integers(0, 9))
    def admit_without_pin(self, pair, choice, dt):
        self.now += dt
        provider, model = pair
        lease_id = self.lease_id(model, None, choice)
        self.call(self.real.try_admit_request_without_pin(provider, model, lease_id=lease_id))

    @rule(dt=DT, pair=st.sampled_from(PAIRS), count=st.integers(1, 3))
    def fill(self, pair, count, dt):
        """Several temporary requests on one pair at once, stopping at the first refusal: brings
        pairs to their limits (where off-by-one and reserved-slot mistakes show)."""
        self.now += dt
        provider, model = pair
        for _ in range(count):
            admission = self.call(self.real.try_admit_request_without_pin(provider, model, lease_id=next(self.fresh)))
            if admission.result is not Result.ADMITTED:
                break

    # Two request patterns that single steps reach only rarely, each step still checked.

    @rule(dt=DT, model=st.sampled_from(MODELS), who=st.integers(0, 8), refresh=st.booleans(),
          first_ends_first=st.booleans())
    def overlapping_requests(self, model, who, refresh, first_ends_first, dt):
        """Two requests of one session overlap: the second is admitted dt after the first, and
        one of them ends while the other is in flight (the pin must live as long as either)."""
        session = self.session(model, who)
        first = self.call(self.real.try_admit_pinned_session_request(model, session, lease_id=next(self.fresh)))
        self.now += dt
        second = self.call(self.real.try_admit_pinned_session_request(model, session, lease_id=next(self.fresh)))
        ending = first if first_ends_first else second
        if ending.lease is not None:
            self.now += dt
            self.call(self.real.release_request_lease(ending.lease, refresh))

    @rule(dt=DT, model=st.sampled_from(MODELS), who=st.integers(0, 8), to=st.integers(0, 3),
          refresh=st.booleans())
    def repin_under_a_live_request(self, model, who, to, refresh, dt):
        """A session's pin moves (compare-and-swap) while one of its requests is in flight on the
        old pin; that request is then renewed and ends (it must not touch the new pin)."""
        session = self.session(model, who)
        pin = self.model.live_pin_at(model, session, self.now)
        if pin is None:
            return
        in_flight = self.call(self.real.try_admit_pinned_session_request(model, session, lease_id=next(self.fresh)))
        providers = [p for p, m in PAIRS if m == model and p != pin.provider]
        expected = Pin(pin.provider, self.checker.pin_ids.to_real[pin.id], 0, 0)
        self.call(self.real.try_compare_and_swap_pin_and_admit_request(
            expected, model, session, providers[to % len(providers)], lease_id=next(self.fresh)))
        if in_flight.lease is not None:
            self.now += dt
            self.call(self.real.renew_request_lease(in_flight.lease))
            self.now += dt
            self.call(self.real.release_request_lease(in_flight.lease, refresh))

    @rule(dt=DT, model=st.sampled_from(MODELS), who=st.integers(0, 8), to=st.integers(0, 3),
          count=st.integers(0, 2), back=st.sampled_from(["cas", "new_pin"]))
    def repin_away_and_back_under_live_requests(self, model, who, to, count, back, dt):
        """Issue 10, item 8: requests run on the session's pin, the pin moves away, then back
        (a compare-and-swap; or the new pin dies and the session pins anew) and more requests of
        the session come: they count against the per-session limit on the pair together with the
        ones still running there."""
        session = self.session(model, who)
        pin = self.model.live_pin_at(model, session, self.now)
        if pin is None:
            return
        home = pin.provider
        for _ in range(count):
            self.call(self.real.try_admit_pinned_session_request(model, session, lease_id=next(self.fresh)))
        providers = [p for p, m in PAIRS if m == model and p != home]
        targets = (providers[to % len(providers)], home) if back == "cas" else (providers[to % len(providers)],)
        for target in targets:
            current = self.model.live_pin_at(model, session, self.now)
            if current is None:
                return
            self.now += dt
            expected = Pin(current.provider, self.checker.pin_ids.to_real[current.id], 0, 0)
            cas = self.call(self.real.try_compare_and_swap_pin_and_admit_request(
                expected, model, session, target, lease_id=next(self.fresh)))
        if back == "new_pin":
            if cas.admission.lease is None:
                return
            self.call(self.real.release_request_lease(cas.admission.lease, False))
            moved = self.model.current_pin(model, session)
            self.now = max(self.now, moved.deadline + 1)  # the pin away dies; the requests at home may run on
            for _ in range(2):
                self.call(self.real.try_admit_unpinned_session_request(home, model, session, lease_id=next(self.fresh)))
            return
        for _ in range(2):
            self.call(self.real.try_admit_pinned_session_request(model, session, lease_id=next(self.fresh)))

    @precondition(lambda self: self.leases)
    @rule(dt=DT, index=st.integers(0, 50))
    def renew(self, index, dt):
        self.now += dt
        self.call(self.real.renew_request_lease(self.pick_lease(index)))

    @precondition(lambda self: self.leases)
    @rule(dt=DT, index=st.integers(0, 50), refresh=st.booleans())
    def release(self, index, refresh, dt):
        self.now += dt
        self.call(self.real.release_request_lease(self.pick_lease(index), refresh))

    @rule(dt=DT, model=st.sampled_from(MODELS), who=st.integers(0, 8), index=st.none() | st.integers(0, 50),
          own_pin=st.booleans())
    def abandon(self, model, who, index, own_pin, dt):
        """A decision whose answer never arrived is abandoned (issue 10): its lease id (one handed
        out, live or not, or one never admitted) with the pin id minted for it (the session's live
        pin's, as if the decision had made it, or one never used)."""
        self.now += dt
        if index is not None and self.leases:
            lease = self.pick_lease(index)
            model, session, lease_id = lease.model, lease.session_id, lease.id
        else:
            session, lease_id = self.session(model, who), next(self.fresh)
        pin = self.model.live_pin_at(model, session, self.now) if session is not None else None
        pin_id = self.checker.pin_ids.to_real[pin.id] if own_pin and pin is not None else f"P-{next(self.fresh)}"
        self.call(self.real.abandon_request(model, session, lease_id, pin_id))

    @rule(pair=st.sampled_from(PAIRS), degraded=st.booleans())
    def mark(self, pair, degraded):
        """Mark a pair degraded or healthy (an unlimited provider's flag must change nothing)."""
        provider, model = pair
        if degraded:
            self.io.run(self.flags.set(provider, model, "test", ttl_seconds=DEGRADED_TTL_S))
            self.degraded.add((provider, model))
        else:
            self.io.run(self.flags.clear(provider, model))
            self.degraded.discard((provider, model))

    @rule(dt=DT, request=st.sampled_from(H.REQUESTS), session=st.none() | st.sampled_from(SESSIONS),
          count=st.integers(1, 3), flip=st.none() | st.sampled_from(PAIRS))
    def route(self, request, session, count, flip, dt):
        """One to three requests (still in flight: they end by the release rule) through the
        Router, each compared with the model's algorithm call by call; first, maybe, a pair's
        degraded flag flips (so that routing meets degraded providers often)."""
        if flip is not None:
            self.mark(flip, flip not in self.degraded)
        model, feature, subs = request
        real_request = RoutingRequest(model, feature, frozenset(subs), session)
        model_request = R.Request(model, feature, frozenset(subs), session)
        for _ in range(count):
            self.now += dt
            start = len(self.log)
            outcome = self.io.run(self.router.execute_request(real_request))
            entries = self.log[start:]
            for entry in entries:
                entry.task = "route"
            router = R.ModelRouter(self.config, set(self.degraded))
            self.checker.check_requests(entries, {"route": model_request}, {"route": outcome}, router)
            for entry in entries:
                self.remember(entry)

    # ---- after every step ----

    @invariant()
    def redis_matches_the_model(self):
        keys = H.parse_dump(self.io.run(self.io.redis.eval(H.DUMP_SCRIPT, 0)))
        elapsed = math.ceil((time.monotonic() - self.started) * 1000)
        bounds = H.Bounds(GRACE_S * 1000, self.pin_ms, self.lease_ms, DEGRADED_TTL_S * 1000, elapsed)
        H.check_redis(keys, self.checker, self.now, bounds, self.degraded)


@pytest.fixture(scope="module")
def io(redis_server):
    loop = H.Loop(f"redis://127.0.0.1:{redis_server.port}/0")
    yield loop
    loop.close()


def machine_settings(examples: int, steps: int, **kw) -> settings:
    return settings(
        max_examples=examples,
        stateful_step_count=steps,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        **kw,
    )


def machine_for(io: H.Loop, sources: dict[str, str] | None = None, client: str = "redis-py") -> type[DifferentialMachine]:
    return type("Machine", (DifferentialMachine,), {"io": io, "sources": sources, "client": client})


@pytest.mark.parametrize("client", ["redis-py", "pipelined"])
def test_scripts_match_the_model_and_every_result_name_is_hit(io, client):
    H.SEEN.clear()
    H.OUTCOMES.clear()
    run_state_machine_as_test(machine_for(io, client=client), settings=machine_settings(examples=EXAMPLES, steps=STEP_COUNT))
    missing = H.ALL_RESULT_NAMES - H.SEEN
    assert not missing, f"result names never seen: {sorted(missing)}"
    # The admission queue's answers never come while it is off, as it is here (docs/queue.md), nor
    # routing.third_party_share's (its result is tests/unit/routing/test_third_party_share.py's),
    # nor an endpoint move's, which needs a pick pair (tests/unit/routing/test_endpoint_pick.py).
    elsewhere = {Result.THIRD_PARTY_SHARE_REACHED.value, Result.MOVED.value}
    assert {r.value for r in Result if r not in QUEUE_RESULTS} - elsewhere <= H.SEEN
    assert set(H.OUTCOMES) == H.ALL_OUTCOMES, f"routing outcomes never seen: {sorted(H.ALL_OUTCOMES - set(H.OUTCOMES))}"


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda mutant: mutant.name)
def test_every_mutant_is_caught(io, mutant):
    """The same machine against a deliberately broken script must fail (tests/model_based/mutants)."""
    sources = mutated_sources(mutant)
    for source in sources.values():
        io.run(io.redis.script_load(source))  # still valid Lua: caught for its behaviour, not its syntax
    fast = machine_settings(examples=MUTANT_EXAMPLES, steps=STEP_COUNT, phases=[Phase.generate], report_multiple_bugs=False)
    machine = machine_for(io, sources)
    with pytest.raises(Exception) as caught:
        run_state_machine_as_test(machine, settings=fast)
    assert not isinstance(caught.value, (HypothesisException, pytest.fail.Exception)), caught.value
    print(f"mutant {mutant.name} caught in example {machine.runs}: {str(caught.value).splitlines()[0][:160]}")
