"""Routing while Redis cannot be reached: the circuit breaker and the outage policy.

The breaker opens only on sustained failure (`redis.breaker_failures_in_a_row` failed calls in a
row); a call that found the connection pool busy is load, not a failure, and a single slow reply
is one failure. While it is open, decisions go straight to the policy and a probe brings shared
routing back (extproc.lease_table.LeaseTable.recover adopts what was held meanwhile).

`redis.outage_policy` (docs/routing-state.md "When Redis is gone"):
- `degrade`: only pairs without an in-flight limit take new requests (third parties, pairs
  without limits); own providers keep the requests they already run and take none.
- `local_share`: as `degrade`, and a managed pair also takes requests while the leases this
  instance holds there (admitted by Redis before the outage or locally during it) are fewer than
  floor((max_global_in_flight_request_slots - reserved) / N), N the live instances last seen.
- `fail_closed`: 503 `routing_unavailable` (decided by the caller).
No pins are made or read during an outage (requests are temporary).

This module decides where a request may go; the lease table holds the leases.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable

from redis.asyncio import Redis

from extproc.config import Config, Provider
from extproc.routing.router import Rejection, RejectionKind, Router, RoutingRequest
from extproc.storage.client import is_pool_exhausted, redis_time_ms
from extproc.storage.keys import Keyspace

log = logging.getLogger(__name__)


class InstanceRegistry:
    """Each proxy instance's heartbeat in Redis (a sorted set scored by heartbeat deadline, ms),
    so every instance knows how many are live: the divisor of the local shares. `description`
    (bytes, opaque here; extproc.operations.fleet_state writes and reads it) is kept beside the
    entry for as long as it lives, so `iris-extproc status` can tell what the fleet runs."""

    def __init__(self, redis: Redis, key_prefix: str, ttl_seconds: float = 5.0):
        self.redis = redis
        keys = Keyspace(key_prefix)
        self.key = keys.instances()
        self.instance_id = uuid.uuid4().hex
        self.description_key = keys.instance(self.instance_id)
        self.description: bytes | None = None
        self.ttl_ms = round(ttl_seconds * 1000)
        self.live_instances: int | None = None  # None: never seen Redis

    async def heartbeat(self) -> int:
        """Renew this instance's entry (and its description) and return the number of live
        instances. Raises RedisError."""
        now = await redis_time_ms(self.redis, self.key)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.zadd(self.key, {self.instance_id: now + self.ttl_ms})
            pipe.zremrangebyscore(self.key, "-inf", now)
            pipe.zcount(self.key, f"({now}", "+inf")
            pipe.pexpire(self.key, self.ttl_ms * 2)
            if self.description is not None:
                pipe.set(self.description_key, self.description, px=self.ttl_ms)
            replies = await pipe.execute()
        self.live_instances = max(1, int(replies[2]))
        return self.live_instances

    async def leave(self) -> None:
        """Remove this instance (at shutdown). Raises RedisError."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.zrem(self.key, self.instance_id)
            pipe.delete(self.description_key)
            await pipe.execute()


class OutagePolicy:
    """Where a request may go without Redis under `degrade` or `local_share` (module docstring)."""

    def __init__(self, config: Config, router: Router, registry: InstanceRegistry):
        self.config = config
        self.router = router
        self.registry = registry

    def reconfigure(self, config: Config, router: Router) -> None:
        """Follow a reloaded config (extproc.operations.reload): shares and providers from now on; the
        leases held keep counting against their pairs (the lease table counts them)."""
        self.config = config
        self.router = router

    def share(self, provider: Provider, model: str) -> int | None:
        """The most leases this instance may hold on the pair during an outage; None: the pair
        has no in-flight limit. 0 under `degrade`, and when no instance count was ever seen
        (an instance that never reached Redis cannot know its share)."""
        limits = provider.limits(model)
        if limits is None or limits.max_global_in_flight_request_slots is None:
            return None
        live = self.registry.live_instances
        if self.config.redis.outage_policy != "local_share" or not live:
            return 0
        unreserved = limits.max_global_in_flight_request_slots - limits.global_in_flight_request_slots_reserved_for_pinned_sessions
        return max(0, unreserved) // live

    def choose(self, request: RoutingRequest, held: Callable[[str, str], int], shares: bool = True) -> Provider | Rejection:
        """The first provider in priority order that supports the request, is not degraded (last
        snapshot) and has room: no in-flight limit, or `held(provider, model)` (every lease this
        instance holds on the pair) under its share. `shares=False`: managed pairs take nothing
        (as under `degrade`, whatever the policy: the epoch grace of extproc.routing.lease_table)."""
        for provider in self.router.eligible(request):
            share = self.share(provider, request.model)
            if share is not None and not shares:
                share = 0
            if share is None or held(provider.name, request.model) < share:
                return provider
        rejection = self.router.reject_request_as_unsupported_or_unavailable(request)
        if rejection.kind is RejectionKind.CAPACITY:
            return Rejection(RejectionKind.UNAVAILABLE, "the routing state is unreachable and no provider without a limit can take the request")
        return rejection


class RedisBreaker:
    """Open after `failures_in_a_row` failed Redis calls in a row (pool exhaustion excluded), so
    decisions stop waiting on Redis; a success resets the run. Failures are counted per scope, so
    that a shard's trouble costs only what lives there (issue 29): the scope of a model (its keys
    share one hash tag, so one Cluster slot: decisions, renewals, adoptions and chain records of
    the model) and the fleet's scope (`model=None`: the epoch and the instance registry, tag
    `{prefix}`). An open model scope sends that model's decisions to the outage policy and stops
    its renewals; an open fleet scope sends every model's decisions there (without the epoch no
    decision can be checked) but stops no renewal. The lease table's recovery closes each scope
    once Redis serves it again (extproc.routing.lease_table.LeaseTable.recover: its adoptions, or
    a probe call on the model's keys, are the probes; `redis` is not asked here any more and
    stays for the callers)."""

    def __init__(self, redis: Redis, failures_in_a_row: int = 3):
        self.redis = redis
        self.failures_in_a_row = failures_in_a_row
        self.failures: Counter[str | None] = Counter()  # the current run of failures per scope
        self.failures_seen = 0  # every failure since start (the lease table's epoch grace asks)
        self.open_since: dict[str | None, float] = {}  # scope -> monotonic s it opened

    @property
    def is_open(self) -> bool:
        """Whether any scope is open (the gauge iris_redis_breaker_open)."""
        return bool(self.open_since)

    @property
    def fleet_open(self) -> bool:
        """Whether the fleet's scope is open: every decision follows the outage policy."""
        return None in self.open_since

    @property
    def open_models(self) -> frozenset[str]:
        """The models whose own scope is open."""
        return frozenset(scope for scope in self.open_since if scope is not None)

    def open_for(self, model: str) -> bool:
        """Whether `model`'s decisions follow the outage policy (its scope or the fleet's is open)."""
        return model in self.open_since or None in self.open_since

    def record_failure(self, error: BaseException, model: str | None = None) -> None:
        """Count one failed call (a RedisError or a timeout) of `model`'s scope (None: the
        fleet's). A busy pool is not counted."""
        if is_pool_exhausted(error):
            return
        self.failures[model] += 1
        self.failures_seen += 1
        if self.failures[model] >= self.failures_in_a_row:
            self.trip(error, model)

    def record_success(self, model: str | None = None) -> None:
        self.failures[model] = 0

    def trip(self, error: BaseException, model: str | None = None) -> None:
        """Open `model`'s scope (None: the fleet's) now (outage policy in force there)."""
        self.failures_seen += 1
        if model not in self.open_since:
            what = "routing state" if model is None else f"routing state of model {model}"
            log.warning("%s unreachable (%s): outage policy in force", what, type(error).__name__)
            self.open_since[model] = time.monotonic()

    def hold_until_recovered(self, model: str) -> None:
        """Open `model`'s scope, no failure counted, until its recovery adopts what it holds
        (the fleet's scope closes: the model's leases were decided or renewed without it)."""
        self.open_since.setdefault(model, time.monotonic())

    def close(self, model: str | None = None) -> None:
        """Close `model`'s scope (None: the fleet's)."""
        self.failures[model] = 0
        opened = self.open_since.pop(model, None)
        if opened is not None:
            what = "routing state" if model is None else f"routing state of model {model}"
            log.warning("%s reachable again after %.1f s", what, time.monotonic() - opened)
