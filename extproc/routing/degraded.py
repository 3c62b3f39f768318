"""Degraded flags per (provider, model), shared by every proxy through Redis.

The spec's `provider.degraded(model)`: a pair is degraded while any of its flags holds. There is
one flag per source, so that one source never clears another's (an automatic health recovery
never ends an operator's drain):

- `manual`: `iris-extproc drain` / `undrain`;
- `health`: the active health check (extproc.operations.health);
- `passive`: upstream failures in a sliding window (extproc.operations.health);
- `load`: a Prometheus gauge over its threshold (extproc.operations.health);
- `connect`: Envoy saw the provider refuse the connection or reset it before the response
  headers; short-lived, set at once by the instance that saw it and cleared by the pair's next
  2xx or a healthy check (extproc.operations.health);
- `endpoints` (derived, never written): a pair with affinity `pick` whose every endpoint is out
  (extproc.routing.endpoint_health), read with the flags in the same pipelined round trip.

A flag is a Redis string ``{prefix:model}:degraded:<provider>:<source>`` whose value says why (for
example `manual: drained by ops`) and whose TTL bounds how long it holds without being renewed.
Routing reads a local snapshot that `refresh` (run every `server.degraded_refresh_seconds` by
`run_refresher`) reloads with one pipelined round trip (one GET per flag: no command spans two
keys, so a Redis Cluster splits the pipeline per node, one round trip each), so the hot path never
waits on it and all proxies agree within one refresh interval.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from redis.asyncio import Redis

from extproc.config import Config, ProviderKind
from extproc.config.endpoints import pick_endpoints
from extproc.routing.endpoint_health import live_flags
from extproc.storage.client import REDIS_FAILURES
from extproc.storage.keys import Keyspace
from extproc.supervision import run_every

log = logging.getLogger(__name__)

DEFAULT_MANUAL_TTL_SECONDS = 7 * 24 * 3600

MANUAL = "manual"
HEALTH = "health"
PASSIVE = "passive"
LOAD = "load"
CONNECT = "connect"
SOURCES = (MANUAL, HEALTH, PASSIVE, LOAD, CONNECT)
ENDPOINTS = "endpoints"  # derived: every endpoint of a pick pair is out


@dataclass(frozen=True, slots=True)
class Flag:
    """One flag as extproc.operations.fleet_state reads it: its source, why, and the seconds it still holds
    (None: no TTL)."""

    source: str
    reason: str
    ttl_seconds: float | None


class DegradedFlags:
    """Set, clear and read degraded flags. Only managed providers can be degraded (the spec)."""

    def __init__(self, redis: Redis, config: Config):
        self.redis = redis
        self.keys = Keyspace(config.redis.key_prefix)
        self._flags: dict[tuple[str, str], dict[str, str]] = {}
        self._writes = 0  # local set/clear calls so far: a refresh begun before one is stale
        self.reconfigure(config)

    def reconfigure(self, config: Config) -> None:
        """Follow a reloaded config's managed pairs (extproc.operations.reload); the snapshot is kept until
        the next refresh reads the new pairs' flags."""
        pairs = [(p.name, model) for p in config.providers if p.kind is ProviderKind.MANAGED for model in p.models]
        # Per model: the (provider, source) of each of its flag keys.
        by_model: dict[str, list[tuple[str, str]]] = {}
        for provider, model in pairs:
            by_model.setdefault(model, []).extend((provider, source) for source in SOURCES)
        self._pairs, self._by_model = pairs, by_model
        # Pick pairs: (provider, model) -> their endpoints (`ip:port`).
        self._pick_pairs = {
            (p.name, model): pick_endpoints(p.endpoints)
            for p in config.providers if p.kind is ProviderKind.MANAGED and p.picks for model in p.models
        }
        self._writes += 1  # a refresh under way read the old pairs: drop it

    def is_degraded(self, provider: str, model: str) -> bool:
        """From the last snapshot; never touches Redis."""
        return (provider, model) in self._flags

    def reasons(self) -> dict[tuple[str, str], str]:
        """The last snapshot: (provider, model) -> why it is degraded (every source's reason,
        joined by "; ")."""
        return {pair: "; ".join(by_source.values()) for pair, by_source in self._flags.items()}

    def flags(self, provider: str, model: str) -> dict[str, str]:
        """The last snapshot of one pair: source -> reason."""
        return dict(self._flags.get((provider, model), {}))

    def pairs(self, provider: str | None = None, model: str | None = None) -> list[tuple[str, str]]:
        """The managed (provider, model) pairs, optionally narrowed to one provider or model."""
        return [
            (p, m) for p, m in self._pairs if provider in (None, p) and model in (None, m)
        ]

    async def set(
        self, provider: str, model: str, reason: str, ttl_seconds: float, source: str = MANUAL
    ) -> None:
        """Mark the pair degraded by `source` for `ttl_seconds` (seconds). Raises RedisError,
        or ValueError for an unknown source."""
        key = self._key(provider, model, source)
        await self.redis.set(key, reason, px=max(1, round(ttl_seconds * 1000)))
        self._note(provider, model, source, reason)

    async def clear(self, provider: str, model: str, source: str = MANUAL) -> bool:
        """Clear the pair's flag of `source` only; True when it was set. Raises RedisError, or
        ValueError for an unknown source."""
        deleted = await self.redis.delete(self._key(provider, model, source))
        self._note(provider, model, source, None)
        return bool(deleted)

    async def set_many(
        self, pairs: list[tuple[str, str]], reason: str, ttl_seconds: float, source: str
    ) -> None:
        """`set` for several pairs in one pipelined round trip. Raises RedisError."""
        px = max(1, round(ttl_seconds * 1000))
        async with self.redis.pipeline(transaction=False) as pipe:
            for provider, model in pairs:
                pipe.set(self._key(provider, model, source), reason, px=px)
            await pipe.execute()
        for provider, model in pairs:
            self._note(provider, model, source, reason)

    async def clear_many(self, pairs: list[tuple[str, str]], source: str) -> None:
        """`clear` for several pairs in one pipelined round trip. Raises RedisError."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for provider, model in pairs:
                pipe.delete(self._key(provider, model, source))
            await pipe.execute()
        for provider, model in pairs:
            self._note(provider, model, source, None)

    async def refresh(self) -> dict[tuple[str, str], str]:
        """Reload the snapshot from Redis (one pipelined round trip: the flags, and the endpoint
        flags of pick pairs for the derived `endpoints` source). A reload that began before
        a local `set` or `clear` finished is dropped (it may predate the write), so this instance
        never un-sees its own flag. Raises RedisError."""
        writes = self._writes
        flag_keys = [(model, provider, source) for model, pairs in self._by_model.items() for provider, source in pairs]
        async with self.redis.pipeline(transaction=False) as pipe:
            for model, provider, source in flag_keys:
                pipe.get(self.keys.degraded(model, provider, source))
            pick_pairs = list(self._pick_pairs.items())
            for (provider, model), _ in pick_pairs:
                pipe.hgetall(self.keys.endpoint_health(model, provider))
            replies = await pipe.execute()
        flags: dict[tuple[str, str], dict[str, str]] = {}
        for (model, provider, source), value in zip(flag_keys, replies):
            if value is not None:
                flags.setdefault((provider, model), {})[source] = _text(value)
        now_ms = time.time() * 1000  # the flags' until is Redis time: a snapshot's hint, as its TTLs
        for (pair, endpoints), raw in zip(pick_pairs, replies[len(flag_keys):]):
            out = {flag.endpoint for flag in live_flags(raw, now_ms)}
            if endpoints and out.issuperset(endpoints):
                flags.setdefault(pair, {})[ENDPOINTS] = f"endpoints: every endpoint out ({', '.join(endpoints)})"
        if self._writes == writes:
            self._flags = flags
        return self.reasons()

    async def run_refresher(self, interval_seconds: float) -> None:
        """Refresh every `interval_seconds` until cancelled; a failed refresh keeps the old
        snapshot and is retried at the next tick. Supervised (extproc.supervision): any other
        exception is counted under task `degraded_refresh` and the refresh restarts."""
        await run_every("degraded_refresh", self._refresh_once, interval_seconds)

    async def _refresh_once(self) -> None:
        try:
            await self.refresh()
        except REDIS_FAILURES as exc:
            log.warning("degraded flags not refreshed: %s", exc)

    def _key(self, provider: str, model: str, source: str) -> str:
        if source not in SOURCES:
            raise ValueError(f"unknown degraded-flag source {source!r}")
        return self.keys.degraded(model, provider, source)

    def _note(self, provider: str, model: str, source: str, reason: str | None) -> None:
        by_source = dict(self._flags.get((provider, model), {}))
        if reason is None:
            by_source.pop(source, None)
        else:
            by_source[source] = reason
        self._writes += 1
        flags = dict(self._flags)  # copy on write: readers may hold the old snapshot
        if by_source:
            flags[(provider, model)] = {s: by_source[s] for s in (*SOURCES, ENDPOINTS) if s in by_source}
        else:
            flags.pop((provider, model), None)
        self._flags = flags


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
