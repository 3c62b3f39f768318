"""Shared machinery of the differential tests: the real routing state (Redis) against the
reference model (tests/model_based/model).

- `Recorder` wraps an extproc.state.RoutingState: it gives every call a lease id and (with a
  virtual clock) an explicit time, serialises the calls (so the order Redis ran them in is the
  order of the log) and logs each call with its answer and the asyncio task that made it.
- `Checker` replays log entries into the model and compares every answer; it also runs the
  model's routing algorithm in step with the real Router's calls (one generator per task) and
  compares the decisions.
- `check_redis` compares what Redis holds with the model and checks the invariants of issue #4
  (limits, one pin per session, nothing outlives its timeout, every key has a TTL).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import re
from dataclasses import dataclass, field

from extproc.config import RedisSettings
from extproc.routing.router import Decision, Rejection
from extproc.routing.state import (
    Admission,
    CasResult,
    Lease,
    LeaseUpdate,
    Pin,
    RoutingState,
    connect,
)
from extproc.storage.pipelined import PipelinedRedis, open_pipelined
from tests.model_based.model import routing as R
from tests.model_based.model import state as S

# Every result name the differential test has seen (the coverage check reads it), and how often
# each operation got each answer (for tuning the rules' distribution).
SEEN: set[str] = set()
COUNTS: collections.Counter = collections.Counter()

ALL_RESULT_NAMES = frozenset(
    {
        S.ADMITTED, S.ALREADY_PINNED, S.SESSION_NOT_PINNED, S.PIN_LIMIT_REACHED,
        S.PER_SESSION_IN_FLIGHT_REQUEST_LIMIT_REACHED, S.GLOBAL_IN_FLIGHT_REQUEST_LIMIT_REACHED,
        S.UNRESERVED_IN_FLIGHT_REQUEST_LIMIT_REACHED, S.PROVIDER_NOT_CONFIGURED, S.PIN_MISMATCH,
        S.LEASE_EXPIRED, S.PINNED, S.NOT_PINNED, S.RENEWED, S.LEASE_LOST, S.RELEASED, S.NOT_FOUND,
        "pin_match:" + S.MATCHED, "pin_match:" + S.MISMATCHED,
    }
)


# Every routing outcome (a decision's reason, a rejection's kind) the differential tests have seen.
OUTCOMES: collections.Counter = collections.Counter()
# "capped_session": a request with a session routed without a pin because the cap on pairs
# without a pin limit refused it (issue 15; no other path leaves a session unpinned).
CAPPED_SESSION = "capped_session"
ALL_OUTCOMES = frozenset({R.PINNED, R.NEW_PIN, R.REPINNED, R.OFFLOADED, R.UNPINNED,
                          R.UNSUPPORTED, R.UNAVAILABLE, R.CAPACITY, CAPPED_SESSION})


class Mismatch(AssertionError):
    """The real routing state and the model disagree, or an invariant does not hold."""


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise Mismatch(message)


# ---- the test configuration and an event loop for synchronous state machines -------------

LIMITED = {"max_pinned_sessions": 2, "max_global_in_flight_request_slots": 3,
           "global_in_flight_request_slots_reserved_for_pinned_sessions": 1,
           "max_per_session_in_flight_request_slots": 2}


def config_data(pin_ms: int, lease_ms: int, *, grace_seconds: float, other_proxy: bool = False) -> dict:
    """Four providers (the unlimited one first in the file: priority puts it last): iris-1 with
    every limit, iris-2 with global/reserved/per-session but no pin limit, iris-3 managed without
    limits; model e on iris-1 with pin and global limits only (no reserved slots). Only iris-1
    serves completions (so they can be refused for capacity or unavailability), only iris-3 and
    the third party vision. The "other proxy" does not route model m to iris-2 (a configuration
    rolled out to one proxy before the other)."""
    iris_2 = {"m": {"features": ["chat"], "limits": {
        "max_global_in_flight_request_slots": 3,
        "global_in_flight_request_slots_reserved_for_pinned_sessions": 1,
        "max_per_session_in_flight_request_slots": 1}}}
    if other_proxy:
        iris_2 = {"z": {"features": ["chat"]}}
    return {
        "providers": [
            {"name": "tensorx", "kind": "unlimited", "cluster": "tensorx",
             "models": {"m": {"features": ["chat", "tools", "vision"]},
                        "e": {"features": ["chat", "embeddings"]}}},
            {"name": "iris-1", "kind": "managed", "cluster": "iris-1",
             "models": {"m": {"features": ["chat", "completions", "tools"], "limits": LIMITED},
                        "e": {"features": ["chat", "embeddings"], "limits": {
                            "max_pinned_sessions": 1, "max_global_in_flight_request_slots": 2}}}},
            {"name": "iris-2", "kind": "managed", "cluster": "iris-2", "models": iris_2},
            {"name": "iris-3", "kind": "managed", "cluster": "iris-3",
             "models": {"m": {"features": ["chat", "vision"]}}},
        ],
        "pin_inactivity_timeout_seconds": pin_ms / 1000,
        "lease_timeout_seconds": lease_ms / 1000,
        "max_routing_attempts": 4,
        # Pairs without a pin limit (tensorx, iris-2 and iris-3 on m, tensorx on e) hold at most
        # one live pin each (issue 15), so with three sessions the cap is reached and its
        # fallback exercised (a vision request with iris-3 and tensorx each holding a pin).
        "max_pinned_sessions_unlimited": 1,
        "redis": {"key_prefix": "d", "housekeeping_grace_seconds": grace_seconds},
    }


# Requests the routing rules send: (model, feature, sub-features).
REQUESTS = [
    ("m", "chat", ()), ("m", "chat", ()), ("m", "chat", ("tools",)), ("m", "chat", ("vision",)),
    ("m", "completions", ()), ("m", "completions", ()), ("m", "embeddings", ()),
    ("e", "embeddings", ()), ("e", "chat", ()),
]


class Loop:
    """One event loop and one Redis client for the whole module; the machine is synchronous.
    `hot_path`: a pipelined client on the same Redis (config `redis.hot_path_client`), for the
    machines whose routing scripts go over it."""

    def __init__(self, url: str):
        self.loop = asyncio.new_event_loop()
        self.redis = connect(url, timeout_seconds=10)
        self.hot_path = open_pipelined(RedisSettings(url=url), timeout_seconds=10)

    def client(self, kind: str) -> PipelinedRedis | None:
        """The routing scripts' client of `kind`: "pipelined", or None for "redis-py"."""
        return self.hot_path if kind == "pipelined" else None

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def close(self):
        self.run(self.hot_path.aclose())
        self.run(self.redis.aclose())
        self.loop.close()


# ---- recording the real calls -------------------------------------------------------------


@dataclass
class Entry:
    """One call to the real routing state and its answer. `now` is the time it ran at (ms):
    the explicit time, or the Redis time the answer reports (None for get_pin on Redis time)."""

    task: object
    op: str
    args: dict
    lease_id: str | None
    now: int | None
    result: object
    proxy: str = "main"


class Recorder:
    """Looks like a RoutingState to the Router; logs every call (see the module docstring)."""

    def __init__(self, state: RoutingState, log: list[Entry], *, clock=None, proxy: str = "main", lease_ids=None):
        self.state = state
        self.config = state.config
        self.keys = state.keys
        self.log = log
        self.clock = clock
        self.proxy = proxy
        self.lease_ids = lease_ids if lease_ids is not None else (f"L{i}" for i in itertools.count(1))
        self.lock = asyncio.Lock()

    def _now(self, now_ms):
        if now_ms is not None:
            return now_ms
        return self.clock() if self.clock else None

    async def _run(self, op, args, lease_id, now_ms, call):
        async with self.lock:
            result = await call()
            if isinstance(result, (Admission, LeaseUpdate)):
                now = result.now_ms
            elif isinstance(result, CasResult):
                now = result.admission.now_ms
            else:
                now = now_ms
            self.log.append(Entry(_task(), op, args, lease_id, now, result, self.proxy))
            return result

    async def get_pin(self, model, session_id, *, now_ms=None):
        now_ms = self._now(now_ms)
        return await self._run(
            "get_pin", {"model": model, "session": session_id}, None, now_ms,
            lambda: self.state.get_pin(model, session_id, now_ms=now_ms),
        )

    async def get_pin_and_try_admit(self, model, session_id, eligible, *, lease_id=None, pin_id=None, share=None, now_ms=None):
        """The fused first attempt, logged as the spec's two steps it stands for: get_pin, then
        the admission it tried (none when it tried none). It is atomic, so nothing of another
        caller can fall between the two entries."""
        assert share is None, "the model has no routing.third_party_share (tests/unit/routing/test_third_party_share.py)"
        now_ms, lease_id = self._now(now_ms), lease_id or next(self.lease_ids)
        async with self.lock:
            pin, admission = await self.state.get_pin_and_try_admit(
                model, session_id, eligible, lease_id=lease_id, pin_id=pin_id, now_ms=now_ms
            )
            now = admission.now_ms if admission is not None else now_ms
            self.log.append(Entry(_task(), "get_pin", {"model": model, "session": session_id}, None, now, pin, self.proxy))
            if admission is not None:
                if pin is not None:
                    op, args = "admit_pinned", {"model": model, "session": session_id}
                else:
                    op, args = "admit_unpinned", {"provider": eligible[0], "model": model, "session": session_id}
                self.log.append(Entry(_task(), op, args, lease_id, admission.now_ms, admission, self.proxy))
        return pin, admission

    async def try_admit_unpinned_session_request(self, provider, model, session_id, *, lease_id=None, pin_id=None, share=None, now_ms=None):
        assert share is None, "the model has no routing.third_party_share (tests/unit/routing/test_third_party_share.py)"
        now_ms, lease_id = self._now(now_ms), lease_id or next(self.lease_ids)
        return await self._run(
            "admit_unpinned", {"provider": provider, "model": model, "session": session_id}, lease_id, now_ms,
            lambda: self.state.try_admit_unpinned_session_request(
                provider, model, session_id, lease_id=lease_id, pin_id=pin_id, now_ms=now_ms
            ),
        )

    async def try_admit_pinned_session_request(self, model, session_id, *, lease_id=None, pin_id=None, share=None, now_ms=None):
        assert share is None, "the model has no routing.third_party_share (tests/unit/routing/test_third_party_share.py)"
        now_ms, lease_id = self._now(now_ms), lease_id or next(self.lease_ids)
        return await self._run(
            "admit_pinned", {"model": model, "session": session_id}, lease_id, now_ms,
            lambda: self.state.try_admit_pinned_session_request(model, session_id, lease_id=lease_id, now_ms=now_ms),
        )

    async def try_compare_and_swap_pin_and_admit_request(
        self, expected_pin, model, session_id, provider, *, lease_id=None, pin_id=None, share=None, now_ms=None
    ):
        assert share is None, "the model has no routing.third_party_share (tests/unit/routing/test_third_party_share.py)"
        now_ms, lease_id = self._now(now_ms), lease_id or next(self.lease_ids)
        args = {"expected_pin": expected_pin, "model": model, "session": session_id, "provider": provider}
        return await self._run(
            "cas", args, lease_id, now_ms,
            lambda: self.state.try_compare_and_swap_pin_and_admit_request(
                expected_pin, model, session_id, provider, lease_id=lease_id, pin_id=pin_id, now_ms=now_ms
            ),
        )

    async def try_admit_request_without_pin(self, provider, model, *, lease_id=None, pin_id=None, share=None, now_ms=None):
        assert share is None, "the model has no routing.third_party_share (tests/unit/routing/test_third_party_share.py)"
        now_ms, lease_id = self._now(now_ms), lease_id or next(self.lease_ids)
        return await self._run(
            "admit_without_pin", {"provider": provider, "model": model}, lease_id, now_ms,
            lambda: self.state.try_admit_request_without_pin(provider, model, lease_id=lease_id, now_ms=now_ms),
        )

    async def renew_request_lease(self, lease, *, now_ms=None):
        now_ms = self._now(now_ms)
        return await self._run(
            "renew", {"lease": lease}, None, now_ms, lambda: self.state.renew_request_lease(lease, now_ms=now_ms)
        )

    async def release_request_lease(self, lease, refresh_pin, *, now_ms=None):
        now_ms = self._now(now_ms)
        return await self._run(
            "release", {"lease": lease, "refresh": bool(refresh_pin)}, None, now_ms,
            lambda: self.state.release_request_lease(lease, refresh_pin, now_ms=now_ms),
        )

    async def abandon_request(self, model, session_id, lease_id, pin_id, *, now_ms=None):
        now_ms = self._now(now_ms)
        args = {"model": model, "session": session_id, "pin_id": pin_id}
        return await self._run(
            "abandon", args, lease_id, now_ms,
            lambda: self.state.abandon_request(model, session_id, lease_id, pin_id, now_ms=now_ms),
        )

    def has_configured_limits(self, provider, model):
        return self.state.has_configured_limits(provider, model)


def _name(result) -> str:
    if isinstance(result, CasResult):
        return result.admission.result.value
    if isinstance(result, (Admission, LeaseUpdate)):
        return result.result.value
    return "PINNED" if result else "NOT_PINNED"


def _task():
    try:
        return asyncio.current_task()
    except RuntimeError:
        return None


# ---- comparing with the model -------------------------------------------------------------


class PinIds:
    """The model names its pins itself; this maps each model pin id to the real one, one to
    one, so that a pin id the real state hands out twice is caught."""

    def __init__(self):
        self.to_real: dict[str, str] = {}
        self.to_model: dict[str, str] = {}

    def bind(self, model_id: str, real_id: str) -> None:
        if model_id in self.to_real:
            expect(self.to_real[model_id] == real_id, f"pin {model_id} is {self.to_real[model_id]}, got {real_id}")
            return
        expect(real_id not in self.to_model, f"pin id {real_id} handed out for two pins")
        self.to_real[model_id] = real_id
        self.to_model[real_id] = model_id

    def model_id(self, real_id: str) -> str:
        return self.to_model.get(real_id, real_id)


@dataclass
class Checker:
    model: S.RoutingModel
    other_pairs: dict | None = None  # the configuration of the "other" proxy, if any
    pin_ids: PinIds = field(default_factory=PinIds)
    last_now: int = 0
    seen: set = field(default_factory=lambda: SEEN)

    # -- one state call --

    def apply(self, entry: Entry):
        """Run the logged call on the model, compare the answers, return the model's."""
        # The model runs each call at the time the real one ran at. (With Redis TIME that is
        # the wall clock, so no monotonicity is asserted; get_pin does not report its time:
        # the latest known one serves, nothing expiring in between in those runs.)
        now = entry.now if entry.now is not None else self.last_now
        self.last_now = max(self.last_now, now)
        a, m = entry.args, self.model
        COUNTS[(entry.op, entry.proxy, _name(entry.result))] += 1
        where = f"{entry.op} {a} lease={entry.lease_id} now={now}"
        if entry.op == "get_pin":
            answer = m.get_pin(a["model"], a["session"], now)
            self.seen.add(S.PINNED if answer else S.NOT_PINNED)
            self.compare_pin(entry.result, answer, where)
            return answer
        if entry.op == "admit_unpinned":
            answer = m.try_admit_unpinned_session_request(a["provider"], a["model"], a["session"], entry.lease_id, now)
        elif entry.op == "admit_pinned":
            pairs = self.other_pairs if entry.proxy == "other" else None
            answer = m.try_admit_pinned_session_request(a["model"], a["session"], entry.lease_id, now, pairs)
        elif entry.op == "cas":
            expected = self.pin_ids.model_id(a["expected_pin"].id)
            answer = m.try_compare_and_swap_pin_and_admit_request(
                expected, a["model"], a["session"], a["provider"], entry.lease_id, now
            )
            expect(entry.result.pin_match.value == answer.pin_match,
                   f"{where}: pin_match {entry.result.pin_match.value}, model {answer.pin_match}")
            self.seen.add("pin_match:" + answer.pin_match)
            self.compare_admission(entry.result.admission, answer.admission, where)
            self.check_unreserved_share(entry, answer.admission, a["provider"], a["model"], now)
            return answer
        elif entry.op == "admit_without_pin":
            answer = m.try_admit_request_without_pin(a["provider"], a["model"], entry.lease_id, now)
        elif entry.op == "renew":
            lease = a["lease"]
            result, deadline = m.renew_request_lease(lease.model, lease.provider, lease.id, now)
            self.seen.add(result)
            expect(entry.result.result.value == result, f"{where}: {entry.result.result.value}, model {result}")
            expect(entry.result.deadline_ms == deadline, f"{where}: deadline {entry.result.deadline_ms}, model {deadline}")
            return result
        elif entry.op == "abandon":
            pin_id = self.pin_ids.model_id(a["pin_id"])
            result = m.abandon_request(a["model"], a["session"], entry.lease_id, pin_id, now)
            self.seen.add(result)
            expect(entry.result.result.value == result, f"{where}: {entry.result.result.value}, model {result}")
            return result
        elif entry.op == "release":
            lease = a["lease"]
            result = m.release_request_lease(lease.model, lease.provider, lease.id, a["refresh"], now)
            self.seen.add(result)
            expect(entry.result.result.value == result, f"{where}: {entry.result.result.value}, model {result}")
            return result
        else:
            raise AssertionError(entry.op)
        self.compare_admission(entry.result, answer, where)
        if entry.op == "admit_pinned":
            provider = answer.pin.provider if answer.pin else None
        else:
            provider = a["provider"]
        self.check_unreserved_share(entry, answer, provider, a["model"], now)
        return answer

    def compare_pin(self, real: Pin | None, model: S.Pin | None, where: str) -> None:
        if real is None or model is None:
            expect(real is None and model is None, f"{where}: pin {real}, model {model}")
            return
        self.pin_ids.bind(model.id, real.id)
        expect(
            (real.provider, real.deadline_ms, real.expiry_ms) == (model.provider, model.deadline, model.expiry),
            f"{where}: pin {real}, model {model}",
        )

    def compare_lease(self, real: Lease | None, model: S.Lease | None, where: str, replayed: bool) -> None:
        if real is None or model is None:
            expect(real is None and model is None, f"{where}: lease {real}, model {model}")
            return
        expect(
            (real.model, real.provider, real.id, real.deadline_ms)
            == (model.model, model.provider, model.id, model.deadline),
            f"{where}: lease {real}, model {model}",
        )
        if not replayed:
            # (A replayed answer describes the lease by its id; which pin it belongs to is the
            # routing state's business, checked through renew and release.)
            expect(real.session_id == model.session, f"{where}: lease session {real.session_id}, model {model.session}")
            expect(
                real.pin_id == (self.pin_ids.to_real.get(model.pin_id) if model.pin_id else None),
                f"{where}: lease pin {real.pin_id}, model {model.pin_id}",
            )

    def compare_admission(self, real: Admission, model: S.Admission, where: str) -> None:
        self.seen.add(model.result)
        expect(real.result.value == model.result, f"{where}: {real.result.value}, model {model.result}")
        self.compare_pin(real.pin, model.pin, where)
        self.compare_lease(real.lease, model.lease, where, model.replayed)

    def check_unreserved_share(self, entry: Entry, answer: S.Admission, provider, model_name, now) -> None:
        """A new, unpinned or temporary request never pushes a pair past its unreserved share."""
        if entry.op == "admit_pinned" or answer.result != S.ADMITTED or answer.replayed:
            return
        limits = self.model.pairs[(provider, model_name)]
        if limits is None or limits.max_global_in_flight_request_slots is None:
            return
        share = (
            limits.max_global_in_flight_request_slots
            - limits.global_in_flight_request_slots_reserved_for_pinned_sessions
        )
        in_flight = len(self.model.live_leases_on_pair(model_name, provider, now))
        expect(in_flight <= share, f"{entry.op} on {provider}/{model_name}: {in_flight} leases > share {share}")

    # -- whole requests --

    def check_requests(self, log: list[Entry], requests: dict, outcomes: dict, router: R.ModelRouter) -> None:
        """Replay `log` (the calls of the tasks in `requests`, in the order Redis ran them):
        each task's model algorithm must make the same calls, every answer must agree, and each
        task's decision must equal the model's."""
        steps, pending, decided = {}, {}, {}
        for task, request in requests.items():
            steps[task] = router.execute_request(request)
            try:
                pending[task] = next(steps[task])
            except StopIteration as done:
                decided[task] = done.value
        for entry in log:
            expect(entry.task in requests, f"a call from an unknown task: {entry.op} {entry.args}")
            expect(entry.task not in decided, f"the real router made a call the model would not: {entry.op} {entry.args}")
            self.compare_call(pending[entry.task], entry)
            answer = self.apply(entry)
            try:
                pending[entry.task] = steps[entry.task].send(answer)
            except StopIteration as done:
                decided[entry.task] = done.value
        for task, request in requests.items():
            expect(task in decided, f"{request}: the model would also call {pending.get(task)}")
            self.compare_outcome(outcomes[task], decided[task], f"{request}")
            OUTCOMES[decided[task].kind if isinstance(decided[task], R.Rejection) else decided[task].reason] += 1
            if isinstance(decided[task], R.Decision) and decided[task].reason == R.UNPINNED and request.session:
                OUTCOMES[CAPPED_SESSION] += 1

    def compare_call(self, op, entry: Entry) -> None:
        a = entry.args
        if isinstance(op, R.GetPin):
            same = entry.op == "get_pin" and (a["model"], a["session"]) == (op.model, op.session)
        elif isinstance(op, R.AdmitUnpinned):
            same = entry.op == "admit_unpinned" and (a["provider"], a["model"], a["session"]) == (
                op.provider, op.model, op.session)
        elif isinstance(op, R.AdmitPinned):
            same = entry.op == "admit_pinned" and (a["model"], a["session"]) == (op.model, op.session)
        elif isinstance(op, R.CompareAndSwap):
            same = entry.op == "cas" and (
                self.pin_ids.model_id(a["expected_pin"].id), a["model"], a["session"], a["provider"]
            ) == (op.expected_pin.id, op.model, op.session, op.provider)
        elif isinstance(op, R.AdmitWithoutPin):
            same = entry.op == "admit_without_pin" and (a["provider"], a["model"]) == (op.provider, op.model)
        elif isinstance(op, R.Release):
            lease = a.get("lease")
            same = entry.op == "release" and (lease.model, lease.provider, lease.id, a["refresh"]) == (
                op.lease.model, op.lease.provider, op.lease.id, op.refresh)
        else:
            raise AssertionError(op)
        expect(same, f"the real router called {entry.op} {a}, the model {op}")

    def compare_outcome(self, real, model, where: str) -> None:
        if isinstance(model, R.Rejection):
            expect(isinstance(real, Rejection) and real.kind.value == model.kind, f"{where}: {real}, model {model}")
            return
        expect(isinstance(real, Decision), f"{where}: {real}, model {model}")
        expect(
            (real.provider.name, real.reason.value, real.refresh_pin_on_success)
            == (model.provider, model.reason, model.refresh_pin_on_success),
            f"{where}: {real}, model {model}",
        )
        self.compare_pin(real.pin, model.pin, where)
        self.compare_lease(real.lease, model.lease, where, replayed=False)


# ---- what Redis holds ---------------------------------------------------------------------

# Test-only: every key with its type, PTTL and content, in one round trip (one JSON string:
# much cheaper to parse than nested replies).
DUMP_SCRIPT = """
local out = {}
for _, key in ipairs(redis.call('KEYS', '*')) do
  local kind = redis.call('TYPE', key).ok
  local content = {}
  if kind == 'zset' then
    content = redis.call('ZRANGE', key, 0, -1, 'WITHSCORES')
  elseif kind == 'hash' then
    content = redis.call('HGETALL', key)
  elseif kind == 'string' then
    content = {redis.call('GET', key)}
  end
  table.insert(out, {key, kind, redis.call('PTTL', key), content})
end
return cjson.encode(out)
"""

KEY = re.compile(r"^\{(?P<prefix>[^:}]+):(?P<model>[^}]+)\}:(?P<kind>pin|session-leases|session-earlier-leases|pins|leases|degraded):(?P<name>.*)$")


@dataclass
class Key:
    name: str
    model: str
    kind: str
    owner: str  # the session or the provider
    pttl: int
    content: dict  # zset: member -> score; hash: field -> value; string: {"value": v}


def parse_dump(raw) -> dict[tuple[str, str, str], Key]:
    keys = {}
    for name, kind, pttl, content in json.loads(raw) if raw not in (b"{}", "{}") else []:
        match = KEY.match(name)
        expect(match is not None, f"unexpected key {name}")
        items = list(content) if isinstance(content, list) else []  # cjson writes {} for an empty table
        if kind == "zset":
            parsed = {items[i]: int(float(items[i + 1])) for i in range(0, len(items), 2)}
        elif kind == "hash":
            parsed = {items[i]: items[i + 1] for i in range(0, len(items), 2)}
        else:
            parsed = {"value": items[0] if items else None}
        key = Key(name, match["model"], match["kind"], match["name"], int(pttl), parsed)
        keys[(key.model, key.kind, key.owner)] = key
    return keys



@dataclass
class Bounds:
    """Time bounds for the key TTL checks, all in ms. A key's TTL is set in real time when the
    key is written, to its content's remaining (virtual) life plus the housekeeping grace; so
    PTTL + (real time since the key could have been written) >= remaining life + grace."""

    grace: int
    pin_timeout: int
    lease_timeout: int
    degraded_ttl: int
    elapsed: int  # real ms since the run began (no key is older), rounded up


def check_redis(keys: dict[tuple[str, str, str], Key], checker: Checker, now: int, bounds: Bounds,
                degraded: set[tuple[str, str]]) -> None:
    """Compare Redis with the model at `now` and check the invariants. Lease records Redis's
    housekeeping dropped are forgotten by the model too (only allowed once forgettable)."""
    model = checker.model
    longest = max(bounds.pin_timeout, bounds.lease_timeout)

    # Every key has a TTL, none longer than its kind allows, none shorter than its content lives.
    for key in keys.values():
        expect(key.pttl > 0, f"{key.name} has no TTL ({key.pttl})")
        limit = bounds.degraded_ttl if key.kind == "degraded" else longest + bounds.grace
        expect(key.pttl <= limit, f"{key.name}: TTL {key.pttl} ms > {limit} ms")
        if key.kind == "pin":
            lives_until = int(key.content.get("expiry", 0))
        elif key.kind == "degraded":
            lives_until = 0
        else:
            lives_until = max(key.content.values(), default=0)
        if lives_until > now:
            need = lives_until - now + bounds.grace
            expect(key.pttl + bounds.elapsed + 2 >= need, f"{key.name}: TTL {key.pttl} ms < {need} ms - elapsed")

    # Housekeeping: a record the model has and Redis dropped must have been forgettable.
    for lease in list(model.leases):
        zset = keys.get((lease.model, "leases", lease.provider))
        if zset is None or lease.id not in zset.content:
            model.forget(lease.model, lease.provider, lease.id, now)

    for (provider, model_name), limits in model.pairs.items():
        where = f"{provider}/{model_name} at {now}"
        leases = keys.get((model_name, "leases", provider))
        recorded = leases.content if leases else {}
        for lease_id, deadline in recorded.items():
            record = model.find_lease(model_name, provider, lease_id)
            expect(record is not None, f"{where}: Redis records lease {lease_id}, the model does not")
            expect(record.deadline == deadline, f"{where}: lease {lease_id} deadline {deadline}, model {record.deadline}")
        live = {i: d for i, d in recorded.items() if d > now}
        expect(
            live == {lease.id: lease.deadline for lease in model.live_leases_on_pair(model_name, provider, now)},
            f"{where}: live leases {live}, model {model.live_leases_on_pair(model_name, provider, now)}",
        )
        for lease_id, deadline in live.items():
            expect(deadline <= now + bounds.lease_timeout, f"{where}: lease {lease_id} outlives its timeout")
        pins = keys.get((model_name, "pins", provider))
        live_pins = {checker.pin_ids.model_id(i): e for i, e in (pins.content if pins else {}).items() if e > now}
        model_pins = {pin.id: model.pin_expiry(pin) for pin in model.live_pins_on_pair(model_name, provider, now)}
        expect(live_pins == model_pins, f"{where}: live pins {live_pins}, model {model_pins}")
        if limits is not None:
            if limits.max_global_in_flight_request_slots is not None:
                expect(len(live) <= limits.max_global_in_flight_request_slots, f"{where}: {len(live)} leases")
            if limits.max_pinned_sessions is not None:
                expect(len(live_pins) <= limits.max_pinned_sessions, f"{where}: {len(live_pins)} pins")
        cap = model.pin_caps[(provider, model_name)]
        if cap is not None:
            expect(len(live_pins) <= cap, f"{where}: {len(live_pins)} pins over the cap {cap}")

    sessions = {(pin.model, pin.session) for pin in model.pins}
    sessions |= {(m, owner) for (m, kind, owner) in keys if kind in ("pin", "session-leases", "session-earlier-leases")}
    sessions |= {(lease.model, lease.session) for lease in model.leases if lease.session is not None}
    for model_name, session in sorted(sessions):
        where = f"session {session}/{model_name} at {now}"
        pin = model.live_pin_at(model_name, session, now)
        stored = keys.get((model_name, "pin", session))
        if pin is None:
            expect(stored is None or int(stored.content["expiry"]) <= now, f"{where}: Redis has a live pin {stored}")
        else:
            expect(stored is not None, f"{where}: Redis has no pin, model {pin}")
            fields = stored.content
            expect(
                (fields["provider"], checker.pin_ids.model_id(fields["id"]), int(fields["deadline"]),
                 int(fields["expiry"])) == (pin.provider, pin.id, pin.deadline, model.pin_expiry(pin)),
                f"{where}: pin {fields}, model {pin} expiry {model.pin_expiry(pin)}",
            )
            expect(pin.deadline <= now + bounds.pin_timeout, f"{where}: pin deadline beyond its timeout")
            expect(
                model.pin_expiry(pin) <= max(pin.deadline, now + bounds.lease_timeout),
                f"{where}: pin expiry beyond its deadline and every lease",
            )
        session_leases = keys.get((model_name, "session-leases", session))
        live = {i: d for i, d in (session_leases.content if session_leases else {}).items() if d > now}
        expected = {lease.id: lease.deadline for lease in model.live_leases_on_pin(pin, now)} if pin else {}
        expect(live == expected, f"{where}: session leases {live}, model {expected}")
        # The session's leases still running from its earlier pins (issue 10, item 8).
        earlier = keys.get((model_name, "session-earlier-leases", session))
        live_earlier = {i: d for i, d in (earlier.content if earlier else {}).items() if d > now}
        expected_earlier = {
            f"{lease.provider}/{lease.id}": lease.deadline
            for lease in model.leases
            if lease.model == model_name and lease.session == session and lease.deadline > now
            and (pin is None or lease.pin_id != pin.id)
        }
        expect(live_earlier == expected_earlier, f"{where}: earlier leases {live_earlier}, model {expected_earlier}")
        if pin is not None:
            limits = model.pairs.get((pin.provider, model_name))
            if limits is not None and limits.max_per_session_in_flight_request_slots is not None:
                expect(len(live) <= limits.max_per_session_in_flight_request_slots, f"{where}: {len(live)} leases")

    # A session has at most one live pin: every live entry of a provider's pin set is the live
    # pin of some session, as its pin hash (one per session) records it, on that provider.
    pinned_by = {
        (m, key.content["id"]): key.content["provider"]
        for (m, kind, _), key in keys.items()
        if kind == "pin" and int(key.content["expiry"]) > now
    }
    for (m, kind, provider), key in keys.items():
        if kind == "pins":
            for pin_id, expiry in key.content.items():
                if expiry > now:
                    expect(pinned_by.get((m, pin_id)) == provider, f"{key.name}: {pin_id} is no session's live pin")

    flagged = {(owner.rsplit(":", 1)[0], m) for (m, kind, owner) in keys if kind == "degraded"}  # name: provider:source
    expect(flagged == degraded, f"degraded flags {flagged}, expected {degraded}")
