"""Responses API chains: which session, and which provider, a stored response belongs to.

A Responses turn that sends `previous_response_id` continues a response stored on the provider
that produced it; an OpenAI-compatible server that never saw the id answers 404. So when a
`/v1/responses` answer of a routed request passes, its response id is recorded in Redis:

    {<prefix>:<model>}:response:<keyed hash of identity and response id> -> [session id, provider, endpoint]

inside the model's hash tag (a Redis Cluster keeps it in the slot of everything else the request
touches), with a TTL of `pin_inactivity_timeout_seconds + lease_timeout_seconds`: as long as the
session's pin can live after that answer. The TTL starts again while the answer streams and when
it ends (`refresh`, as the request's lease is renewed): a long stream keeps its chain as long as
its pin. A lookup by id that the provider answers (extproc.protocol.lookups) starts it again too.
A response the provider reports as still running (status `queued` or `in_progress`: a
`background: true` response) keeps its record for `session.background_response_ttl_seconds`
instead, started again by every answer that says it still runs, until an answer says it ended
(`completed`, `failed`, `cancelled`, `incomplete`): from then on the chain TTL applies. A refresh
never shortens a record's life, except at such an end. The provider is recorded only when the
response is stored (`store` is not false): a response that is not stored binds the next turn to
nothing but its session. On a provider with affinity `pick` the endpoint (`ip:port`) the response
was generated on is recorded with it ("" elsewhere): the replica that stores it, where lookups by
id and chained turns go (docs/routing-state.md "Endpoint placement"); a record of two elements (an
older release's) reads as one without an endpoint. The key hashes the identity in, so another
identity that learned the id finds nothing.

The id (and the status) are read from the response body as it passes, chunk by chunk, never
held whole: the top-level `id` and `status` of the JSON answer, found by a scanner of the JSON's
tokens within its first MAX_SCAN_BYTES, or the `response.id` and `response.status` of the first
server-sent event (`response.created`) of a stream. Only `/v1/responses` answers are read (the
server asks Envoy for their body with a processing-mode override in the response-headers
answer); other traffic costs nothing more.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from dataclasses import dataclass

import orjson
from redis.asyncio import Redis
from redis.exceptions import RedisError

from extproc.config import Config
from extproc.openai_api.request import keyed_hash
from extproc.storage.client import REDIS_FAILURES, LuaScript
from extproc.storage.keys import Keyspace

MAX_SCAN_BYTES = 64 * 1024  # a stream whose first event (a JSON answer whose id and status) is not within this is not read
RUNNING_STATUSES = frozenset({"queued", "in_progress"})  # a Responses object's status while it is generated


class ChainRecordsUnreadable(RedisError):
    """`ResponseChains.find` found no record and could not read some: `errors` maps each model
    whose GET failed to its error (a RedisError or a RedisClusterException: that model's slot,
    on a Cluster one primary, did not answer)."""

    def __init__(self, errors: dict[str, Exception]):
        super().__init__("response chain records unreadable under model(s) " + ", ".join(sorted(errors)) + ": "
                         + "; ".join(f"{type(error).__name__}: {error}" for error in errors.values()))
        self.errors = errors


def _retrieve(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


@dataclass(frozen=True, slots=True)
class ChainLink:
    """What a response id says: the session it was produced in (None: none), the provider that
    stores it (None: not stored, `store: false`) and, on a provider with affinity pick, the
    endpoint (`ip:port`) of the replica that stores it (None: not known, or not a pick pair)."""

    session_id: str | None
    provider: str | None
    endpoint: str | None = None


# Record (or refresh) one chain under the model's cap, atomically: KEYS record, the model's set of
# records; ARGV value ('' to refresh only), TTL ms, cap (0: none), the record's digest, '1' when a
# refresh may only lengthen the record's life ('0': set it to the TTL). 1 when recorded or
# refreshed, 0 when the cap refused a new record or the record to refresh is gone.
_RECORD = LuaScript("""
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl, cap, digest = tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
if ARGV[1] == '' then
  local left = redis.call('PTTL', KEYS[1])
  if left == -2 then
    return 0
  end
  if ARGV[5] == '1' and left >= ttl then
    ttl = left
  else
    redis.call('PEXPIRE', KEYS[1], ttl)
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
        self.running_ttl_ms = max(self.ttl_ms, round(config.session.background_response_ttl_seconds * 1000))
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
        `models` at once (a request by id names no model), or None. One GET per model, each in a
        task of its own: each model's keys live in its own slot (on a Cluster, maybe another
        primary), so a model whose primary does not answer holds up no other. The first record
        found is returned at once (a response id is recorded under the one model that made it;
        among answers that come together, the first in `models` order wins), the other GETs run
        on to their end unheard. Raises ChainRecordsUnreadable (a RedisError naming each model
        whose GET failed) only when no record was found and some GET failed; anything else a GET
        raises is raised as is."""
        if not models:
            return None
        order = {asyncio.ensure_future(self.lookup(model, identity, response_id)): (at, model) for at, model in enumerate(models)}
        pending: set[asyncio.Future] = set(order)
        errors: dict[str, Exception] = {}
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=lambda task: order[task][0]):
                    model = order[task][1]
                    error = task.exception()
                    if isinstance(error, REDIS_FAILURES):
                        errors[model] = error
                    elif error is not None:
                        raise error
                    elif (link := task.result()) is not None:
                        return model, link
        finally:
            for task in order:  # the GETs left running, or that failed unheard: their errors are dropped
                task.add_done_callback(_retrieve)
        if errors:
            raise ChainRecordsUnreadable(errors)
        return None

    async def forget(self, model: str, identity: str, response_id: str) -> None:
        """Remove the record of `response_id` (after its provider deleted the response), and its
        place under the model's cap, atomically."""
        digest = self._digest(identity, response_id)
        await _FORGET(self.redis, [self.keys.response_chain(model, digest), self.keys.response_chains(model)], [digest])

    def ttl_for(self, running: bool) -> int:
        """The record's TTL in milliseconds: `running` (the provider says the response is still
        generated: RUNNING_STATUSES) keeps it for the background TTL, else the chain TTL."""
        return self.running_ttl_ms if running else self.ttl_ms

    async def record(self, model: str, identity: str, response_id: str, link: ChainLink, running: bool = False) -> bool:
        """Remember `response_id` -> `link` for as long as the session's pin can live (`running`:
        as long as the background TTL, `ttl_for`). False when the model's records are at the cap
        (nothing is recorded)."""
        value = orjson.dumps([link.session_id or "", link.provider or "", link.endpoint or ""])
        return await self._call(model, identity, response_id, value, self.ttl_for(running), lengthen_only=False)

    async def _call(self, model: str, identity: str, response_id: str, value: bytes, ttl_ms: int, lengthen_only: bool) -> bool:
        digest = self._digest(identity, response_id)
        keys = [self.keys.response_chain(model, digest), self.keys.response_chains(model)]
        return bool(await _RECORD(self.redis, keys, [value, ttl_ms, self.cap, digest, "1" if lengthen_only else "0"]))

    async def refresh(self, model: str, identity: str, response_id: str, running: bool = False, ended: bool = False) -> bool:
        """Start the record's TTL (`ttl_for(running)`) again: while the answer that produced it
        streams and at its end (a stream longer than the TTL would otherwise lose its chain before
        the session's pin, whose timeout starts at the request's end), and after a lookup by id the
        provider answered. The record's life is only lengthened, unless `ended` (an answer says the
        response ended: its background TTL gives way to the chain TTL). A record that is gone
        stays gone (False)."""
        return await self._call(model, identity, response_id, b"", self.ttl_for(running), lengthen_only=not ended)


def _decode(raw: bytes | None) -> ChainLink | None:
    """A record's value (`[session id, provider, endpoint]`, "" for none; an older release's
    `[session id, provider]` has no endpoint) as a ChainLink; None for none or an unreadable
    value."""
    if raw is None:
        return None
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(value, list) or len(value) not in (2, 3) or not all(isinstance(v, str) for v in value):
        return None
    session, provider, endpoint = (*value, "")[:3]
    return ChainLink(session or None, provider or None, endpoint or None)


class ResponseReader:
    """Reads a `/v1/responses` answer body fed chunk by chunk: its response id and status (the
    top-level `id` and `status` of a JSON object, or the `response.id` and `response.status` of
    the first `data:` event of a server-sent event stream). `done` once both are found, or when
    the search gives up (on anything else, at the body's end, or after MAX_SCAN_BYTES), with
    whatever was found (None for the rest). Holds at most MAX_SCAN_BYTES plus a chunk of an event
    stream; never the whole of a large JSON answer."""

    def __init__(self, event_stream: bool):
        self.event_stream = event_stream
        self.buffer = bytearray()
        self.done = False
        self.response_id: str | None = None
        self.status: str | None = None
        self._scanner = None if event_stream else TopLevelStrings(("id", "status"))

    @property
    def running(self) -> bool:
        """Whether the answer says the response is still generated (RUNNING_STATUSES)."""
        return self.status in RUNNING_STATUSES

    def feed(self, chunk: bytes, end_of_stream: bool) -> bool:
        """Add a chunk; True once the reading is over (`done`): read `response_id` and `status`."""
        if self.done:
            return True
        if self.event_stream:
            self.buffer += chunk
            self._scan_events()
        else:
            self.buffer += chunk[:MAX_SCAN_BYTES + 1 - len(self.buffer)]  # a large chunk is not copied whole
            if self._scanner.scan(self.buffer, end_of_stream):
                self._finish(self._scanner.found.get("id"), self._scanner.found.get("status"))
        if not self.done and (end_of_stream or len(self.buffer) > MAX_SCAN_BYTES):
            found = self._scanner.found if self._scanner is not None else {}
            self._finish(found.get("id"), found.get("status"))
        return self.done

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
                self._finish(None, None)
                return
            response = payload.get("response") if isinstance(payload, dict) else None
            if isinstance(response, dict):
                self._finish(_string(response.get("id")), _string(response.get("status")))
            else:
                self._finish(None, None)
            return

    def _finish(self, response_id: object, status: object) -> None:
        self.done = True
        self.response_id = _string(response_id)
        self.status = _string(status)
        self.buffer = bytearray()


# One JSON token after optional whitespace: a string (group 1), a structural character (2), or a
# number or literal (3). A string's body is matched in the unrolled form, without backtracking.
_JSON_TOKEN = re.compile(rb'[ \t\r\n]*(?:("[^"\\]*(?:\\.[^"\\]*)*")|([{}\[\]:,])|([^ \t\r\n{}\[\]:,"]+))', re.S)


class TopLevelStrings:
    """Finds the string values of some top-level members of a JSON object given as a growing
    prefix of its text, without parsing (or holding) the rest: a scanner of JSON's tokens that
    follows only the nesting depth below the top level. `found` maps a member name to its value
    (a member whose value is not a string is not found; the first occurrence wins)."""

    def __init__(self, names: Sequence[str]):
        self.wanted = frozenset(names)
        self.found: dict[str, str] = {}
        self._pos = 0
        self._depth = 0
        self._state = "start"  # at the top level: start, key, colon, value, comma; then end
        self._key: str | None = None

    def scan(self, text: bytes | bytearray, final: bool) -> bool:
        """Scan on through `text` (the same prefix as before, grown; `final`: it is the whole
        document). True when there is nothing more to find: every name found, the object ended,
        the text is not a JSON object, or `final`."""
        while True:
            match = _JSON_TOKEN.match(text, self._pos)
            if match is None or (match.end() == len(text) and match.lastindex == 3 and not final):
                return final  # an incomplete token waits for the next chunk
            self._pos = match.end()
            if self._step(*match.groups()):
                return True

    def _step(self, string: bytes | None, structural: bytes | None, atom: bytes | None) -> bool:
        """Take one token; True when the search is over."""
        if self._depth > 1:
            if structural in (b"{", b"["):
                self._depth += 1
            elif structural in (b"}", b"]"):
                self._depth -= 1
            return False
        state = self._state
        if state == "start":
            if structural != b"{":
                return True
            self._depth, self._state = 1, "key"
        elif state == "key" and string is not None:
            self._key, self._state = _decoded(string) if len(string) <= 64 else None, "colon"
        elif state == "colon" and structural == b":":
            self._state = "value"
        elif state == "value" and (string is not None or atom is not None):
            if string is not None and self._key in self.wanted and self._key not in self.found:
                value = _decoded(string)
                if value is not None:
                    self.found[self._key] = value
            self._state = "comma"
            return self.wanted <= self.found.keys()
        elif state == "value" and structural in (b"{", b"["):
            self._depth, self._state = 2, "comma"
        elif state == "comma" and structural == b",":
            self._state = "key"
        else:  # the object's end, or anything that is not JSON
            return True
        return False


def _decoded(string: bytes) -> str | None:
    try:
        value = orjson.loads(string)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, str) else None


def _string(value: object) -> str | None:
    return value if isinstance(value, str) and 0 < len(value) <= 512 else None
