"""A lease table over a real Redis for the lease-table tests (tests/unit/routing/test_lease_table.py,
test_lease_settlement.py): the table, a chat request of model m, and the live leases Redis holds."""

from __future__ import annotations

from extproc.config import parse_config
from extproc.routing.degraded import DegradedFlags
from extproc.routing.lease_table import LeaseTable
from extproc.routing.outage import InstanceRegistry, OutagePolicy, RedisBreaker
from extproc.routing.router import Router, RoutingRequest
from extproc.routing.state import RoutingState
from tests.support.configs import small_config_data


def chat(session: str | None) -> RoutingRequest:
    """A chat request of model m for `session` (None: sessionless)."""
    return RoutingRequest("m", "chat", frozenset(), session)


def make_table(client, redis_url, hot_path=None, lease_timeout: float = 0.3, **overrides) -> LeaseTable:
    """A started lease table over `client` (redis-py), its routing scripts over `hot_path` when
    given (a PipelinedRedis), leases of `lease_timeout` seconds; `overrides` go to the config."""
    config = parse_config(small_config_data(redis_url, lease_timeout_seconds=lease_timeout, **overrides))
    state = RoutingState(client, config, hot_path=hot_path)
    router = Router(config, state, DegradedFlags(client, config))
    registry = InstanceRegistry(client, config.redis.key_prefix)
    table = LeaseTable(config, state, router, OutagePolicy(config, router, registry), RedisBreaker(client, 3))
    table.start()
    return table


async def live(redis, table: LeaseTable, provider: str = "iris-1") -> int:
    """The leases of (provider, m) live in Redis now (by Redis's clock)."""
    seconds, micros = await redis.time()
    return await redis.zcount(table.state.keys.provider_leases("m", provider), f"({seconds * 1000 + micros // 1000}", "+inf")
