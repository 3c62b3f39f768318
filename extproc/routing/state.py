"""The shared routing state (the spec's ROUTING_STATE): pins and request leases in Redis.

Every transition is one Lua script of this package's `lua/` folder, run atomically by Redis;
this module only builds keys and arguments and decodes replies. Time is Redis `TIME` in
milliseconds; tests may pass `now_ms` explicitly (production never does).

Key names come from extproc.storage.keys.

The scripts go over one of two clients (config `redis.hot_path_client`, docs/routing-state.md
"Which client carries which call"): the hot-path client (extproc.storage.pipelined, one pipelined
connection per node) when one is given, with the model's constant keys and arguments encoded
once (`Packed`); else the redis-py client, which also carries everything else the gateway asks
of Redis.
"""

from __future__ import annotations

import asyncio
import contextvars
import enum
import logging
import os
import time
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import TypeVar

from redis.exceptions import RedisError, ResponseError

from extproc import metrics
from extproc.config import Config, Provider, ProviderKind
from extproc.config.endpoints import EndpointError, pick_endpoints
from extproc.routing.placement import current_blocks, current_chained
from extproc.storage.client import LuaScript, RedisClient, connect  # noqa: F401 (connect: re-exported)
from extproc.storage.keys import Keyspace
from extproc.storage.pipelined import Packed, PipelinedRedis

NO_LIMIT = -1
SHARE_OFF = [0, 0, 0, ""]  # the scripts' routing.third_party_share arguments when it does not apply (lua/lib.lua read_share)
NOT_REPLICATED_LOG_INTERVAL_SECONDS = 10.0
MAX_LEASES_PER_CALL = 128  # renewals or releases in one script call: bounds how long one call holds Redis
UNKNOWN_PROVIDER = "UNKNOWN_PROVIDER"  # a variadic renewal's or release's answer for a provider the config lacks
T = TypeVar("T")

log = logging.getLogger(__name__)


class Result(str, enum.Enum):
    """Result names of the routing state's transitions (the spec's, plus renew/release answers)."""

    ADMITTED = "ADMITTED"
    ALREADY_PINNED = "ALREADY_PINNED"
    SESSION_NOT_PINNED = "SESSION_NOT_PINNED"
    PIN_LIMIT_REACHED = "PIN_LIMIT_REACHED"
    PER_SESSION_IN_FLIGHT_REQUEST_LIMIT_REACHED = "PER_SESSION_IN_FLIGHT_REQUEST_LIMIT_REACHED"
    GLOBAL_IN_FLIGHT_REQUEST_LIMIT_REACHED = "GLOBAL_IN_FLIGHT_REQUEST_LIMIT_REACHED"
    UNRESERVED_IN_FLIGHT_REQUEST_LIMIT_REACHED = "UNRESERVED_IN_FLIGHT_REQUEST_LIMIT_REACHED"
    PROVIDER_NOT_CONFIGURED = "PROVIDER_NOT_CONFIGURED"
    PIN_MISMATCH = "PIN_MISMATCH"
    PINNED = "PINNED"
    NOT_PINNED = "NOT_PINNED"
    RENEWED = "RENEWED"
    LEASE_LOST = "LEASE_LOST"
    RELEASED = "RELEASED"
    LEASE_EXPIRED = "LEASE_EXPIRED"
    NOT_FOUND = "NOT_FOUND"
    MOVED = "MOVED"  # affinity pick: the lease counts on the endpoint that answered (lua/move_endpoint_lease.lua)
    # The admission queue (docs/queue.md); never answered while it is off.
    QUEUED = "QUEUED"  # the request's ticket waits in the pair's queue
    TICKET_LOST = "TICKET_LOST"  # the waiting ticket is gone (its lease ended, or Redis lost it)
    THIRD_PARTY_SHARE_REACHED = "THIRD_PARTY_SHARE_REACHED"  # routing.third_party_share refused it


CAPACITY_RESULTS = frozenset(
    {
        Result.PIN_LIMIT_REACHED,
        Result.PER_SESSION_IN_FLIGHT_REQUEST_LIMIT_REACHED,
        Result.GLOBAL_IN_FLIGHT_REQUEST_LIMIT_REACHED,
        Result.UNRESERVED_IN_FLIGHT_REQUEST_LIMIT_REACHED,
    }
)


# The admission queue's answers (docs/queue.md): none of them while it is off for the model.
QUEUE_RESULTS = frozenset({Result.QUEUED, Result.TICKET_LOST})


class PinMatch(str, enum.Enum):
    """Whether a compare-and-swap found the expected pin (the spec's result.pin_match)."""

    MATCHED = "MATCHED"
    MISMATCHED = "MISMATCHED"


@dataclass(frozen=True, slots=True)
class Pin:
    """A session's pin. `deadline_ms`: inactivity deadline; `expiry_ms`: when the pin dies if
    nothing changes (the latest of the deadline and its leases' deadlines). Redis time, ms."""

    provider: str
    id: str
    deadline_ms: int
    expiry_ms: int


@dataclass(frozen=True, slots=True)
class Lease:
    """A request lease (an in-flight slot) on a (provider, model) pair. `pin_id` is None for a
    temporary lease. `deadline_ms`: Redis time (ms) after which it stops counting unless renewed.
    `endpoints`: on a pair with affinity pick, the endpoints (`ip:port`) placement chose, the
    lease's own first (it counts there), then the next best (the endpoint-picker protocol's
    fallbacks); () elsewhere, or when the lease was granted without Redis."""

    model: str
    provider: str
    id: str
    session_id: str | None
    pin_id: str | None
    deadline_ms: int
    endpoints: tuple[str, ...] = ()

    @property
    def endpoint(self) -> str | None:
        """The endpoint the lease counts on (affinity pick), else None."""
        return self.endpoints[0] if self.endpoints else None


@dataclass(frozen=True, slots=True)
class Admission:
    """The answer of an admission transition: `lease` is set only when result is ADMITTED."""

    result: Result
    pin: Pin | None
    lease: Lease | None
    now_ms: int


@dataclass(frozen=True, slots=True)
class QueueArgs:
    """What the admission queue's gate (lua/queue.lua) needs of one call: the request's class rank
    (0: highest priority), whether its class may use the slots reserved for pinned sessions, its
    tenant (a keyed hash of its identity), its ticket id ("" for none), the mode ("none": never
    queue, "join": queue when refused for slots, "wait": the ticket must exist) and its class's
    max depth per pair."""

    class_rank: int
    may_use_reserved: bool
    tenant: str
    ticket: str
    mode: str
    max_depth: int


@dataclass(frozen=True, slots=True)
class CasResult:
    """The answer of try_compare_and_swap_pin_and_admit_request."""

    pin_match: PinMatch
    admission: Admission


@dataclass(frozen=True, slots=True)
class LeaseUpdate:
    """The answer of a renewal or release: RENEWED / LEASE_LOST, or RELEASED / LEASE_EXPIRED /
    NOT_FOUND; or of an endpoint move: MOVED / NOT_FOUND. `deadline_ms` is the renewed deadline
    (Redis time, ms) when RENEWED, the lease's unchanged one when MOVED."""

    result: Result
    deadline_ms: int | None
    now_ms: int


SCRIPT_NAMES = (
    "get_pin",
    "get_pin_and_admit",
    "admit_unpinned",
    "admit_pinned",
    "cas_repin",
    "admit_without_pin",
    "renew",
    "release",
    "adopt",
    "abandon",
    "queue_leave",
    "admit_share",
    "probe",
    "move_endpoint_lease",
)

# The scripts that take the admission queue's keys when it is on for the model (lua/queue.lua):
# those that admit, free a slot or remove a ticket.
QUEUE_SCRIPTS = frozenset(
    {"get_pin_and_admit", "admit_unpinned", "admit_pinned", "cas_repin", "admit_without_pin", "release", "abandon", "queue_leave"}
)


# The scripts that place a request on an endpoint of a pick pair, or move it to another one:
# they take the prompt's blocks (the endpoint's prefix index learns them).
PLACING_SCRIPTS = frozenset(
    {"get_pin_and_admit", "admit_unpinned", "admit_pinned", "cas_repin", "admit_without_pin", "move_endpoint_lease"}
)

# The scripts that may record a lease (the ones `redis.durable_admissions` waits on).
ADMITTING_SCRIPTS = frozenset({"get_pin_and_admit", "admit_unpinned", "admit_pinned", "cas_repin", "admit_without_pin", "adopt"})


def script_body(name: str) -> str:
    """The text of lua/<name>.lua alone, read from this package's resources
    (extproc/routing/lua/)."""
    return resources.files(__package__).joinpath("lua", f"{name}.lua").read_text()


def script_source(name: str) -> str:
    """The full source of script `name`: lua/lib.lua, lua/queue.lua (the admission queue), then
    lua/<name>.lua as a function whose answer goes through lib.lua's `with_epoch` (the epoch
    appended when the call's epoch flag asks for it)."""
    return (
        script_body("lib") + "\n" + script_body("queue") + "\n"
        + "local function main()\n" + script_body(name) + "\nend\nreturn with_epoch(main())\n"
    )


class EpochSeen:
    """The routing state's epochs (`<hex>@<Redis ms>[:lost]`, extproc.storage.keys.Keyspace.epoch)
    that the routing scripts of one decision saw, each read by the script itself, atomically with
    what it admitted (lua/lib.lua `with_epoch`); None for a script that found no epoch (Redis lost
    its state). Filled only where the epoch can ride in the scripts (RoutingState.epoch_in_script);
    see `watching_epoch`."""

    __slots__ = ("epochs",)

    def __init__(self) -> None:
        self.epochs: set[str | None] = set()

    def only(self, epoch: str | None) -> bool:
        """Whether some script saw an epoch and every one saw `epoch` (not None)."""
        return epoch is not None and self.epochs == {epoch}


_EPOCH_SEEN: contextvars.ContextVar[EpochSeen | None] = contextvars.ContextVar("iris_epoch_seen", default=None)


def watching_epoch(call: Coroutine[object, object, T], seen: EpochSeen) -> asyncio.Task[T]:
    """Run `call` in a task of its own in which every RoutingState script call (on a state whose
    `epoch_in_script` holds) also returns the epoch it saw, recorded in `seen`. The task's own
    context carries `seen`, so nothing outside it (renewals, releases, other decisions) records
    there. Needs a running event loop."""
    context = contextvars.copy_context()
    context.run(_EPOCH_SEEN.set, seen)
    return asyncio.get_running_loop().create_task(call, context=context)


def new_id() -> str:
    """A fresh id for a lease or a pin: 128 random bits from the OS, 32 hex characters."""
    return os.urandom(16).hex()


def new_id_pair() -> tuple[str, str]:
    """Two fresh ids as `new_id` makes them, from one read of the OS's random source."""
    both = os.urandom(32).hex()
    return both[:32], both[32:]


class RoutingState:
    """The spec's ROUTING_STATE over Redis. Every method is one atomic script call (one round
    trip), over the hot-path client when the state has one (`hot_path`), else over redis-py;
    NOSCRIPT after a restart, a failover or `SCRIPT FLUSH` is recovered by EVAL of the script on
    the node that answered (extproc.storage.client.LuaScript, PipelinedRedis.evalsha).

    `epoch_in_script`: whether a script called inside `watching_epoch` also reads the epoch key
    and returns it (EpochSeen): where Redis has no hash slots (standalone, Sentinel). In a
    Cluster the epoch key (tag `{prefix}`) lives in another slot than a model's keys, which no
    script may touch together: the lease table reads it apart there.

    `now_ms` arguments are test-only. Raises redis.exceptions.RedisError on connection problems
    (the hot-path client's errors are redis-py's classes; its in-flight cap is
    extproc.storage.client.is_pool_exhausted, as redis-py's busy pool).
    """

    def __init__(
        self, redis: RedisClient, config: Config, *, sources: Mapping[str, str] | None = None,
        hot_path: PipelinedRedis | None = None, packed: bool = True,
    ):
        """`redis`: the redis-py client (SCRIPT LOAD, and every script when `hot_path` is None).
        `hot_path`: the pipelined client every script call goes over when given (the caller owns
        and closes it); `packed` (with `hot_path`): the model's constant keys and arguments are
        encoded once, as Packed segments (False: per call, as redis-py does; bench.redis_client
        compares both). `sources` (test-only) replaces the source of named scripts, for example
        with a deliberately broken one in a mutation check."""
        self.redis = redis
        self.hot_path = hot_path
        self.config = config
        self.keys = Keyspace(config.redis.key_prefix)
        self.epoch_in_script = config.redis.cluster is None
        self._epoch_key = self.keys.epoch()
        sources = sources or {}
        self._scripts = {
            name: LuaScript(sources.get(name) or script_source(name)) for name in SCRIPT_NAMES
        }
        self._timing = [
            round(config.pin_inactivity_timeout_seconds * 1000),
            round(config.lease_timeout_seconds * 1000),
            round(config.redis.housekeeping_grace_seconds * 1000),
        ]
        self._durable = config.redis.durable_admissions
        self._not_replicated_logged_at = float("-inf")
        self._not_replicated_since_log = 0
        self._model_keys: dict[str, list[str]] = {}
        self._model_args: dict[str, list[object]] = {}
        self._share_args: dict[str, list[object]] = {}
        share = config.routing.third_party_share
        for model in config.models():
            providers = config.providers_for(model)
            self._model_keys[model] = [
                key
                for p in providers
                for key in (self.keys.provider_pins(model, p.name), self.keys.provider_leases(model, p.name))
            ]
            self._model_args[model] = [*self._timing, len(providers), *_limits_args(config, model, providers)]
            if share is not None:
                unlimited = ",".join(p.name for p in providers if p.kind is ProviderKind.UNLIMITED)
                self._share_args[model] = [round(share.window_seconds * 1000), round(share.max_share * 1_000_000), share.burst, unlimited]
        self._endpoints = {p.name: _initial_endpoints(p) for p in config.providers if p.picks}
        self._pick_keys: dict[str, list[str]] = {}
        self._pick_args: dict[str, list[object]] = {}
        for model in config.models():
            self._pick_keys[model], self._pick_args[model] = self._pick_section(model)
        self._queue_keys: dict[str, list[str]] = {}
        self._queue_default: dict[str, QueueArgs] = {}
        queue = config.routing.queue
        for model in config.models():
            if queue.enabled(model):
                providers = config.providers_for(model)
                self._queue_keys[model] = [
                    self.keys.tickets(model), self.keys.queue_state(model), self.keys.queue_finish(model),
                    *(k for p in providers for k in (self.keys.queue(model, p.name), self.keys.reserved_queue(model, p.name))),
                ]
                default = next(c for c in queue.classes if c.name == queue.default_class)
                self._queue_default[model] = QueueArgs(
                    [c.name for c in queue.classes].index(default.name), default.use_reserved_slots, "", "", "none", default.max_depth
                )
        self._packed = hot_path is not None and packed
        self._segments = _Segments(self, packed=self._packed)

    def endpoints(self, provider: str) -> tuple[str, ...]:
        """The endpoints (`ip:port`) placement chooses among for `provider` (affinity pick; ()
        for another provider)."""
        return self._endpoints.get(provider, ())

    def set_endpoints(self, provider: str, endpoints: tuple[str, ...]) -> None:
        """Place `provider`'s requests on `endpoints` (`ip:port`, in the order every proxy uses:
        extproc.config.endpoints.name_endpoints) from the next script call on; the refresh of a
        DNS name calls it (extproc.routing.endpoint_refresh). A provider without affinity pick
        is ignored. Nothing in Redis changes: each endpoint's leases and prefix index are keyed by
        its `ip:port`, so an endpoint that stays keeps its count and index and its sessions (a
        pin records its endpoint), one that leaves stops being read (its sessions are placed
        again at their next turn; its leases end by their deadline) and one that comes is an
        endpoint with nothing yet (docs/routing-state.md "Endpoint placement")."""
        if provider not in self._endpoints or self._endpoints[provider] == endpoints:
            return
        self._endpoints[provider] = tuple(endpoints)
        for model in self.config.models():
            if any(p.name == provider for p in self.config.providers_for(model)):
                self._pick_keys[model], self._pick_args[model] = self._pick_section(model)
        self._segments = _Segments(self, packed=self._packed)  # swapped whole: a call reads one or the other

    def _pick_section(self, model: str) -> tuple[list[str], list[object]]:
        """The constant KEYS and ARGV of affinity pick for `model` (lua/lib.lua read_pick): per
        pick pair its endpoints' lease and prefix-index keys and its endpoint health flags; its name, cap per endpoint, the
        endpoints; then the placement's settings. ([], ["0"]) without a pick pair."""
        keys: list[str] = []
        args: list[object] = [0]
        for provider in self.config.providers_for(model):
            if not provider.picks:
                continue
            endpoints = self._endpoints[provider.name]
            keys += [self.keys.endpoint_leases(model, provider.name, e) for e in endpoints]
            keys += [self.keys.endpoint_prefixes(model, provider.name, e) for e in endpoints]
            keys.append(self.keys.endpoint_health(model, provider.name))
            args += [provider.name, _limit(provider.models[model].max_in_flight_per_endpoint), len(endpoints), *endpoints]
            args[0] += 1
        if args[0]:
            placement = self.config.routing.placement
            args += [placement.prefix_weight, placement.load_weight, placement.index_blocks_per_endpoint,
                     round(placement.index_ttl_seconds * 1000)]
        return keys, args

    def picks(self, model: str) -> bool:
        """Whether some provider of `model` has affinity pick (its admissions place on endpoints)."""
        return bool(self._pick_args.get(model, [0])[0])

    def queue_enabled(self, model: str) -> bool:
        """Whether the admission queue is on for `model` (some class may wait: docs/queue.md)."""
        return model in self._queue_keys

    def serves(self, provider: str, model: str) -> bool:
        """Whether this state's config has the pair (provider, model): its scripts know its keys."""
        return any(p.name == provider for p in self.config.providers_for(model))

    async def load_scripts(self) -> None:
        """Load every script into the Redis script cache (optional: calls load on demand)."""
        for script in self._scripts.values():
            await script.load(self.redis)

    async def get_pin(self, model: str, session_id: str, *, now_ms: int | None = None) -> Pin | None:
        """The spec's get_pin: the session's live pin, or None."""
        reply = await self._call("get_pin", model, session_id, [], now_ms, with_providers=False)
        return _decode(model, session_id, reply).pin

    async def get_pin_and_try_admit(
        self,
        model: str,
        session_id: str,
        eligible: list[str],
        *,
        lease_id: str | None = None,
        pin_id: str | None = None,
        share: str | None = None,
        now_ms: int | None = None,
        queue: QueueArgs | None = None,
    ) -> tuple[Pin | None, Admission | None]:
        """The spec's first routing attempt in one round trip: get_pin, then the admission the
        spec would try next: on the pin if its provider is in `eligible` (provider names in
        priority order), else nothing; without a pin, a new pin on eligible[0]. Returns (the pin
        seen, the admission or None when none was attempted).

        `lease_id` / `pin_id` (every admission takes both): the ids to record the lease and a
        new pin under, minted by the caller before the call (extproc.routing.lease_table), so a call
        whose answer never comes back can still be abandoned; fresh ones when None.

        `share` (every admission takes it): the identity's key for routing.third_party_share
        (RoutingRequest.share_key); with it, an admission the identity's share refuses answers
        THIRD_PARTY_SHARE_REACHED. None, or the option off: no share is checked."""
        args = [lease_id or new_id(), pin_id or new_id(), *eligible]
        reply = await self._call("get_pin_and_admit", model, session_id, args, now_ms, queue=queue, share=share)
        pinned_branch = _text(reply[9]) == "pinned"
        admission = _decode(model, session_id, reply[:9], None if pinned_branch else (eligible or [None])[0])
        pin = None
        if pinned_branch:  # the pin as get_pin saw it, before the admission extended its expiry
            pin = Pin(_text(reply[12]), _text(reply[13]), int(reply[10]), int(reply[11]))
        if admission.result in (Result.PINNED, Result.NOT_PINNED):
            return pin, None
        return pin, admission

    async def try_admit_unpinned_session_request(
        self,
        provider: str,
        model: str,
        session_id: str,
        *,
        lease_id: str | None = None,
        pin_id: str | None = None,
        share: str | None = None,
        now_ms: int | None = None,
        queue: QueueArgs | None = None,
    ) -> Admission:
        """Pin the session to `provider` and admit, or answer ALREADY_PINNED (another request
        pinned it first) or a capacity result. New pins may not use reserved slots (the spec)."""
        args = [provider, lease_id or new_id(), pin_id or new_id()]
        reply = await self._call("admit_unpinned", model, session_id, args, now_ms, queue=queue, share=share)
        return _decode(model, session_id, reply, provider)

    async def try_admit_pinned_session_request(
        self, model: str, session_id: str, *, lease_id: str | None = None, pin_id: str | None = None, share: str | None = None,
        now_ms: int | None = None, queue: QueueArgs | None = None,
    ) -> Admission:
        """Admit on the session's current pin (reserved slots allowed), or SESSION_NOT_PINNED,
        PER_SESSION_/GLOBAL_IN_FLIGHT_REQUEST_LIMIT_REACHED. `pin` is the pin seen by the script."""
        reply = await self._call("admit_pinned", model, session_id, [lease_id or new_id()], now_ms, queue=queue, share=share)
        return _decode(model, session_id, reply)

    async def try_compare_and_swap_pin_and_admit_request(
        self,
        expected_pin: Pin,
        model: str,
        session_id: str,
        provider: str,
        *,
        lease_id: str | None = None,
        pin_id: str | None = None,
        share: str | None = None,
        now_ms: int | None = None,
        queue: QueueArgs | None = None,
    ) -> CasResult:
        """Move the pin to `provider` and admit there, only if the live pin is `expected_pin`.

        The expected pin's provider may no longer serve `model` in this proxy's configuration
        (a configuration rollout): its pins key is passed as well, so the old pin stops counting
        there at once (it is the same pin whenever the ids match)."""
        args = [expected_pin.id, provider, lease_id or new_id(), pin_id or new_id()]
        old_pins = (self.keys.provider_pins(model, expected_pin.provider),)
        reply = await self._call("cas_repin", model, session_id, args, now_ms, extra_keys=old_pins, queue=queue, share=share)
        admission = _decode(model, session_id, reply, provider)
        match = PinMatch.MISMATCHED if admission.result is Result.PIN_MISMATCH else PinMatch.MATCHED
        return CasResult(match, admission)

    async def try_admit_request_without_pin(
        self, provider: str, model: str, *, lease_id: str | None = None, pin_id: str | None = None, share: str | None = None,
        now_ms: int | None = None, queue: QueueArgs | None = None,
    ) -> Admission:
        """Admit a temporary request (no pin) on a pair with limits; reserved slots not allowed."""
        reply = await self._call("admit_without_pin", model, "", [provider, lease_id or new_id()], now_ms, queue=queue, share=share)
        return _decode(model, None, reply, provider)

    async def try_admit_share(self, provider: str, model: str, share: str, *, lease_id: str, now_ms: int | None = None) -> Result:
        """routing.third_party_share for a temporary request on a pair without limits (no lease:
        the spec): ADMITTED, counted in the share of identity key `share` under `lease_id`, or
        THIRD_PARTY_SHARE_REACHED (lua/admit_share.lua)."""
        reply = await self._call("admit_share", model, "", [provider, lease_id], now_ms, share=share)
        return Result(_text(reply[0]))

    async def adopt_request_lease(self, lease: Lease, *, within_limits: bool = False, now_ms: int | None = None) -> Admission:
        """Record a lease of a request that already runs (lua/adopt.lua): from now on it counts,
        renews and releases like any lease. Without a capacity check (one granted while Redis was
        unreachable, one Redis lost with its state); with `within_limits`, a lease no longer live
        in Redis comes back only within the pair's limits (the global in-flight limit and its
        session's own), else the answer is that limit's refusal and nothing is written. A live
        lease is extended either way. On a pick pair it counts on `lease.endpoint` again (its cap part
        of the limits)."""
        session = (lease.session_id or "") if within_limits else ""
        args = [lease.provider, lease.id, "1" if within_limits else "0", lease.endpoint or ""]
        reply = await self._call("adopt", lease.model, session, args, now_ms)
        return _decode(lease.model, None, reply, lease.provider)

    async def move_endpoint_lease(self, lease: Lease, endpoint: str, *, now_ms: int | None = None) -> LeaseUpdate:
        """Affinity pick: lease `lease` counts on `endpoint` (`ip:port`, the one that answered)
        instead of `lease.endpoint` (the one placement chose), with the same deadline
        (lua/move_endpoint_lease.lua); a move also teaches `endpoint`'s prefix index the prompt
        blocks of the decision running in this context (extproc.routing.placement.deciding_with).
        MOVED with the deadline (Redis time, ms) when it counts there now, NOT_FOUND when nothing
        moved (not live on the chosen endpoint, an endpoint the pair does not list, the same
        endpoint). Idempotent."""
        args = [lease.provider, lease.id, lease.endpoint or "", endpoint]
        reply = await self._call("move_endpoint_lease", lease.model, "", args, now_ms)
        return _renewal(reply)

    async def renew_request_lease(self, lease: Lease, *, now_ms: int | None = None) -> LeaseUpdate:
        """Extend a live lease by the lease timeout: RENEWED, or LEASE_LOST if it had expired."""
        args = [lease.provider, lease.id, lease.pin_id or ""]
        return _renewal(await self._call("renew", lease.model, lease.session_id or "", args, now_ms))

    async def release_request_lease(
        self, lease: Lease, refresh_pin: bool, *, now_ms: int | None = None
    ) -> LeaseUpdate:
        """Release a lease; with `refresh_pin` the pin's inactivity deadline restarts. Idempotent."""
        args = [lease.provider, lease.id, lease.pin_id or "", "1" if refresh_pin else "0"]
        return _release(await self._call("release", lease.model, lease.session_id or "", args, now_ms))

    async def renew_request_leases(self, leases: Sequence[Lease], *, now_ms: int | None = None) -> list[LeaseUpdate | RedisError]:
        """Renew several leases of one model in one script call (lua/renew.lua with a lease per
        three op arguments; at most MAX_LEASES_PER_CALL), each exactly as `renew_request_lease`
        would, in order. Returns one answer per lease: its LeaseUpdate, or a ResponseError (its
        provider is unknown to this state). Raises ValueError for an empty list, leases of several
        models or too many; RedisError when the call fails (none of them was renewed then, or all
        were)."""
        args = [arg for lease in leases for arg in (lease.provider, lease.id, lease.pin_id or "")]
        replies = await self._call_many("renew", leases, args, now_ms)
        return [r if isinstance(r, RedisError) else _renewal(r) for r in replies]

    async def release_request_leases(
        self, releases: Sequence[tuple[Lease, bool]], *, now_ms: int | None = None
    ) -> list[LeaseUpdate | RedisError]:
        """Release several leases of one model in one script call (lua/release.lua with a lease per
        four op arguments; at most MAX_LEASES_PER_CALL), each `(lease, refresh_pin)` exactly as
        `release_request_lease` would, in order (so the admission queue's hand-over and the pins
        end as after as many single releases). Returns one answer per lease: its LeaseUpdate, or a
        ResponseError (its provider is unknown to this state). Raises ValueError for an empty
        list, leases of several models or too many; RedisError when the call fails."""
        args = [
            arg for lease, refresh in releases for arg in (lease.provider, lease.id, lease.pin_id or "", "1" if refresh else "0")
        ]
        replies = await self._call_many("release", [lease for lease, _ in releases], args, now_ms)
        return [r if isinstance(r, RedisError) else _release(r) for r in replies]

    async def _call_many(self, script: str, leases: Sequence[Lease], op_args: list[object], now_ms: int | None) -> list:
        """One call of the variadic `script` (renew or release) for `leases` (one model: one hash
        tag, so one Cluster slot): the first lease's session keys in the usual place, the others'
        last. Returns one reply per lease; an unknown provider's as a ResponseError."""
        if not leases or len(leases) > MAX_LEASES_PER_CALL:
            raise ValueError(f"{len(leases)} leases in one call: 1 to {MAX_LEASES_PER_CALL} allowed")
        model = leases[0].model
        if any(lease.model != model for lease in leases):
            raise ValueError("leases of several models in one call: their keys may live in several slots")
        further = tuple(
            key for lease in leases[1:] for key in (
                self.keys.pin(model, lease.session_id or ""),
                self.keys.session_leases(model, lease.session_id or ""),
                self.keys.session_earlier_leases(model, lease.session_id or ""),
            )
        )
        try:
            reply = await self._call(script, model, leases[0].session_id or "", op_args, now_ms, extra_keys=further)
        except ResponseError as exc:
            if len(leases) == 1 and "unknown provider" in str(exc):
                return [exc]
            raise
        replies = [reply] if len(leases) == 1 else reply
        return [
            ResponseError(f"unknown provider for this model: {lease.provider}") if _text(r[0]) == UNKNOWN_PROVIDER else r
            for lease, r in zip(leases, replies)
        ]

    async def abandon_request(
        self, model: str, session_id: str | None, lease_id: str, pin_id: str, *, now_ms: int | None = None
    ) -> LeaseUpdate:
        """End whatever a decision whose answer never arrived may have admitted (lua/abandon.lua):
        lease `lease_id` on every provider of `model` becomes an expired record (so an admission
        with it still on its way replays as LEASE_EXPIRED and never admits), and a pin the
        decision made under `pin_id` ends unless another lease holds it. RELEASED when a live
        lease was found, NOT_FOUND when none (the id was never admitted). Idempotent."""
        queue = self._queue_default.get(model)
        if queue is not None:  # the decision's ticket, if it waited, has the lease's id
            queue = QueueArgs(queue.class_rank, queue.may_use_reserved, "", lease_id, "none", queue.max_depth)
        reply = await self._call("abandon", model, session_id or "", [lease_id, pin_id], now_ms, queue=queue)
        return LeaseUpdate(Result(_text(reply[0])), None, int(reply[1]))

    async def probe(self, model: str) -> None:
        """Whether Redis serves `model`'s keys now (lua/probe.lua: a call on them that changes
        nothing): the keys of a new session's admission, so a slot being moved answers TRYAGAIN
        as that admission would (the breaker's probe, extproc.routing.lease_table). A model this
        state does not know is not asked. Raises RedisError when Redis does not serve them."""
        if model in self._model_keys:
            await self._call("probe", model, new_id(), [], None)

    async def leave_queue(self, model: str, queue: QueueArgs, *, now_ms: int | None = None) -> LeaseUpdate:
        """Remove the ticket `queue.ticket` from every queue of `model` (lua/queue_leave.lua): a
        decision that waited ends without a slot from the queue. RELEASED when the ticket was
        there, NOT_FOUND otherwise. Idempotent; a no-op (NOT_FOUND) while the queue is off."""
        if not self.queue_enabled(model):
            return LeaseUpdate(Result.NOT_FOUND, None, 0)
        reply = await self._call("queue_leave", model, "", [], now_ms, queue=queue)
        return LeaseUpdate(Result(_text(reply[0])), None, int(reply[1]))

    def has_configured_limits(self, provider: Provider, model: str) -> bool:
        """The spec's provider_has_configured_limits."""
        return provider.limits(model) is not None

    async def _call(
        self,
        script: str,
        model: str,
        session_id: str,
        op_args: list[object],
        now_ms: int | None,
        with_providers: bool = True,
        extra_keys: tuple[str, ...] = (),
        queue: QueueArgs | None = None,
        share: str | None = None,
    ) -> list:
        """`queue`: the call's admission-queue arguments; None: the model's default (a request of
        the default class without a ticket). Ignored unless the queue is on for the model and the
        script is one of QUEUE_SCRIPTS. Inside `watching_epoch` (and with `epoch_in_script`) the
        script also returns the epoch it saw, recorded in the EpochSeen and taken off the reply."""
        seen = _EPOCH_SEEN.get() if self.epoch_in_script else None
        epoch_flag = "0" if seen is None else "1"
        keys = [
            self.keys.pin(model, session_id),
            self.keys.session_leases(model, session_id),
            self.keys.session_earlier_leases(model, session_id),
        ]
        segments = self._segments
        queue_section: list[object] = ["0"]
        if with_providers:
            keys += segments.model_keys[model]
            shared = share is not None and model in self._share_args
            if shared:
                keys += [self.keys.share_admissions(model, share), self.keys.share_unlimited_admissions(model, share)]
            if script in QUEUE_SCRIPTS and model in self._queue_keys:
                keys += segments.queue_keys[model]
                queue_section = self._queue_section(model, queue or self._queue_default[model])
            constants = segments.model_args_share[model] if shared else segments.model_args[model]
            pick_pairs = bool(self._pick_args[model][0])  # as read_pick reads it: a pair may have no endpoint yet (DNS)
            placing = script in PLACING_SCRIPTS and pick_pairs
            blocks = current_blocks() if placing else ()
            chained = ((current_chained() if placing else None) or ("", "")) if pick_pairs else ()
            args = [
                "" if now_ms is None else now_ms, *constants, *queue_section, epoch_flag,
                *segments.pick_args[model], len(blocks), *blocks, *chained, *op_args,
            ]
        else:
            args = ["" if now_ms is None else now_ms, *segments.without_providers, epoch_flag, 0, 0]
        if seen is not None:
            keys.append(self._epoch_key)
        if with_providers:
            keys += segments.pick_keys[model]
        keys += extra_keys
        reply = await self._run(script, model, keys, args)
        if seen is not None:
            seen.epochs.add(_text(reply.pop()) or None)
        return reply

    async def _run(self, script: str, model: str, keys: list[object], args: list[object]) -> list:
        """One script call over the state's client, with its WAIT when `durable_admissions`
        applies to it. Returns the script's reply."""
        if self._durable is None or script not in ADMITTING_SCRIPTS:
            if self.hot_path is not None:
                return await self.hot_path.evalsha(self._scripts[script], keys, args)
            return await self._scripts[script](self.redis, keys, args)
        if self.hot_path is not None:
            reply, acked = await self.hot_path.evalsha_and_wait(
                self._scripts[script], keys, args, self._durable.replicas, self._durable.timeout_ms
            )
        else:
            reply, acked = await self._scripts[script].call_and_wait(
                self.redis, keys, args, self._durable.replicas, self._durable.timeout_ms
            )
        if acked < self._durable.replicas and _text(reply[0]) == Result.ADMITTED.value:
            self._count_not_replicated(model, acked)
        return reply

    def _queue_section(self, model: str, queue: QueueArgs) -> list[object]:
        """The ARGV queue section of lua/queue.lua."""
        settings = self.config.routing.queue
        return [
            "1", settings.ticket_lease_ms, queue.class_rank, "1" if queue.may_use_reserved else "0", queue.tenant, queue.ticket,
            queue.mode, queue.max_depth, self.keys.queue_wake(model),
        ]

    def _count_not_replicated(self, model: str, acked: int) -> None:
        """An admission answered without the replicas' acknowledgement: it stands (docs/routing-state.md "Durable
        admissions"), is counted, and logged at most every NOT_REPLICATED_LOG_INTERVAL_SECONDS."""

        metrics.ADMISSIONS_NOT_REPLICATED.inc()
        self._not_replicated_since_log += 1
        now = time.monotonic()
        if now - self._not_replicated_logged_at >= NOT_REPLICATED_LOG_INTERVAL_SECONDS:
            log.warning(
                "%d admission(s) not acknowledged by %d replica(s) within %d ms (latest: model %s, %d acknowledged); "
                "they stand, but a failover now may forget them",
                self._not_replicated_since_log, self._durable.replicas, self._durable.timeout_ms, model, acked,
            )
            self._not_replicated_logged_at = now
            self._not_replicated_since_log = 0


class _Segments:
    """The constant parts of a script call, per model, as they go into its keys and arguments:
    lists of the values, or (`packed`) one Packed segment each, encoded once for every call.
    `pick_keys` / `pick_args`: affinity pick's constant keys and arguments (RoutingState._pick_section);
    `model_keys`: the providers' pins and leases keys; `model_args`: timings, provider count and
    limits, then the share section off; `model_args_share`: the same with the share section of
    routing.third_party_share (models it applies to); `queue_keys`: the admission queue's keys
    (models it is on for); `without_providers`: the arguments of a call without providers
    (get_pin) after `now`."""

    def __init__(self, state: RoutingState, packed: bool):
        segment = _packed if packed else list
        self.model_keys = {m: segment(keys) for m, keys in state._model_keys.items()}
        self.model_args = {m: segment([*args, *SHARE_OFF]) for m, args in state._model_args.items()}
        self.model_args_share = {m: segment([*state._model_args[m], *share]) for m, share in state._share_args.items()}
        self.queue_keys = {m: segment(keys) for m, keys in state._queue_keys.items()}
        self.pick_keys = {m: segment(keys) if keys else [] for m, keys in state._pick_keys.items()}
        self.pick_args = {m: segment(args) for m, args in state._pick_args.items()}
        self.without_providers = segment([*state._timing, 0, *SHARE_OFF, "0"])


def _packed(values: list[object]) -> list[object]:
    return [Packed(values)]


def _initial_endpoints(provider: Provider) -> tuple[str, ...]:
    """The endpoints of pick `provider` when its config is loaded. A DNS name that does not
    resolve yet (a headless Service with no ready replica answers NXDOMAIN) gives none: every
    admission on the pair is refused as at its cap until the refresh finds an address
    (extproc.routing.endpoint_refresh); URLs were resolved when the config was validated."""
    try:
        return pick_endpoints(provider.endpoints)
    except EndpointError as exc:
        log.warning("provider %s: no endpoint yet (%s); its requests go elsewhere until the name resolves", provider.name, exc)
        return ()


def _limits_args(config: Config, model: str, providers: list[Provider]) -> list[object]:
    """Per provider: name and the spec's four limits. The pin limit of a pair that configures
    none is config.max_pinned_sessions_unlimited (Config.pin_limit), so the scripts bound it
    through the spec's own PIN_LIMIT_REACHED path."""
    out: list[object] = []
    for provider in providers:
        limits = provider.limits(model)
        max_pins = _limit(config.pin_limit(provider, model)[0])
        if limits is None:
            out += [provider.name, max_pins, NO_LIMIT, 0, NO_LIMIT]
            continue
        out += [
            provider.name,
            max_pins,
            _limit(limits.max_global_in_flight_request_slots),
            limits.global_in_flight_request_slots_reserved_for_pinned_sessions,
            _limit(limits.max_per_session_in_flight_request_slots),
        ]
    return out


def _limit(value: int | None) -> int:
    return NO_LIMIT if value is None else value


def _renewal(reply: list) -> LeaseUpdate:
    """A renew.lua (or move_endpoint_lease.lua) answer for one lease."""
    return LeaseUpdate(Result(_text(reply[0])), _int_or_none(reply[7]), int(reply[1]))


def _release(reply: list) -> LeaseUpdate:
    """A release.lua answer for one lease."""
    return LeaseUpdate(Result(_text(reply[0])), None, int(reply[1]))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _int_or_none(value: bytes | str | int) -> int | None:
    return None if value in (b"", "") else int(value)


def _decode(model: str, session_id: str | None, reply: list, lease_provider: str | None = None) -> Admission:
    """`lease_provider`: the pair the admission targets (None: the pin's, for admit_pinned). A
    repeated admission answers with the session's current pin, which may be on another provider
    than the lease it replays, so the lease's provider never comes from the pin otherwise."""
    result, now, provider, pin_id, deadline, expiry, lease_id, lease_deadline, endpoints = reply
    pin = None
    if provider not in (b"", ""):
        pin = Pin(_text(provider), _text(pin_id), int(deadline), int(expiry))
    lease = None
    result = Result(_text(result))
    if result is Result.ADMITTED:
        lease = Lease(
            model=model,
            provider=lease_provider or pin.provider,
            id=_text(lease_id),
            session_id=session_id if pin else None,
            pin_id=pin.id if pin else None,
            deadline_ms=int(lease_deadline),
            endpoints=tuple(_text(endpoints).split(",")) if endpoints not in (b"", "") else (),
        )
    return Admission(result, pin, lease, int(now))
