"""The one owner, per process, of every running request's lease: shared (Redis) or local (outage).

A decision goes through the table (`decide`): the table mints the lease and pin ids before any
call reaches Redis and records the decision as possibly admitted until its answer arrives. When
the answer never arrives (the client hung up, the decision timed out, Redis failed), an
abandonment of those ids (lua/abandon.lua) is queued to a worker of the table, out of reach of
the request's cancellation, and retried until Redis takes it; an id never admitted answers
NOT_FOUND. A decided request is held (`Held`) until the stream loop hands back its end (`end`):
the table renews the lease every `lease_timeout_seconds / 3` (between a sixth and a third of it,
in one sweep per table that renews every lease due in one script call per model), releases it
(refreshing the pin only after a 2xx on a pinned provider, the spec's execute_with_request_lease;
the releases of one loop turn in one script call per model), and reports it lost (`Held.lost`)
only when Redis saw it expire. docs/routing-state.md "Renewals and releases in batches". On a
pick pair, a lease whose request Envoy's retry served on another endpoint moves there
(`answered_by`: in memory, and in Redis by lua/move_endpoint_lease.lua).

What a running request is promised (docs/routing-state.md "When Redis is gone"):
- a renewal that cannot reach Redis keeps the request running; the lease is renewed or adopted
  (lua/adopt.lua) when Redis answers again;
- a renewal that finds the lease missing because Redis lost its state (restart without
  persistence, flush, failover: the epoch key `{prefix}:epoch`, written when the state is first
  used, changed or vanished since the lease was admitted) adopts it without a capacity check;
  and when this process sees the epoch change, it adopts every lease it holds at once;
- a lease that expired in Redis under the same epoch (this process frozen or Redis stalled past
  the lease timeout, Redis's clock stepped forward) had its slot free to others meanwhile: it
  comes back only through an adoption within the pair's limits, and is otherwise lost: its
  request is cancelled (issue 29, item 0);
- a renewal is judged by the lease's state when it was sent: an adoption recorded or under way
  since then decides the lease, not the renewal's answer (issue 29, item 1).

Every decision learns the epoch with its admission and abandons what it admitted when the epoch
changed, so nothing admitted on a Redis that lost its state is kept. Where Redis has no hash slots
(standalone, Sentinel: RoutingState.epoch_in_script) the admission scripts read it themselves,
atomically with what they admit (extproc.routing.state.watching_epoch): a decision whose scripts
all saw the epoch this process knows reads nothing more. Otherwise (a Redis Cluster, whose epoch
key is in another slot; no epoch known yet; a script that saw another epoch or none; a decision
that ran no script) it awaits the shared read `refresh_epoch` (one read in flight per process,
shared by the decisions waiting on it; sent with the admission, not before it, where the scripts
cannot read the epoch). After a new epoch (written with its creation time, Redis
time in ms), managed pairs take no new admission until `redis.epoch_grace` seconds after that
time, nor while this process adopts after an epoch change: every other instance sees the new
epoch within a heartbeat or a probe and adopts its running leases meanwhile, and only then may
admissions count against them. During the grace decisions follow the outage policy without
local shares (unlimited pairs only; `fail_closed`: 503).

During an outage (the breaker open for the request's model, or for the fleet) the outage policy
(extproc.routing.outage) chooses a provider and the table holds a local lease for a pair with an
in-flight limit. The breaker counts failures per model (its keys' hash tag: one Cluster slot), so
a shard that is down, or a slot being moved, costs only its models: the leases of every other
model keep renewing, and their decisions keep going to Redis. `recover` (called by the probe
while a scope is open) brings back the fleet's scope (the epoch), then each model on its own:
it adopts every lease of the model held (the local ones without a capacity check, the Redis
ones that expired meanwhile within their pair's limits, as above), closes the model's scope so new decisions go to Redis,
then adopts again until nothing local of it is left; a model Redis does not serve yet stays open
and holds up no other. `drain` releases everything still held.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import math
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from redis.exceptions import ResponseError

from extproc import metrics
from extproc.config import Config
from extproc.routing.outage import OutagePolicy, RedisBreaker
from extproc.routing.router import Decision, Ids, Reason, Rejection, Router, RoutingRequest
from extproc.routing.state import MAX_LEASES_PER_CALL, EpochSeen, Lease, LeaseUpdate, Result, RoutingState, new_id, watching_epoch
from extproc.storage.client import REDIS_FAILURES, in_own_task, is_pool_exhausted, redis_time_ms
from extproc.storage.keys import Keyspace
from extproc.supervision import run_every

log = logging.getLogger(__name__)


class Refusal(str, enum.Enum):
    """Why the table decided nothing: Redis is unreachable under `fail_closed` (503
    routing_unavailable), or every Redis connection of this process is busy (429
    routing_overloaded: load, not an outage)."""

    UNAVAILABLE = "routing_unavailable"
    OVERLOADED = "routing_overloaded"


@dataclass(eq=False)
class Held:
    """One running request's decision as the table holds it. `lost` is set when its lease is
    lost, and `on_lost` (the stream loop's, which then cancels the request) called once.
    `local`: the lease lives in this process only (granted during an outage, not yet adopted)."""

    decision: Decision
    local: bool
    epoch: str | None
    state: RoutingState | None = None  # the config's it was admitted under (extproc.operations.reload); None: the table's
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    on_lost: Callable[[], None] | None = None
    unconfirmed: bool = False  # a renewal failed since the last one Redis answered
    ended: bool = False
    adopting: bool = False
    renew_at: float = math.inf  # monotonic s when its next renewal is due (the renewal sweep's)
    renewing: bool = False  # a renewal call of the sweep carries it now
    confirmed_at: float = field(default_factory=time.monotonic)  # monotonic s of the last renewal answered
    adoptions: int = 0  # adoptions recorded in Redis: a renewal sent before the latest says nothing of the lease
    maybe_recorded: bool = False  # local, and an adoption failed unanswered (a timeout, a lost connection): it may land

    @property
    def lease(self) -> Lease | None:
        return self.decision.lease

    def mark_lost(self) -> None:
        """Redis saw the lease expire: set `lost` and tell the stream loop."""
        self.lost.set()
        if self.on_lost is not None:
            self.on_lost()


@dataclass(frozen=True, slots=True)
class _RenewalSent:
    """A lease's state when its renewal was sent: its adoptions recorded so far, and `at`
    (monotonic s) the send time."""

    adoptions: int
    at: float


@dataclass(frozen=True, slots=True)
class _Abandoned:
    model: str
    session_id: str | None
    ids: Ids
    state: RoutingState
    give_up_at: float  # monotonic s: by then a lease it could have admitted has expired by itself


class LeaseTable:
    """See the module docstring. One per process; `start()` inside the event loop."""

    retry_seconds = 0.5
    abandon_workers = 4  # abandonments served at once: one dead shard does not hold up the others

    def __init__(self, config: Config, state: RoutingState, router: Router, outage: OutagePolicy, breaker: RedisBreaker):
        self.config = config
        self.state = state
        self.router = router
        self.outage = outage
        self.breaker = breaker
        self.epoch: str | None = None  # the routing state's epoch last read
        self._epoch_key = Keyspace(config.redis.key_prefix).epoch()
        self._epoch_read: asyncio.Task | None = None  # the epoch read decisions wait on
        self._grace_until = 0.0  # monotonic s: managed pairs take no new admission before
        self._held: set[Held] = set()
        self._on_pair: Counter[tuple[str, str]] = Counter()
        self._abandoned: asyncio.Queue[_Abandoned] | None = None
        self._abandoning = 0
        self._workers: list[asyncio.Task] = []
        self._adoption_wanted: asyncio.Event | None = None  # set when the epoch changed: the adoption worker runs
        self._adoption_pending = False  # leases admitted under an earlier epoch are not all adopted yet
        self._release_batcher = _ReleaseBatcher(self.retry_seconds)
        self._sweep_timer: asyncio.TimerHandle | None = None
        self._sweeps: set[asyncio.Task] = set()  # renewal calls under way

    def reconfigure(self, config: Config, state: RoutingState, router: Router) -> None:
        """Decide with a reloaded config from now on (extproc.operations.reload). Every lease held keeps
        renewing, adopting and releasing through the RoutingState it was admitted with, so its
        pair's accounting holds even when the reload removed its provider or model."""
        self.config, self.state, self.router = config, state, router

    def start(self) -> None:
        """Start the abandonment and adoption workers (needs a running event loop)."""
        self._abandoned = asyncio.Queue()
        self._adoption_wanted = asyncio.Event()
        loop = asyncio.get_running_loop()
        # Supervised (extproc.supervision): an unexpected exception restarts a worker.
        self._workers = [loop.create_task(run_every("lease_abandon", self._abandon_one, 0)) for _ in range(self.abandon_workers)]
        self._workers.append(loop.create_task(run_every("lease_adoption", self._adopt_into_new_epoch, 0)))

    # ---- questions ----------------------------------------------------------------------

    def held_on_pair(self, provider: str, model: str) -> int:
        """Leases this process holds on the pair, admitted by Redis or local."""
        return self._on_pair[(provider, model)]

    @property
    def local_leases(self) -> int:
        """Leases held in this process only (granted during an outage, not yet adopted)."""
        return sum(1 for held in self._held if held.local)

    @property
    def rebuilding(self) -> bool:
        """Whether Redis lost its state recently enough that managed pairs take no new admission
        (the epoch grace, or this process's adoption after an epoch change under way)."""
        return self._adoption_pending or time.monotonic() < self._grace_until

    @property
    def pending_abandonments(self) -> int:
        """Abandonments queued or under way."""
        return self._abandoning

    # ---- deciding -----------------------------------------------------------------------

    async def decide(
        self, request: RoutingRequest, router: Router | None = None, state: RoutingState | None = None
    ) -> Held | Rejection | Refusal:
        """Decide through Redis (within `server.decision_timeout_seconds`, plus the request's
        `max_wait_ms` when it may wait in the admission queue), or through the outage policy while
        the breaker is open for its model (or the fleet) or when this decision's Redis calls
        failed. A decision cancelled while its request waits in the queue is abandoned like any
        other: its ticket goes with its ids.
        `router` and `state` (default: the table's) are one config's pair (extproc.operations.reload).
        Raises asyncio.CancelledError when the stream is cancelled (its ids are abandoned)."""
        router, state = router or self.router, state or self.state
        if self.breaker.open_for(request.model):
            return self._decide_locally(request, state)
        if self.rebuilding:
            return self._decide_locally(request, state, shares=False)
        ids = Ids.fresh()
        admission = None
        seen = EpochSeen()
        scope: str | None = request.model  # whose failure it is: the model's keys, or the epoch's (None)
        # A request that may wait in the admission queue (docs/queue.md) has its wait on top.
        timeout = self.config.server.decision_timeout_seconds + router.queue_wait_seconds(request)
        try:
            async with asyncio.timeout(timeout):
                # The scripts read the epoch themselves where they can (module docstring); else
                # the shared read goes out with the admission.
                in_script = state.epoch_in_script and self.epoch is not None
                epoch_read = None if in_script else self._epoch_read_shared()
                # A task of its own (storage.client.in_own_task): the timeout or a cancellation
                # reaches this decision at once on every Python, and the admission lands or fails
                # before its abandonment is sent.
                admission = watching_epoch(router.execute_request(request, ids), seen)
                outcome = await in_own_task(admission)
                if epoch_read is None and not seen.only(self.epoch):
                    epoch_read = self._epoch_read_shared()  # Redis lost its state, or nothing was read
                if epoch_read is not None:
                    scope = None
                    await self._epoch_read_after(epoch_read)
            if self.rebuilding:  # Redis lost its state: what was admitted may count on nothing
                self._abandon(request, ids, state)
                return self._decide_locally(request, state, shares=False)
        except (*REDIS_FAILURES, TimeoutError) as exc:
            # Even a decision that found the pool exhausted: an earlier call of it may have admitted
            # (a pinned admission that met a changed pin, then could not release). An id never
            # admitted answers NOT_FOUND.
            router.wakeups.abandon(ids.lease_id)  # a wait in the admission queue ends now: its ticket goes
            self._abandon(request, ids, state, admission)
            if is_pool_exhausted(exc):
                return Refusal.OVERLOADED
            metrics.child(metrics.REDIS_ERRORS, "decision").inc()
            self.breaker.record_failure(exc, scope)
            return self._decide_locally(request, state)
        except BaseException:
            router.wakeups.abandon(ids.lease_id)  # a wait in the admission queue ends now: its ticket goes
            self._abandon(request, ids, state, admission)
            raise
        self.breaker.record_success(request.model)
        if isinstance(outcome, Rejection):
            return outcome
        return self._hold(outcome, local=False, state=state)

    def _decide_locally(self, request: RoutingRequest, state: RoutingState, shares: bool = True) -> Held | Rejection | Refusal:
        """The outage policy's decision; `shares=False` (the epoch grace): no local share."""
        if self.config.redis.outage_policy == "fail_closed":
            return Refusal.UNAVAILABLE
        metrics.OUTAGE_DECISIONS.inc()
        choice = self.outage.choose(request, self.held_on_pair, shares=shares)
        if isinstance(choice, Rejection):
            return choice
        limits = choice.limits(request.model)
        lease = None
        if limits is not None and limits.max_global_in_flight_request_slots is not None:
            lease = Lease(request.model, choice.name, new_id(), None, None, 0)
        decision = Decision(choice, Reason.UNPINNED, lease, None, refresh_pin_on_success=False)
        return self._hold(decision, local=lease is not None, state=state)

    def _hold(self, decision: Decision, local: bool, state: RoutingState) -> Held:
        held = Held(decision, local=local, epoch=self.epoch, state=state)
        self._held.add(held)
        if decision.lease is not None:
            self._on_pair[(decision.lease.provider, decision.lease.model)] += 1
            held.renew_at = time.monotonic() + self._lease_timeout(held) / 3
            self._sweep_at(held.renew_at)
        return held

    def _lease_timeout(self, held: Held) -> float:
        """The lease timeout (seconds) of the config `held` was admitted under: its renewals
        extend it by that much, so they come every third of it, whatever a reload did since."""
        return (held.state or self.state).config.lease_timeout_seconds

    # ---- serving ------------------------------------------------------------------------

    async def answered_by(self, held: Held, endpoint: str) -> None:
        """Affinity pick: `endpoint` (`ip:port`, Envoy's `upstream.address`) answered `held`'s
        request, placed on another endpoint of the pair (the route's retry policy retried a
        refused connection on the pick's next endpoint). The lease counts on `endpoint` from now
        on: in memory at once (`held.decision.lease.endpoint`, which the chain record, the
        `x-iris-endpoint` answer and an adoption read), and in Redis by one more script call
        (lua/move_endpoint_lease.lua; renewals and the release find it there), skipped for a
        lease Redis does not hold (local, ended) or while the model's breaker is open (the
        recovery's adoption counts it on `endpoint`). A Redis failure is logged and counted by the
        breaker: the lease keeps counting on the endpoint it was placed on until it ends. Never
        raises but a cancellation."""
        lease = held.lease
        if lease is None or lease.endpoint is None or lease.endpoint == endpoint:
            return
        others = tuple(e for e in lease.endpoints if e != endpoint)
        held.decision = dataclasses.replace(held.decision, lease=dataclasses.replace(lease, endpoints=(endpoint, *others)))
        if held.local or held.ended or self.breaker.open_for(lease.model):
            return
        try:
            await (held.state or self.state).move_endpoint_lease(lease, endpoint)
        except REDIS_FAILURES as exc:
            metrics.child(metrics.REDIS_ERRORS, "move_endpoint_lease").inc()
            self.breaker.record_failure(exc, lease.model)
            log.warning("lease %s still counts on %s, not on %s that answered (redis): %s", lease.id, lease.endpoint, endpoint, exc)
        except Exception:  # noqa: BLE001 (a count on the wrong endpoint must not fail the answer)
            log.exception("lease %s still counts on %s, not on %s that answered", lease.id, lease.endpoint, endpoint)
        else:
            self.breaker.record_success(lease.model)

    # ---- ending -------------------------------------------------------------------------

    def end(self, held: Held, succeeded: bool) -> None:
        """The request's stream ended (any way). Stops renewal and releases the lease in the
        background (refreshing the pin when the decision asks for it and `succeeded`).
        Idempotent; never raises."""
        if held.ended:
            return
        held.ended = True
        self._forget(held)
        if held.lost.is_set():
            metrics.LEASES_LOST.inc()
        if held.lease is None or held.adopting:
            return  # adopting: the adoption in flight releases it once it is recorded
        if held.local and not held.maybe_recorded:
            return  # Redis never recorded it
        # A local lease whose adoption failed unanswered may have landed since, or land later:
        # released all the same (releasing an id Redis never recorded changes nothing).
        refresh = not held.local and held.decision.refresh_pin_on_success and succeeded and not held.lost.is_set()
        self._spawn_release(held, refresh)

    def _forget(self, held: Held) -> None:
        if held in self._held:
            self._held.discard(held)
            if held.lease is not None:
                self._on_pair[(held.lease.provider, held.lease.model)] -= 1

    def _spawn_release(self, held: Held, refresh: bool) -> None:
        """Release in Redis, retried while the lease may still count there (_ReleaseBatcher):
        the releases asked in one loop turn go out together, one script call per model."""
        give_up_at = max(held.confirmed_at, time.monotonic()) + self._lease_timeout(held)
        self._release_batcher.submit(held.state or self.state, held.lease, refresh, give_up_at)

    @property
    def pending_releases(self) -> int:
        """Releases asked and not yet answered by Redis nor given up."""
        return self._release_batcher.unsettled

    async def releases_settled(self) -> None:
        """Return once every release asked so far is answered by Redis or given up."""
        await self._release_batcher.settled()

    # ---- abandoning ---------------------------------------------------------------------

    def _abandon(self, request: RoutingRequest, ids: Ids, state: RoutingState, admission: asyncio.Future | None = None) -> None:
        """Queue the abandonment of `ids`; `admission`: the admission task, which may still be on
        its way (a timeout or a cancellation does not stop it: it runs in a task of its own): the
        abandonment is queued once it has landed or failed."""
        metrics.DECISIONS_ABANDONED.inc()
        if self._abandoned is None:
            return
        self._abandoning += 1
        give_up_at = time.monotonic() + state.config.lease_timeout_seconds
        item = _Abandoned(request.model, request.session_id, ids, state, give_up_at)
        if admission is not None and not admission.done():
            admission.add_done_callback(lambda done: (done.cancelled() or done.exception(), self._abandoned.put_nowait(item)))
        else:
            if admission is not None:
                admission.cancelled() or admission.exception()
            self._abandoned.put_nowait(item)

    async def _abandon_one(self) -> None:
        """The next abandonment. One that Redis does not take goes back to the queue after
        `retry_seconds` (they are idempotent), so a dead shard holds up no worker, until a lease
        it could have admitted has expired by itself: past that, abandoning could end a pin the
        session has made since, and it is given up. One that raises anything else is dropped (its
        records expire by themselves) and the worker goes on with the next (extproc.supervision
        counts and logs it)."""
        item = await self._abandoned.get()
        try:
            await item.state.abandon_request(item.model, item.session_id, item.ids.lease_id, item.ids.pin_id)
        except REDIS_FAILURES:
            if time.monotonic() + self.retry_seconds < item.give_up_at:
                asyncio.get_running_loop().call_later(self.retry_seconds, self._abandoned.put_nowait, item)
                return
            log.warning("abandonment of lease %s given up: whatever it admitted has expired by itself", item.ids.lease_id)
        except BaseException:
            self._abandoning -= 1
            raise
        self._abandoning -= 1

    # ---- renewing -----------------------------------------------------------------------
    #
    # One sweep per table renews every lease held: a timer fires when the earliest renewal is due
    # and takes every lease due within half a renewal interval from then (so a lease renews
    # between a sixth and a third of its lease timeout after its previous renewal was answered),
    # grouped by routing state and model, one script call per group (lua/renew.lua, variadic; a
    # model's keys share one hash tag, so one Cluster slot). A lease whose call is under way is
    # not taken again: one slow or dead shard holds up nobody else's renewals.

    def _sweep_at(self, when: float) -> None:
        """Make sure the sweep runs by monotonic time `when` (seconds)."""
        timer = self._sweep_timer
        if timer is not None and not timer.cancelled() and timer.when() <= _loop_time(when):
            return
        if timer is not None:
            timer.cancel()
        self._sweep_timer = asyncio.get_running_loop().call_at(_loop_time(when), self._sweep)

    def _sweep(self) -> None:
        """The renewal sweep (a timer callback): send the renewals due, then time the next
        sweep. Never raises, and always times the next sweep: no renewal may stop."""
        self._sweep_timer = None
        try:
            self._send_renewals_due(time.monotonic())
        except Exception:  # noqa: BLE001 (no renewal may stop: a lease would expire under a running request)
            log.exception("lease renewal sweep failed unexpectedly, the requests keep running")
        finally:
            upcoming = [h.renew_at for h in self._held if h.lease is not None and not h.renewing and not h.lost.is_set()]
            if upcoming:
                self._sweep_at(max(min(upcoming), time.monotonic() + _SWEEP_MIN_SPACING_SECONDS))

    def _send_renewals_due(self, now: float) -> None:
        groups: dict[tuple[int, str], list[Held]] = {}
        for held in self._held:
            if held.lease is None or held.ended or held.renewing or held.lost.is_set():
                continue
            interval = self._lease_timeout(held) / 3
            if held.renew_at > now + interval / 2:
                continue
            if held.local or held.lease.model in self.breaker.open_models:  # that model's recovery adopts it
                held.unconfirmed = held.unconfirmed or not held.local
                held.renew_at = now + interval
                continue
            state = held.state or self.state
            groups.setdefault((id(state), held.lease.model), []).append(held)
        for helds in groups.values():
            for at in range(0, len(helds), MAX_LEASES_PER_CALL):
                batch = helds[at:at + MAX_LEASES_PER_CALL]
                for held in batch:
                    held.renewing = True
                task = asyncio.get_running_loop().create_task(self._renew_batch(batch))
                self._sweeps.add(task)
                task.add_done_callback(self._sweeps.discard)

    async def _renew_batch(self, batch: list[Held]) -> None:
        """Renew `batch` (leases of one routing state and model) in one call, then settle each
        lease as `_renewed` says. A failed call is a failed renewal of every lease in it (the
        breaker counts the one call against the model); an answered one ends the model's run of
        failures (whatever each lease's answer: Redis served the model). Nothing here raises but a
        cancellation."""
        renewed_at = time.monotonic()
        sent = [_RenewalSent(held.adoptions, renewed_at) for held in batch]  # the leases' state as the call goes
        try:
            state = batch[0].state or self.state
            try:
                updates = await state.renew_request_leases([held.lease for held in batch])
            except REDIS_FAILURES as exc:
                updates = [exc] * len(batch)
                metrics.child(metrics.REDIS_ERRORS, "renew").inc()
                self.breaker.record_failure(exc, batch[0].lease.model)
                log.warning("lease renewal of %d leases failed, their requests keep running: %s", len(batch), exc)
            else:
                self.breaker.record_success(batch[0].lease.model)  # Redis answered: the model's failure run ends
            await asyncio.gather(*(self._settle_renewal(held, update, at) for held, update, at in zip(batch, updates, sent)))
        except Exception:  # noqa: BLE001 (no renewal may stop: the leases would expire under running requests)
            log.exception("lease renewal failed unexpectedly, the requests keep running")
            for held in batch:
                held.unconfirmed = True
        finally:
            now = time.monotonic()
            for held in batch:
                held.renewing = False
                held.renew_at = now + self._lease_timeout(held) / 3
            if any(not held.ended and not held.lost.is_set() for held in batch):
                self._sweep_at(min(held.renew_at for held in batch))

    async def _settle_renewal(self, held: Held, update: LeaseUpdate | Exception, sent: _RenewalSent) -> None:
        """What one lease's renewal answer means for it (`_renewed`). Never raises but a
        cancellation."""
        if held.ended:
            return  # its request ended meanwhile: the release takes it from here
        try:
            await self._renewed(held, update, sent)
        except Exception:  # noqa: BLE001 (no renewal may stop: the lease would expire under a running request)
            log.exception("lease renewal failed unexpectedly, the request keeps running")
            held.unconfirmed = True

    async def _renewed(self, held: Held, update: LeaseUpdate | Exception, sent: _RenewalSent) -> None:
        """One renewal's answer (`update`: its LeaseUpdate, or the Redis error its call met;
        `sent`: the lease's state when the call was sent), judged by that state: an adoption
        recorded or under way since it was sent decides the lease, not this answer (issue 29,
        item 1). A failed call keeps the request running. A lease Redis reports missing is
        adopted (`_adopt`): without a capacity check when Redis lost its state (another epoch,
        or none known); under the same epoch it expired in Redis (this process or Redis stalled
        past the lease timeout, or Redis's clock stepped), its slot was free to others meanwhile,
        and it comes back only within the pair's limits, else it is lost and its request
        cancelled (issue 29, item 0). An epoch read or adoption that fails leaves the lease
        undecided until its next renewal."""
        since = held.adopting or held.adoptions != sent.adoptions
        if isinstance(update, Exception):
            if not isinstance(update, REDIS_FAILURES):
                raise update
            metrics.child(metrics.LEASE_RENEWALS, "failed").inc()
            held.unconfirmed = held.unconfirmed or not since
            return
        if update.result is Result.RENEWED:
            metrics.child(metrics.LEASE_RENEWALS, "renewed").inc()
            held.unconfirmed, held.confirmed_at = False, max(held.confirmed_at, sent.at)
            return
        if since:
            return  # the adoption sent after this renewal records the lease (or reports it lost)
        try:
            await self.refresh_epoch()  # a changed epoch: `_adopt` records the lease without a check
            adopted = await self._adopt(held)
        except REDIS_FAILURES:
            held.unconfirmed = True  # undecided: the next renewal asks again
            return
        metrics.child(metrics.LEASE_RENEWALS, "adopted" if adopted else "lost").inc()

    # ---- the epoch and adoption ---------------------------------------------------------

    def _epoch_read_shared(self) -> asyncio.Task:
        """The epoch read under way, or a new one (refresh_epoch), for a decision to await
        shielded: it runs on when its waiters are cancelled. Its result raises RedisError."""
        task = self._epoch_read
        if task is None or task.done():
            task = self._epoch_read = asyncio.get_running_loop().create_task(self.refresh_epoch())
            task.add_done_callback(lambda done: done.cancelled() or done.exception())
        return task

    async def _epoch_read_after(self, read: asyncio.Task) -> None:
        """Await the shared epoch read `read` for an admission that succeeded; when it failed,
        one read of its own: the shared one may have begun, and failed, before this admission
        found a free connection. Raises RedisError."""
        try:
            await asyncio.shield(read)
        except REDIS_FAILURES:
            await asyncio.shield(self._epoch_read_shared())

    async def refresh_epoch(self, adopt_on_change: bool = True) -> str:
        """Read the routing state's epoch, writing a new one when there is none (Redis started
        empty or lost its state). The epoch grace (module docstring) begins when the epoch read
        is younger than the grace and either this process knew an earlier state (another epoch,
        or a failed Redis call) or the epoch says it was written after a loss: so a process
        started just after Redis lost its state waits like the others, and a fleet starting on
        a new Redis does not wait. An epoch written as a first state by a process that knew
        none is marked as written after a loss by the first process that held an earlier one.
        When the epoch changed (and `adopt_on_change`), every lease held is adopted. Raises
        RedisError."""
        previous = self.epoch
        knew_state = previous is not None or bool(self.breaker.failures_seen)
        epoch, age = await self._read_epoch(after_loss=knew_state)
        if previous == epoch:
            return epoch
        if previous is not None and not _written_after_loss(epoch):
            epoch = await self._mark_written_after_loss(epoch)
        self.epoch = epoch
        remaining = max(0.0, self.config.redis.epoch_grace - age)
        if (knew_state or _written_after_loss(epoch)) and remaining > 0:
            self._grace_until = max(self._grace_until, time.monotonic() + remaining)
            log.warning("the routing state lost its state (new epoch, %.2f s old): managed pairs take no new admission for %.2f s",
                        age, remaining)
        if adopt_on_change and previous is not None:
            log.warning("adopting %d held leases into the new epoch", len(self._held))
            self._adoption_pending = True
            if self._adoption_wanted is not None:
                self._adoption_wanted.set()
        return epoch

    async def _read_epoch(self, after_loss: bool) -> tuple[str, float]:
        """The epoch (written SET NX as `<random hex>@<Redis time ms>` when there is none, with
        `:lost` appended when `after_loss`) and its age in seconds by Redis time (0 when
        unknown). One round trip when the epoch is the one last read, three when it is new.
        Raises RedisError."""
        redis = self.state.redis
        raw = await redis.get(self._epoch_key)
        if raw is not None and _text(raw) == self.epoch:
            return self.epoch, math.inf
        now_ms = await redis_time_ms(redis, self._epoch_key)
        if raw is None:
            written = f"{uuid.uuid4().hex}@{now_ms}{_AFTER_LOSS if after_loss else ''}"
            async with redis.pipeline(transaction=True) as pipe:
                pipe.set(self._epoch_key, written, nx=True)
                pipe.get(self._epoch_key)
                _, raw = await pipe.execute()
        epoch = _text(raw)
        created_ms = _epoch_created_ms(epoch)
        age = max(0.0, (now_ms - created_ms) / 1000) if created_ms is not None else 0.0
        return epoch, age

    async def _mark_written_after_loss(self, epoch: str) -> str:
        """Mark `epoch` (written by a process that knew no earlier state) as written after a
        loss, unless it changed meanwhile; the epoch now in Redis. Its creation time stays, so
        every process ends the grace at the same instant. Raises RedisError."""
        raw = await self.state.redis.eval(_MARK_AFTER_LOSS, 1, self._epoch_key, epoch, epoch + _AFTER_LOSS)
        return _text(raw) if raw is not None else epoch

    async def _adopt_into_new_epoch(self) -> None:
        """The adoption worker: after an epoch change, adopt every shared lease admitted under an
        earlier epoch, retrying through Redis errors, until none is left; managed pairs take no
        new admission meanwhile (`rebuilding`). A request that ends, or an error, never leaves
        the rest unadopted: the table owns the adoption, no request's task does."""
        await self._adoption_wanted.wait()
        self._adoption_wanted.clear()
        while self._adoption_pending:
            pending = [h for h in self._held if h.lease is not None and not h.ended and not h.local and h.epoch != self.epoch]
            if not pending:
                self._adoption_pending = False
                log.warning("every held lease is adopted into the new epoch")
                return
            unreachable: set[str] = set()  # models whose adoption failed in this round: the others go on
            for held in pending:
                model = held.lease.model
                if model in unreachable or self.breaker.open_for(model):
                    unreachable.add(model)
                    continue
                try:
                    await self._adopt(held)
                except REDIS_FAILURES as exc:
                    log.warning("adoption of model %s into the new epoch interrupted, retrying: %s", model, exc)
                    unreachable.add(model)
            if unreachable:
                await asyncio.sleep(self.retry_seconds)

    async def adopt_held(self, model: str, include_shared: bool) -> int:
        """Adopt every local lease of `model` held (and, with `include_shared`, every Redis lease
        of it too: harmless for one Redis still has). Returns how many were adopted. Raises
        RedisError at the first lease Redis does not take (one model's keys live in one slot)."""
        adopted = 0
        for held in list(self._held):
            if held.lease is None or held.lease.model != model or held.ended or not (held.local or include_shared):
                continue
            await self._adopt(held)
            adopted += 1
        return adopted

    def _models_held(self) -> set[str]:
        """The models of the leases held."""
        return {held.lease.model for held in self._held if held.lease is not None and not held.ended}

    def _state_for(self, held: Held) -> RoutingState | None:
        """The routing state that knows `held`'s pair: the one it was admitted with, else the
        table's (a lease granted during an outage may name a provider only a newer config has),
        else None (no config serves the pair any more)."""
        lease = held.lease
        for state in (held.state, self.state):
            if state is not None and state.serves(lease.provider, lease.model):
                return state
        return None

    async def _adopt(self, held: Held) -> bool:
        """Record `held`'s lease in Redis (lua/adopt.lua). Without a capacity check when it is
        local (granted during an outage) or was admitted under another epoch than the one known
        now, or none (Redis lost its state: `rebuilding` keeps the pairs closed meanwhile);
        otherwise a lease no longer live in Redis expired there, its slot was free to others, and
        it comes back only within the pair's limits: when refused it is lost (its request is
        cancelled). A request that ended while its adoption was on its way has the lease
        released once the adoption landed or failed (it may have landed all the same); a local
        lease whose adoption failed unanswered (a timeout, a lost connection: not Redis's error
        reply) is released when its request ends, however late the adoption lands. Returns
        False when refused (the lease is then marked lost), else True. Raises RedisError (the
        lease stays as it was)."""
        state = self._state_for(held)
        if state is None:  # nothing can count it: it runs uncounted, and blocks no recovery
            log.warning("lease on %s %s not adopted: no routing config serves the pair now", held.lease.provider, held.lease.model)
            self._forget(held)
            return True
        held.state = state
        held.adopting = True
        within_limits = not held.local and held.epoch is not None and held.epoch == self.epoch
        try:
            adopted = await state.adopt_request_lease(held.lease, within_limits=within_limits)
        except BaseException as exc:
            if held.ended:  # the call may have landed all the same (a client timeout): release it
                self._spawn_release(held, refresh=False)
            elif held.local and not isinstance(exc, ResponseError):  # unanswered: its request's end releases it
                held.maybe_recorded = True
            raise
        finally:
            held.adopting = False
        held.adoptions += 1
        if adopted.result is not Result.ADMITTED:
            log.warning("lease %s on %s %s expired in Redis and its slot is taken (%s): its request is cancelled",
                        held.lease.id, held.lease.provider, held.lease.model, adopted.result.value)
            held.unconfirmed = False
            if not held.ended:
                held.mark_lost()
            return False
        was_local, held.local = held.local, False
        held.unconfirmed, held.confirmed_at, held.epoch = False, time.monotonic(), self.epoch
        if held.ended:  # its request ended while the adoption was on its way
            self._spawn_release(held, refresh=False)
        elif was_local:
            metrics.LEASES_ADOPTED.inc()
        return True

    async def recover(self) -> int:
        """Redis answers again, for some scopes at least (extproc.routing.outage.RedisBreaker):
        when the fleet's scope is open, read the epoch and, when it answers, open the scope of
        every model held (its leases were decided locally, or renewed without the epoch) and
        close the fleet's; then recover each model whose scope is open (`_recover_model`), all at
        once, so a model Redis does not serve yet (a dead shard, a slot being moved) holds up no
        other (while the fleet's scope stays open too: their leases renew again, their decisions
        wait for the epoch). Returns the local leases adopted. Raises RedisError when the epoch
        cannot be read (the fleet's scope stays open), after the models' recovery."""
        fleet_error: BaseException | None = None
        if self.breaker.fleet_open:
            try:
                await self.refresh_epoch(adopt_on_change=False)
            except REDIS_FAILURES as exc:
                self.breaker.trip(exc)
                fleet_error = exc
            else:
                for model in self._models_held():
                    self.breaker.hold_until_recovered(model)
                self.breaker.close()
        recovered = await asyncio.gather(*(self._recover_model(model) for model in sorted(self.breaker.open_models)))
        if fleet_error is not None:
            raise fleet_error
        return sum(recovered)

    async def _recover_model(self, model: str) -> int:
        """Adopt every lease of `model` held (local ones, and Redis ones it may have let expire or
        lost; when none is held, a probe call on the model's keys stands in), close the model's
        scope so new decisions go to Redis, then adopt until nothing local of it is left. Returns
        the local leases adopted; on a Redis failure the model's scope stays open (the next probe
        tries again). Raises nothing but a cancellation."""
        before = sum(1 for held in self._held if held.local and held.lease is not None and held.lease.model == model)
        try:
            if not await self.adopt_held(model, include_shared=True):
                await self.state.probe(model)
            self.breaker.close(model)
            while await self.adopt_held(model, include_shared=False):
                pass
        except REDIS_FAILURES as exc:
            self.breaker.trip(exc, model)
            log.info("routing state of model %s not reachable yet: %s", model, exc)
            return 0
        return before

    # ---- draining -----------------------------------------------------------------------

    async def drain(self, within_seconds: float = 5.0) -> None:
        """Release everything still held, wait (up to `within_seconds`) for the releases and
        abandonments under way to reach Redis, then stop the table's tasks."""
        for held in list(self._held):
            self.end(held, succeeded=False)
        deadline = time.monotonic() + within_seconds
        while (self.pending_releases or self.pending_abandonments) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._release_batcher.stop()
        if self._sweep_timer is not None:
            self._sweep_timer.cancel()
        for task in list(self._sweeps):
            task.cancel()
        for worker in self._workers:
            worker.cancel()


_SWEEP_MIN_SPACING_SECONDS = 0.005  # sweeps never come closer than this, however the leases are due


def _loop_time(monotonic_seconds: float) -> float:
    """The event loop's clock for a time.monotonic() time (uvloop's clock may differ)."""
    loop = asyncio.get_running_loop()
    return loop.time() + (monotonic_seconds - time.monotonic())


class _ReleaseBatcher:
    """The releases asked in one event-loop turn, sent together: one script call per (routing
    state, model) (lua/release.lua, variadic; one model's keys share a hash tag, so one Cluster
    slot), at most MAX_LEASES_PER_CALL leases each. A release whose call failed on Redis goes
    again in `retry_seconds` (seconds), with the next turn's, until its `give_up_at`
    (time.monotonic() seconds), after which its lease expires by itself in Redis. After `stop`
    it takes nothing more."""

    def __init__(self, retry_seconds: float) -> None:
        self.retry_seconds = retry_seconds
        self.unsettled = 0  # releases submitted, neither answered nor given up
        self._settled = asyncio.Event()  # set while nothing is unsettled
        self._settled.set()
        self._stopped = False
        self._pending: dict[tuple[int, str], tuple[RoutingState, list[_Release]]] = {}
        self._flush: asyncio.Handle | None = None
        self._calls: set[asyncio.Task] = set()
        self._retries: set[asyncio.TimerHandle] = set()

    def submit(self, state: RoutingState, lease: Lease, refresh: bool, give_up_at: float) -> None:
        """Release `lease` through `state` (refreshing the pin when `refresh`) in the next call
        of its group. Needs a running event loop; raises nothing."""
        if self._stopped:
            log.warning("lease %s not released (the drain is over), it expires by itself", lease.id)
            return
        self.unsettled += 1
        self._settled.clear()
        self._queue(state, _Release(lease, refresh, give_up_at))

    async def settled(self) -> None:
        """Return once every release submitted so far is answered or given up."""
        await self._settled.wait()

    def stop(self) -> None:
        """Drop what is not sent yet and the retries waiting, cancel the calls under way (the
        drain's end: what they held expires by itself in Redis)."""
        self._stopped = True
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        self._pending.clear()
        for handle in self._retries:
            handle.cancel()
        self._retries.clear()
        for task in list(self._calls):
            task.cancel()
        self.unsettled = 0
        self._settled.set()

    def _settle(self, count: int) -> None:
        if self._stopped:
            return
        self.unsettled -= count
        if not self.unsettled:
            self._settled.set()

    def _queue(self, state: RoutingState, release: _Release) -> None:
        self._pending.setdefault((id(state), release.lease.model), (state, []))[1].append(release)
        if self._flush is None:
            self._flush = asyncio.get_running_loop().call_soon(self._send)

    def _send(self) -> None:
        self._flush = None
        pending, self._pending = self._pending, {}
        loop = asyncio.get_running_loop()
        for state, items in pending.values():
            for at in range(0, len(items), MAX_LEASES_PER_CALL):
                task = loop.create_task(self._call(state, items[at:at + MAX_LEASES_PER_CALL]))
                self._calls.add(task)
                task.add_done_callback(self._calls.discard)

    async def _call(self, state: RoutingState, items: list[_Release]) -> None:
        try:
            answers = await state.release_request_leases([(item.lease, item.refresh) for item in items])
        except REDIS_FAILURES as exc:
            metrics.child(metrics.REDIS_ERRORS, "release").inc()
            for item in items:
                self._retry_or_give_up(state, item, exc)
            return
        except Exception:
            self._settle(len(items))
            log.exception("releases of %d leases failed; they expire by themselves", len(items))
            return
        for item, answer in zip(items, answers):
            if isinstance(answer, Exception):  # refused by the script itself: going again cannot help
                log.warning("lease %s not released, it expires by itself: %s", item.lease.id, answer)
        self._settle(len(items))

    def _retry_or_give_up(self, state: RoutingState, item: _Release, exc: Exception) -> None:
        if self._stopped:
            return
        if time.monotonic() + self.retry_seconds >= item.give_up_at:
            self._settle(1)
            log.warning("lease %s not released, it expires by itself: %s", item.lease.id, exc)
            return
        metrics.RELEASE_RETRIES.inc()
        handle: asyncio.TimerHandle | None = None

        def again() -> None:
            self._retries.discard(handle)
            self._queue(state, item)

        handle = asyncio.get_running_loop().call_later(self.retry_seconds, again)
        self._retries.add(handle)


@dataclass(frozen=True, slots=True)
class _Release:
    lease: Lease
    refresh: bool
    give_up_at: float  # time.monotonic() seconds


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


_AFTER_LOSS = ":lost"  # an epoch written by a process that knew an earlier state
_MARK_AFTER_LOSS = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('SET', KEYS[1], ARGV[2]) end
return redis.call('GET', KEYS[1])
"""


def _written_after_loss(epoch: str) -> bool:
    return epoch.endswith(_AFTER_LOSS)


def _epoch_created_ms(epoch: str) -> int | None:
    """The creation time (Redis time, ms) an epoch `<hex>@<ms>[:lost]` carries; None if none."""
    _, _, rest = epoch.partition("@")
    created = rest.removesuffix(_AFTER_LOSS)
    return int(created) if created.isdigit() else None
