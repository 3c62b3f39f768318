"""Reading the fleet's routing state from Redis: per (provider, model) pair its live request
leases and pins against the limits, its degraded flags, and the live proxy instances.

The one reader of fleet state, used by the metrics collector (extproc.metrics, at scrape time)
and by `iris-extproc status`, through the configured topology's client (extproc.storage.client:
standalone, Cluster or Sentinel). The collector runs in the metrics server's thread; it reads on
the event loop (`on_loop`), waiting for the answer in its own thread, and reuses a read for about
a second (`CachedFleetState`).

Cost is bounded: one pipelined round trip per read, holding one read-only script per model
(lua/fleet_state.lua: a ZCOUNT of each pair's pins and leases, GET and PTTL of each flag; a
model's keys share one hash slot, so a cluster runs each on one node) and one ZCOUNT of the
instance registry. Counts are taken at Redis `TIME`, as the routing scripts count: an expired
lease or pin never counts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import orjson
from redis.exceptions import TimeoutError as RedisTimeoutError

from extproc.config import Config, ConfigError, ProviderKind, parse_config
from extproc.routing.degraded import MANUAL, SOURCES, Flag
from extproc.routing.endpoint_health import EndpointFlag, live_flags
from extproc.routing.state import script_body
from extproc.storage.client import RedisClient
from extproc.storage.keys import Keyspace

_INSTANCES_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return redis.call('ZCOUNT', KEYS[1], '(' .. now, '+inf')
"""
_LIVE_INSTANCE_IDS_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf')
"""


@dataclass(frozen=True, slots=True)
class PairState:
    """One (provider, model) pair. Counts are live at read time; a limit of None means none is
    configured (the pair is unlimited in that respect). `flags`: its degraded flags, only for
    managed providers (unlimited ones are never degraded, the spec)."""

    provider: str
    kind: str
    model: str
    in_flight: int
    in_flight_limit: int | None
    reserved_for_pinned: int
    pins: int
    pin_limit: int | None
    flags: list[Flag] = field(default_factory=list)
    queued: dict[str, int] = field(default_factory=dict)  # live tickets per priority class (docs/queue.md); {} while off
    # Affinity pick: the flags that take endpoints out of placement (extproc.routing.endpoint_health).
    endpoint_flags: list[EndpointFlag] = field(default_factory=list)

    @property
    def state(self) -> str:
        """`healthy`, `degraded` (automatic flags only) or `drained` (an operator's flag holds)."""
        if not self.flags:
            return "healthy"
        return "drained" if any(f.source == MANUAL for f in self.flags) else "degraded"


@dataclass(frozen=True, slots=True)
class FleetState:
    """A consistent-per-model snapshot: `now_ms` is Redis time (ms) of the read; `pairs` in
    priority order; `live_instances` the proxy instances whose heartbeat holds."""

    now_ms: int
    live_instances: int
    pairs: list[PairState]

    def as_dict(self) -> dict:
        """A JSON-ready dict (the shape of `iris-extproc status --json`)."""
        return {
            "now_ms": self.now_ms,
            "live_instances": self.live_instances,
            "pairs": [{**asdict(p), "state": p.state} for p in self.pairs],
        }


class FleetStateReader:
    """Reads a FleetState from Redis through `redis` (an asyncio client of extproc.storage.client)."""

    def __init__(self, config: Config, redis: RedisClient):
        self.redis = redis
        self._script = script_body("fleet_state")
        self._instances_key = Keyspace(config.redis.key_prefix).instances()
        self.reconfigure(config)

    def reconfigure(self, config: Config) -> None:
        """Read the pairs of `config` from now on (extproc.operations.reload; the key prefix stays)."""
        keys = Keyspace(config.redis.key_prefix)
        # Per model: the providers serving it (priority order), the keys and the managed flags.
        models: list[tuple[str, list, list[str], list[tuple[str, str]]]] = []
        queue = config.routing.queue
        for model in config.models():
            providers = config.providers_for(model)
            flags = [(p.name, s) for p in providers if p.kind is ProviderKind.MANAGED for s in SOURCES]
            key_list = [k for p in providers for k in (keys.provider_pins(model, p.name), keys.provider_leases(model, p.name))]
            key_list += [keys.degraded(model, provider, source) for provider, source in flags]
            if queue.enabled(model):
                key_list += [keys.tickets(model), *(keys.queue(model, p.name) for p in providers)]
            models.append((model, providers, key_list, flags))
        # Pick pairs: their endpoint health hashes, read in the same pipeline.
        self._endpoint_health = [
            (p.name, model, keys.endpoint_health(model, p.name))
            for p in config.providers if p.kind is ProviderKind.MANAGED and p.picks for model in p.models
        ]
        self._read_plan = (config, models)

    @property
    def config(self) -> Config:
        return self._read_plan[0]

    async def read(self) -> FleetState:
        """One pipelined round trip. Raises redis.exceptions.RedisError."""
        config, models = self._read_plan  # one config's plan, whatever a reload does meanwhile
        async with self.redis.pipeline(transaction=False) as pipe:
            for model, providers, key_list, flag_keys in models:
                classes = len(config.routing.queue.classes) if config.routing.queue.enabled(model) else 0
                pipe.eval(self._script, len(key_list), *key_list, len(providers), len(flag_keys), classes)
            endpoint_health = self._endpoint_health
            for _, _, key in endpoint_health:
                pipe.hgetall(key)
            pipe.eval(_INSTANCES_SCRIPT, 1, self._instances_key)
            replies = await pipe.execute()
        endpoint_replies = replies[len(models) : len(models) + len(endpoint_health)]
        by_pair: dict[tuple[str, str], PairState] = {}
        now_ms = 0
        for (model, providers, _, flag_keys), reply in zip(models, replies):
            now_ms = max(now_ms, int(reply[0]))
            counts = reply[1 : 1 + 2 * len(providers)]
            flag_replies = reply[1 + 2 * len(providers) : 1 + 2 * len(providers) + 2 * len(flag_keys)]
            queued = reply[1 + 2 * len(providers) + 2 * len(flag_keys) :]
            class_names = [c.name for c in config.routing.queue.classes]
            flags: dict[str, list[Flag]] = {}
            for i, (provider, source) in enumerate(flag_keys):
                value, pttl = flag_replies[2 * i], flag_replies[2 * i + 1]
                if value is not None:
                    ttl = int(pttl) / 1000 if int(pttl) >= 0 else None
                    flags.setdefault(provider, []).append(Flag(source, _text(value), ttl))
            for i, provider in enumerate(providers):
                limits = provider.limits(model)
                by_pair[(provider.name, model)] = PairState(
                    provider=provider.name,
                    kind=provider.kind.value,
                    model=model,
                    in_flight=int(counts[2 * i + 1]),
                    in_flight_limit=limits.max_global_in_flight_request_slots if limits else None,
                    reserved_for_pinned=limits.global_in_flight_request_slots_reserved_for_pinned_sessions if limits else 0,
                    pins=int(counts[2 * i]),
                    pin_limit=self.config.pin_limit(provider, model)[0],  # the cap where none is configured
                    flags=flags.get(provider.name, []),
                    queued={name: int(queued[i * len(class_names) + c]) for c, name in enumerate(class_names)} if queued else {},
                )
        for (provider_name, model, _), raw in zip(endpoint_health, endpoint_replies):
            if (provider_name, model) in by_pair and raw:
                by_pair[(provider_name, model)] = replace(by_pair[(provider_name, model)], endpoint_flags=live_flags(raw, now_ms))
        pairs = [by_pair[(p.name, m)] for p in config.providers_in_priority_order() for m in p.models]
        return FleetState(now_ms, int(replies[-1]), pairs)


def on_loop(reader: FleetStateReader, loop: asyncio.AbstractEventLoop, timeout_seconds: float) -> Callable[[], FleetState]:
    """A blocking read for another thread: `reader.read()` runs on `loop` (where its client
    lives) and the caller waits up to `timeout_seconds` (seconds) for it. Raises RedisError
    (redis.exceptions.TimeoutError when the answer takes longer)."""

    def read() -> FleetState:
        future = asyncio.run_coroutine_threadsafe(reader.read(), loop)
        try:
            return future.result(timeout_seconds)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise RedisTimeoutError(f"the fleet state was not read within {timeout_seconds} s") from None

    return read


class CachedFleetState:
    """A blocking fleet-state read (`read`, for example `on_loop(...)`) whose result is reused
    for `max_age_seconds` (seconds), so concurrent or frequent scrapes cost Redis at most one
    read per interval. Thread-safe: the metrics server answers each scrape in a thread of its own."""

    def __init__(self, read: Callable[[], FleetState], max_age_seconds: float = 1.0):
        self.read = read
        self.max_age_seconds = max_age_seconds
        self._lock = threading.Lock()
        self._read_at = float("-inf")
        self._state: FleetState | None = None
        self.last_read_seconds = 0.0

    def get(self) -> FleetState:
        """The cached state, read again when older than `max_age_seconds`. Raises RedisError
        (a failed read is not cached: the next scrape tries again)."""
        with self._lock:
            if self._state is None or time.monotonic() - self._read_at >= self.max_age_seconds:
                started = time.monotonic()
                self._state = None
                self._state = self.read()
                self._read_at = time.monotonic()
                self.last_read_seconds = self._read_at - started
            return self._state


def instance_description(config: Config) -> bytes:
    """What a running instance advertises beside its heartbeat (extproc.routing.outage.InstanceRegistry):
    its routing config as JSON, the fields its file set, without `server` and with `redis` reduced
    to `key_prefix` and `outage_policy`, so no address or credential reaches Redis. About 2.5 kB
    for envoy/example-config.yaml."""
    data = config.model_dump(mode="json", exclude_unset=True)
    data.pop("server", None)
    data["redis"] = {"key_prefix": config.redis.key_prefix, "outage_policy": config.redis.outage_policy}
    return orjson.dumps({"config": data})


@dataclass(frozen=True, slots=True)
class RunningInstance:
    """A live proxy instance as it advertises itself: `config` is the routing config it runs (its
    `redis` holds only key_prefix and outage_policy), None when its description is missing or
    unreadable (an instance of a version that writes none, or another schema)."""

    instance_id: str
    config: Config | None
    description: bytes | None


async def read_running_instances(redis: RedisClient, key_prefix: str) -> list[RunningInstance]:
    """The live instances under `key_prefix` with what each advertises: two round trips (the
    live ids at Redis time, then their descriptions). Raises redis.exceptions.RedisError."""
    keys = Keyspace(key_prefix)
    ids = [_text(i) for i in await redis.eval(_LIVE_INSTANCE_IDS_SCRIPT, 1, keys.instances())]
    if not ids:
        return []
    async with redis.pipeline(transaction=False) as pipe:
        for instance_id in ids:
            pipe.get(keys.instance(instance_id))
        descriptions = await pipe.execute()
    return [RunningInstance(i, _described_config(d), d) for i, d in zip(ids, descriptions)]


def _described_config(description: bytes | None) -> Config | None:
    if description is None:
        return None
    try:
        return parse_config(orjson.loads(description)["config"])
    except (ConfigError, orjson.JSONDecodeError, KeyError, TypeError):
        return None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
