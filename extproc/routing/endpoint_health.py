"""Health flags per endpoint of a provider with affinity `pick`, shared by every proxy through Redis
(docs/operations.md "Endpoint health"; issue 30 item 5 "Endpoints come and go").

A pick pair's endpoint is out of placement while any of its flags holds; the placing scripts read
the flags in the same atomic call as the admission (lua/lib.lua `endpoint_down`), so a flag takes
effect on the next decision of every proxy, and a session pinned to a flagged endpoint is placed
again at its next turn while the sessions on the other endpoints keep theirs. The sources are the
pair's (extproc.routing.degraded), per endpoint: `manual` (`iris-extproc drain PROVIDER --endpoint
ip:port`), `health` (the provider's health check URL against each endpoint), `passive` (5xx
bursts of the endpoint), `connect` (Envoy saw the endpoint refuse the connection or reset it
before the headers) and `load` (the engine's own gauge over its threshold, or not read for
`stale_after`). One source never clears another's.

The same hash carries each endpoint's latest engine reading (the count of requests its engine
holds, running and waiting, scraped by the `load` gauge: extproc.operations.health), which
placement weighs beside the router's exact count; a reading is not a flag, and one that is not
renewed lapses at its own deadline.

Layout: one hash per pair, ``{prefix:model}:endpoint-health:<provider>``, field
``"<ip:port> <source>"``, value ``"<until> <reason>"``, and field ``"<ip:port> reading"``, value
``"<until> <requests>"`` (until: Redis time, ms). Every write runs a script that takes Redis
TIME, drops the pair's expired fields and keeps the hash's TTL at its longest field. When
every endpoint of a pair is out, the pair is degraded as any degraded pair
(extproc.routing.degraded reads these flags with its own: source `endpoints`), so the router
answers as it does for a degraded pair (another provider, or `unavailable`); until that
instance's next refresh the scripts find no endpoint to place on and answer the pair full.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from extproc.storage.client import LuaScript, RedisClient
from extproc.storage.keys import Keyspace

# The sources, named as the pair's (extproc.routing.degraded, which imports this module).
MANUAL, HEALTH, PASSIVE, CONNECT, LOAD = "manual", "health", "passive", "connect", "load"
ENDPOINT_SOURCES = (MANUAL, HEALTH, PASSIVE, CONNECT, LOAD)
# The field kind of an engine reading (lua/lib.lua `endpoint_down` tells it from a flag).
READING = "reading"

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# Drops the hash's expired fields and keeps its TTL at its latest deadline.
_KEEP_TTL = """
local latest = 0
local flags = redis.call('HGETALL', KEYS[1])
for i = 1, #flags, 2 do
  local until_ms = tonumber(string.match(flags[i + 1], '^(%d+)')) or 0
  if until_ms <= now then
    redis.call('HDEL', KEYS[1], flags[i])
  else
    latest = math.max(latest, until_ms)
  end
end
if latest > 0 then
  redis.call('PEXPIRE', KEYS[1], latest - now)
end
"""

# KEYS: [1] the pair's endpoint health hash. ARGV: [1] field, [2] ttl ms (0: clear), [3] reason.
# Returns 1 when the field was set before (a clear's answer), else 0.
_WRITE = LuaScript(_NOW + """
local existed = redis.call('HEXISTS', KEYS[1], ARGV[1])
local ttl = tonumber(ARGV[2])
if ttl > 0 then
  redis.call('HSET', KEYS[1], ARGV[1], (now + ttl) .. ' ' .. ARGV[3])
else
  redis.call('HDEL', KEYS[1], ARGV[1])
end
""" + _KEEP_TTL + """
return existed
""")

# KEYS: [1] the pair's endpoint health hash. ARGV: [1] ttl ms, then (field, requests) pairs.
_READINGS = LuaScript(_NOW + """
local ttl = tonumber(ARGV[1])
for i = 2, #ARGV, 2 do
  redis.call('HSET', KEYS[1], ARGV[i], (now + ttl) .. ' ' .. ARGV[i + 1])
end
""" + _KEEP_TTL + """
return 0
""")

# Passive check per endpoint. KEYS: [1] the endpoint's recent failures (zset), [2] the pair's
# endpoint health hash. ARGV: [1] failure id, [2] window ms, [3] failures that take the endpoint
# out, [4] cool-down ms, [5] the flag's field, [6] reason. Returns {1 when this failure took the
# endpoint out else 0, failures in the window}.
_FAILURE = LuaScript("""
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
local count = redis.call('ZCARD', KEYS[1])
if count >= tonumber(ARGV[3]) then
  local until_ms = now + tonumber(ARGV[4])
  redis.call('HSET', KEYS[2], ARGV[5], until_ms .. ' ' .. ARGV[6])
  if redis.call('PTTL', KEYS[2]) < tonumber(ARGV[4]) then
    redis.call('PEXPIRE', KEYS[2], ARGV[4])
  end
  redis.call('DEL', KEYS[1])
  return {1, count}
end
redis.call('PEXPIRE', KEYS[1], window)
return {0, count}
""")


@dataclass(frozen=True, slots=True)
class EndpointFlag:
    """One endpoint flag as `status` shows it: the endpoint (`ip:port`), its source, why, and the
    seconds it still holds (by this machine's clock against Redis time)."""

    endpoint: str
    source: str
    reason: str
    ttl_seconds: float


class EndpointHealth:
    """Set, clear and read the endpoint flags of pick pairs (module docstring). Every method is
    one Redis round trip and raises RedisError when Redis cannot answer."""

    def __init__(self, redis: RedisClient, key_prefix: str):
        self.redis = redis
        self.keys = Keyspace(key_prefix)

    async def set(self, provider: str, model: str, endpoint: str, reason: str, ttl_seconds: float, source: str = MANUAL) -> None:
        """Take `endpoint` (`ip:port`) of the pair out for `ttl_seconds` (seconds) by `source`.
        Raises ValueError for an unknown source."""
        await _WRITE(self.redis, [self.keys.endpoint_health(model, provider)],
                     [_field(endpoint, source), max(1, round(ttl_seconds * 1000)), reason])

    async def clear(self, provider: str, model: str, endpoint: str, source: str = MANUAL) -> bool:
        """Clear the endpoint's flag of `source` only; True when it was set."""
        return bool(await _WRITE(self.redis, [self.keys.endpoint_health(model, provider)], [_field(endpoint, source), 0, ""]))

    async def record_failure(
        self, provider: str, model: str, endpoint: str, what: str, window_seconds: float, failures: int, cooldown_seconds: float
    ) -> bool:
        """Passive check: one upstream failure of `endpoint`; when the endpoint has had `failures`
        within `window_seconds` (seen by every proxy), it is out for `cooldown_seconds`. Returns
        whether this failure took it out."""
        reason = f"passive: {failures} upstream failures within {window_seconds:g} s (last: {what})"
        keys = [self.keys.endpoint_failures(model, provider, endpoint), self.keys.endpoint_health(model, provider)]
        args = [uuid.uuid4().hex, round(window_seconds * 1000), failures, round(cooldown_seconds * 1000),
                _field(endpoint, PASSIVE), reason]
        out, _ = await _FAILURE(self.redis, keys, args)
        return bool(out)

    async def write_readings(self, provider: str, model: str, readings: dict[str, float], ttl_seconds: float) -> None:
        """Record each endpoint's engine reading (`ip:port` -> requests its engine holds) for
        `ttl_seconds` (seconds), in one script call; nothing for an empty dict."""
        if not readings:
            return
        args: list[object] = [max(1, round(ttl_seconds * 1000))]
        for endpoint, requests in readings.items():
            args += [f"{_endpoint(endpoint)} {READING}", f"{requests:g}"]
        await _READINGS(self.redis, [self.keys.endpoint_health(model, provider)], args)

    async def flags(self, provider: str, model: str) -> list[EndpointFlag]:
        """The pair's endpoint flags that hold now, by endpoint then source."""
        raw = await self.redis.hgetall(self.keys.endpoint_health(model, provider))
        return live_flags(raw, time.time() * 1000)


def live_flags(raw: dict, now_ms: float) -> list[EndpointFlag]:
    """The flags of one pair's hash (its HGETALL) that hold at `now_ms` (ms since the epoch);
    engine readings are not flags."""
    out = []
    for endpoint, source, until, reason in _live_fields(raw, now_ms):
        if source != READING:
            out.append(EndpointFlag(endpoint, source, reason, (until - now_ms) / 1000))
    return sorted(out, key=lambda f: (f.endpoint, f.source))


def live_readings(raw: dict, now_ms: float) -> dict[str, float]:
    """The engine readings of one pair's hash (its HGETALL) that hold at `now_ms` (ms since the
    epoch): `ip:port` -> requests its engine holds."""
    return {endpoint: float(value) for endpoint, source, _, value in _live_fields(raw, now_ms) if source == READING}


def _live_fields(raw: dict, now_ms: float):
    for field, value in raw.items():
        endpoint, _, source = _text(field).partition(" ")
        until, _, rest = _text(value).partition(" ")
        if until.isdigit() and int(until) > now_ms:
            yield endpoint, source, int(until), rest


def _field(endpoint: str, source: str) -> str:
    if source not in ENDPOINT_SOURCES:
        raise ValueError(f"unknown endpoint-flag source {source!r}")
    return f"{_endpoint(endpoint)} {source}"


def _endpoint(endpoint: str) -> str:
    if not endpoint or " " in endpoint:
        raise ValueError(f"not an endpoint: {endpoint!r}")
    return endpoint


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
