"""Degraded flags per (provider, model), shared by every proxy through Redis.

The spec's `provider.degraded(model)`. A flag is a Redis string whose value says why (for
example `manual: drained by ops`) and whose TTL bounds how long it holds without being renewed.
Routing reads a local snapshot that `refresh` (run every `server.degraded_refresh_seconds` by
`run_refresher`) reloads with one pipelined round trip, so the hot path never waits on it and all
proxies agree within one refresh interval.
"""

from __future__ import annotations

import asyncio
import logging

from redis.asyncio import Redis
from redis.exceptions import RedisError

from extproc.config import Config, ProviderKind
from extproc.state import Keyspace

log = logging.getLogger(__name__)

DEFAULT_MANUAL_TTL_SECONDS = 7 * 24 * 3600


class DegradedFlags:
    """Set, clear and read degraded flags. Only managed providers can be degraded (the spec)."""

    def __init__(self, redis: Redis, config: Config):
        self.redis = redis
        self.keys = Keyspace(config.redis.key_prefix)
        self._pairs = [
            (p.name, model)
            for p in config.providers
            if p.kind is ProviderKind.MANAGED
            for model in p.models
        ]
        self._reasons: dict[tuple[str, str], str] = {}

    def is_degraded(self, provider: str, model: str) -> bool:
        """From the last snapshot; never touches Redis."""
        return (provider, model) in self._reasons

    def reasons(self) -> dict[tuple[str, str], str]:
        """The last snapshot: (provider, model) -> why it is degraded."""
        return dict(self._reasons)

    def pairs(self, provider: str | None = None, model: str | None = None) -> list[tuple[str, str]]:
        """The managed (provider, model) pairs, optionally narrowed to one provider or model."""
        return [
            (p, m) for p, m in self._pairs if provider in (None, p) and model in (None, m)
        ]

    async def set(self, provider: str, model: str, reason: str, ttl_seconds: float) -> None:
        """Mark the pair degraded for `ttl_seconds` (seconds). Raises RedisError."""
        await self.redis.set(self.keys.degraded(model, provider), reason, px=max(1, round(ttl_seconds * 1000)))
        self._reasons[(provider, model)] = reason

    async def clear(self, provider: str, model: str) -> None:
        """Clear the pair's flag. Raises RedisError."""
        await self.redis.delete(self.keys.degraded(model, provider))
        self._reasons.pop((provider, model), None)

    async def refresh(self) -> dict[tuple[str, str], str]:
        """Reload the snapshot from Redis (one pipelined round trip). Raises RedisError."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for provider, model in self._pairs:
                pipe.get(self.keys.degraded(model, provider))
            values = await pipe.execute()
        self._reasons = {
            pair: value.decode() if isinstance(value, bytes) else value
            for pair, value in zip(self._pairs, values)
            if value is not None
        }
        return self.reasons()

    async def run_refresher(self, interval_seconds: float) -> None:
        """Refresh every `interval_seconds` until cancelled; a failed refresh keeps the old
        snapshot and is retried at the next tick."""
        while True:
            try:
                await self.refresh()
            except RedisError as exc:
                log.warning("degraded flags not refreshed: %s", exc)
            await asyncio.sleep(interval_seconds)
