"""Routing while Redis cannot be reached: the outage policy.

`fail_closed` answers 503 for the whole outage. `degrade` routes without shared state: unlimited
providers as usual, own providers only within a local budget of each pair's unreserved in-flight
slots divided by the number of live proxy instances last seen in Redis, so the fleet as a whole
stays within the limit. No pins are made or read during an outage (requests are temporary).

A circuit breaker keeps requests from paying Redis timeouts one after another: after a failure,
decisions go straight to the policy until a background probe reaches Redis again. Then shared
routing resumes by itself, and the local leases still running are adopted into Redis, so they
count there (and no longer locally) until released: nothing is counted twice or lost.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter

from redis.asyncio import Redis
from redis.exceptions import RedisError

from extproc.config import Config, Provider
from extproc.routing import Decision, Reason, Rejection, RejectionKind, Router, RoutingRequest
from extproc.state import Lease, RoutingState

log = logging.getLogger(__name__)


class InstanceRegistry:
    """Each proxy instance's heartbeat in Redis (a sorted set scored by heartbeat deadline, ms),
    so every instance knows how many are live: the divisor of the local budgets."""

    def __init__(self, redis: Redis, key_prefix: str, ttl_seconds: float = 5.0):
        self.redis = redis
        self.key = f"{{{key_prefix}}}:instances"
        self.instance_id = uuid.uuid4().hex
        self.ttl_ms = round(ttl_seconds * 1000)
        self.live_instances: int | None = None  # None: never seen Redis

    async def heartbeat(self) -> int:
        """Renew this instance's entry and return the number of live instances. Raises RedisError."""
        seconds, micros = await self.redis.time()
        now = seconds * 1000 + micros // 1000
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.zadd(self.key, {self.instance_id: now + self.ttl_ms})
            pipe.zremrangebyscore(self.key, "-inf", now)
            pipe.zcount(self.key, f"({now}", "+inf")
            pipe.pexpire(self.key, self.ttl_ms * 2)
            _, _, count, _ = await pipe.execute()
        self.live_instances = max(1, int(count))
        return self.live_instances

    async def leave(self) -> None:
        """Remove this instance (at shutdown). Raises RedisError."""
        await self.redis.zrem(self.key, self.instance_id)


class LocalBudget:
    """In-flight requests admitted locally during an outage, per (provider, model)."""

    def __init__(self, config: Config):
        self.config = config
        self.in_flight: Counter[tuple[str, str]] = Counter()

    def share(self, provider: Provider, model: str, live_instances: int | None) -> int | None:
        """This instance's slots on the pair: floor(unreserved slots / live instances); None
        means no in-flight limit; 0 when no instance count was ever seen (an instance that
        never reached Redis cannot know its share)."""
        limits = provider.limits(model)
        if limits is None or limits.max_global_in_flight_request_slots is None:
            return None
        if not live_instances:
            return 0
        unreserved = (
            limits.max_global_in_flight_request_slots
            - limits.global_in_flight_request_slots_reserved_for_pinned_sessions
        )
        return max(0, unreserved) // live_instances

    def try_take(self, provider: Provider, model: str, live_instances: int | None) -> bool:
        share = self.share(provider, model, live_instances)
        if share is not None and self.in_flight[(provider.name, model)] >= share:
            return False
        self.in_flight[(provider.name, model)] += 1
        return True

    def give_back(self, provider: str, model: str) -> None:
        self.in_flight[(provider, model)] -= 1


class OutageRouter:
    """Decides without Redis under the `degrade` policy (see the module docstring)."""

    def __init__(self, config: Config, router: Router, registry: InstanceRegistry):
        self.config = config
        self.router = router
        self.registry = registry
        self.budget = LocalBudget(config)
        self.local_leases: dict[str, Lease] = {}  # granted here and not yet adopted into Redis

    def decide(self, request: RoutingRequest) -> Decision | Rejection:
        """The spec's temporary fallback over local budgets: first provider in priority order
        that supports the request, is not degraded (last snapshot) and has local room."""
        for provider in self.router.eligible(request):
            if not self.budget.try_take(provider, request.model, self.registry.live_instances):
                continue
            lease = Lease(request.model, provider.name, uuid.uuid4().hex, None, None, 0)
            self.local_leases[lease.id] = lease
            return Decision(provider, Reason.UNPINNED, lease, None, refresh_pin_on_success=False, local=True)
        rejection = self.router.reject_request_as_unsupported_or_unavailable(request)
        if rejection.kind is RejectionKind.CAPACITY:
            return Rejection(RejectionKind.UNAVAILABLE, "the routing state is unreachable and local budgets are full")
        return rejection

    def release(self, lease: Lease) -> bool:
        """Give back a local lease. Returns False when it was adopted into Redis (the caller then
        releases it there)."""
        if self.local_leases.pop(lease.id, None) is None:
            return False
        self.budget.give_back(lease.provider, lease.model)
        return True

    def is_adopted(self, lease: Lease) -> bool:
        """Whether a lease granted here now lives in Redis."""
        return lease.id not in self.local_leases

    async def adopt_running_leases(self, state: RoutingState) -> int:
        """Write every running local lease into Redis so the shared counts include it from now
        on, and stop counting it locally. Returns how many were adopted. Raises RedisError."""
        adopted = 0
        for lease in list(self.local_leases.values()):
            await state.adopt_request_lease(lease)
            if self.local_leases.pop(lease.id, None) is None:
                # Its request ended while the adoption was on its way: release it in Redis too.
                await state.release_request_lease(lease, refresh_pin=False)
                continue
            self.budget.give_back(lease.provider, lease.model)
            adopted += 1
        return adopted


class RedisBreaker:
    """Open after a Redis failure, so decisions stop waiting on Redis; the server's probe loop
    closes it once Redis answers and the local leases are adopted."""

    def __init__(self, redis: Redis):
        self.redis = redis
        self.open_since: float | None = None

    @property
    def is_open(self) -> bool:
        return self.open_since is not None

    def trip(self, error: Exception) -> None:
        if self.open_since is None:
            log.warning("routing state unreachable (%s): outage policy in force", type(error).__name__)
            self.open_since = time.monotonic()

    async def probe(self) -> bool:
        """Ping Redis. Returns whether it answered."""
        try:
            await self.redis.ping()
        except RedisError:
            return False
        return True

    def close(self) -> None:
        if self.open_since is not None:
            log.warning("routing state reachable again after %.1f s", time.monotonic() - self.open_since)
            self.open_since = None
