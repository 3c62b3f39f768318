"""Responses API chains: which session, and which provider, a stored response belongs to.

A Responses turn that sends `previous_response_id` continues a response stored on the provider
that produced it; an OpenAI-compatible server that never saw the id answers 404. So when a
`/v1/responses` answer of a routed request passes, its response id is recorded in Redis:

    {<prefix>:<model>}:response:<keyed hash of identity and response id> -> [session id, provider]

inside the model's hash tag (a Redis Cluster keeps it in the slot of everything else the request
touches), with a TTL of `pin_inactivity_timeout_seconds + lease_timeout_seconds`: as long as the
session's pin can live after that answer. The TTL starts again while the answer streams and when
it ends (`refresh`, as the request's lease is renewed): a long stream keeps its chain as long as
its pin. The provider is recorded only when the response is
stored (`store` is not false): a response that is not stored binds the next turn to nothing but
its session. The key hashes the identity in, so another identity that learned the id finds
nothing.

The id is read from the response body: the JSON answer's `id`, or the `response.id` of the first
server-sent event (`response.created`) of a stream. Only `/v1/responses` answers are read
(the server asks Envoy for their body with a processing-mode override in the response-headers
answer); other traffic costs nothing more.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import orjson
from redis.asyncio import Redis

from extproc.config import Config
from extproc.openai_api.request import keyed_hash
from extproc.storage.client import LuaScript
from extproc.storage.keys import Keyspace

MAX_SCAN_BYTES = 64 * 1024  # a stream whose first event is not complete within this is not read


@dataclass(frozen=True, slots=True)
class ChainLink:
    """What a response id says: the session it was produced in (None: none) and the provider
    that stores it (None: not stored, `store: false`)."""

    session_id: str | None
    provider: str | None


# Record (or refresh) one chain under the model's cap, atomically: KEYS record, the model's set of
# records; ARGV value ('' to refresh only), TTL ms, cap (0: none), the record's digest. 1 when
# recorded or refreshed, 0 when the cap refused a new record or the record to refresh is gone.
_RECORD = LuaScript("""
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl, cap, digest = tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
if ARGV[1] == '' then
  if redis.call('PEXPIRE', KEYS[1], ttl) == 0 then
    return 0
  end
elseif cap > 0 and not redis.call('ZSCORE', KEYS[2], digest) and redis.call('ZCARD', KEYS[2]) >= cap then
  return 0
else
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
end
redis.call('ZADD', KEYS[2], now + ttl, digest)
if redis.call('PTTL', KEYS[2]) < ttl then
  redis.call('PEXPIRE', KEYS[2], ttl)
end
return 1
""")


# Forget one record: KEYS the record, the model's set of records; ARGV the record's digest.
_FORGET = LuaScript("""
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
""")


class ResponseChains:
    """The response id -> (session, provider) records in Redis, at most
    `session.max_response_chains` per model. Raises RedisError."""

    def __init__(self, redis: Redis, config: Config, secret: bytes):
        self.redis = redis
        self.keys = Keyspace(config.redis.key_prefix)
        self.secret = secret
        self.ttl_ms = round((config.pin_inactivity_timeout_seconds + config.lease_timeout_seconds) * 1000)
        self.cap = config.session.max_response_chains or 0

    def key(self, model: str, identity: str, response_id: str) -> str:
        """The record's key: `{prefix:model}:response:<keyed hash>`."""
        return self.keys.response_chain(model, self._digest(identity, response_id))

    def _digest(self, identity: str, response_id: str) -> str:
        return keyed_hash(self.secret, b"response", identity.encode(), response_id.encode())

    async def lookup(self, model: str, identity: str, response_id: str) -> ChainLink | None:
        """The record of `response_id` for this identity, or None (unknown, expired, or another
        identity's)."""
        return _decode(await self.redis.get(self.key(model, identity, response_id)))

    async def find(self, identity: str, response_id: str, models: Sequence[str]) -> tuple[str, ChainLink] | None:
        """The model and record of `response_id` for this identity, looked up under every model of
        `models` at once (one pipelined round trip: a request by id names no model), or None. The
        first model in `models` order with a readable record wins."""
        if not models:
            return None
        async with self.redis.pipeline(transaction=False) as pipe:
            for model in models:
                pipe.get(self.key(model, identity, response_id))
            replies = await pipe.execute()
        for model, raw in zip(models, replies):
            link = _decode(raw)
            if link is not None:
                return model, link
        return None

    async def forget(self, model: str, identity: str, response_id: str) -> None:
        """Remove the record of `response_id` (after its provider deleted the response), and its
        place under the model's cap, atomically."""
        digest = self._digest(identity, response_id)
        await _FORGET(self.redis, [self.keys.response_chain(model, digest), self.keys.response_chains(model)], [digest])

    async def record(self, model: str, identity: str, response_id: str, link: ChainLink) -> bool:
        """Remember `response_id` -> `link` for as long as the session's pin can live. False when
        the model's records are at the cap (nothing is recorded)."""
        value = orjson.dumps([link.session_id or "", link.provider or ""])
        return await self._call(model, identity, response_id, value)

    async def _call(self, model: str, identity: str, response_id: str, value: bytes) -> bool:
        digest = self._digest(identity, response_id)
        keys = [self.keys.response_chain(model, digest), self.keys.response_chains(model)]
        return bool(await _RECORD(self.redis, keys, [value, self.ttl_ms, self.cap, digest]))

    async def refresh(self, model: str, identity: str, response_id: str) -> None:
        """Start the record's TTL again, while the answer that produced it streams and at its end: a
        stream longer than the TTL would otherwise lose its chain before the session's pin, whose
        timeout starts at the request's end. A record that is gone stays gone."""
        await self._call(model, identity, response_id, b"")


def _decode(raw: bytes | None) -> ChainLink | None:
    """A record's value (`[session id, provider]`, "" for none) as a ChainLink; None for none or
    an unreadable value."""
    if raw is None:
        return None
    try:
        session, provider = orjson.loads(raw)
    except (orjson.JSONDecodeError, ValueError, TypeError):
        return None
    return ChainLink(session or None, provider or None)


class ResponseIdReader:
    """Finds the response id in a `/v1/responses` answer body fed chunk by chunk: a JSON object's
    `id`, or the `response.id` of the first `data:` event of a server-sent event stream. Gives up
    (`done` with `response_id` None) on anything else or after MAX_SCAN_BYTES."""

    def __init__(self, event_stream: bool):
        self.event_stream = event_stream
        self.buffer = bytearray()
        self.done = False
        self.response_id: str | None = None

    def feed(self, chunk: bytes, end_of_stream: bool) -> str | None:
        """Add a chunk; returns the response id once it is found (then `done` is set)."""
        if self.done:
            return None
        self.buffer += chunk
        if self.event_stream:
            self._scan_events()
        elif end_of_stream:
            self._finish(_json_id(bytes(self.buffer)))
        if not self.done and (end_of_stream or len(self.buffer) > MAX_SCAN_BYTES):
            self._finish(None)
        return self.response_id

    def _scan_events(self) -> None:
        text = bytes(self.buffer).replace(b"\r\n", b"\n")
        while b"\n\n" in text:
            event, text = text.split(b"\n\n", 1)
            data = b"\n".join(line[5:].lstrip() for line in event.split(b"\n") if line.startswith(b"data:"))
            if not data:
                continue
            try:
                payload = orjson.loads(data)
            except orjson.JSONDecodeError:
                self._finish(None)
                return
            response = payload.get("response") if isinstance(payload, dict) else None
            self._finish(_string(response.get("id")) if isinstance(response, dict) else None)
            return

    def _finish(self, response_id: str | None) -> None:
        self.done = True
        self.response_id = response_id
        self.buffer.clear()


def _json_id(body: bytes) -> str | None:
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return _string(payload.get("id")) if isinstance(payload, dict) else None


def _string(value: object) -> str | None:
    return value if isinstance(value, str) and 0 < len(value) <= 512 else None
