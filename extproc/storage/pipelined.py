"""The hot-path Redis client: every command of a node over one pipelined connection.

redis-py spends 530-710 us of client CPU per admission plus release (issue 24); this client
spends a fraction of it by doing less per call:

- one `asyncio.Protocol` connection per node, never a pool: a call appends its encoded command
  to the connection's write buffer and a future to its FIFO of pending replies; the commands of
  one event-loop turn leave in one `transport.write`;
- replies are parsed by `hiredis.Reader` and resolve the futures in order;
- a script's constant arguments can be encoded once (`Packed`).

A call's deadline (seconds) or its cancellation never desynchronises the FIFO: the caller gets
`PipelinedTimeoutError` or `asyncio.CancelledError` at once, its reply slot stays in the FIFO and
the reply is dropped when it comes. No `asyncio.wait_for` sits in the send path, so a
cancellation is raised at once on Python 3.11 too (CPython gh-86296; see
`extproc.storage.client.in_own_task`, which calls of this client do not need). A lost connection
fails every pending call with `PipelinedConnectionError`; the next call connects again (after a
backoff when connecting failed). No command is ever sent twice after a connection error: the
admission scripts are not idempotent under every interleaving, so the caller decides.

Topologies, from `extproc.config.RedisSettings` (`open_pipelined`), as `open_redis` serves them:
a standalone Redis (`url`, `redis://` or `rediss://`, `user:password@`, `/db`), a Redis Cluster
(`cluster.nodes`: the slot map from CLUSTER SLOTS, keys routed by hash slot with hash tags
honoured, MOVED followed with a map refresh and ASK with ASKING, at most `MAX_REDIRECTIONS`
times; TRYAGAIN, a slot move under way, retried with a backoff until the call's deadline; a node
that fails refreshes the map from another node), or a primary behind Sentinel
(`sentinel`: SENTINEL get-master-addr-by-name, ROLE checked on connect, asked again after a
connection error, a READONLY reply or a stall). AUTH (`username`, `password_env`) as `open_redis`
applies it, and TLS from the same owner (extproc.storage.tls) to every connection: each node, the
sentinels and the primary.

Every error is a redis-py exception class (`extproc.storage.client.REDIS_FAILURES` catches them
all), and error replies are redis-py's (`NoScriptError`, `ReadOnlyError`, `ResponseError`...).
Replies are what hiredis gives: bytes, ints, lists (as redis-py without decode_responses).
"""

from __future__ import annotations

import asyncio
import builtins
import collections
import dataclasses
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import unquote, urlparse

import hiredis
from redis._parsers.base import BaseParser
from redis.crc import key_slot
from redis.exceptions import (
    AskError,
    AuthenticationError,
    DataError,
    MovedError,
    NoScriptError,
    ReadOnlyError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from extproc.config import RedisSettings
from extproc.storage.client import host_port, secret_from_env
from extproc.storage.tls import redis_tls

MAX_REDIRECTIONS = 5
"""MOVED / ASK replies followed per call before the last one is raised."""

TRYAGAIN_BACKOFF_SECONDS = (0.01, 0.1)
"""After a TRYAGAIN reply (a multi-key call on a slot being moved whose keys are split between
the two nodes, or missing: Redis Cluster specification, "Multi-keys operations") a call waits the
first value, doubled after each further TRYAGAIN up to the second (seconds), and goes again to the
slot's owner, for as long as its deadline leaves room for the wait; then the TRYAGAIN is its
answer (the caller sees TryAgainError). A slot move takes seconds: the caller decides what a call
that could not wait it out means (extproc.routing.outage.RedisBreaker counts it for its model)."""

RECONNECT_BACKOFF_SECONDS = (0.05, 1.0)
"""After a failed connect a node refuses calls at once (PipelinedConnectionError) for the first
value, doubled after each further failure up to the second (seconds)."""

REFRESH_INTERVAL_SECONDS = 0.1
"""A cluster's slot map, or the sentinels' primary, is asked for at most this often (seconds)."""


class PipelinedConnectionError(RedisConnectionError):
    """A connection to a node could not be made, was lost with the call's reply pending, or
    the node refuses calls during its reconnect backoff. Whether the command ran is unknown
    when the connection was lost after it was sent."""


class PipelinedTimeoutError(RedisTimeoutError, builtins.TimeoutError):
    """The call's deadline passed before its reply came (the command may still run). Both
    redis-py's TimeoutError (a RedisError) and the builtin TimeoutError."""


class InFlightCapReached(RedisConnectionError):
    """`max_in_flight` calls already await their replies: load on this process, not a Redis
    failure. Its `__cause__` is a TimeoutError, as redis-py's "No connection available." from a
    busy pool, so `extproc.storage.client.is_pool_exhausted` recognises it (the gateway answers
    429 and the breaker does not count it)."""

    def __init__(self, max_in_flight: int):
        super().__init__(f"{max_in_flight} Redis calls already in flight")
        self.__cause__ = builtins.TimeoutError("no room in flight")


class Packed:
    """Command arguments encoded once for many calls (a script's constant keys or arguments):
    pass it in place of those values inside `keys` or `args`. `values`: the arguments (bytes,
    str, int or float). Raises redis.exceptions.DataError on another type."""

    __slots__ = ("count", "data", "values")

    def __init__(self, values: Sequence[object]):
        self.values = tuple(values)
        self.count = len(self.values)
        self.data = b"".join(_bulk(v) for v in self.values)


@dataclass(frozen=True)
class ConnectOptions:
    """How to open and set up a connection to a data node. Seconds for `connect_timeout`."""

    username: str | None = None
    password: str | None = None
    db: int = 0
    ssl_context: ssl.SSLContext | None = None
    connect_timeout: float = 0.5
    expect_primary: bool = False  # check ROLE (Sentinel): a replica is refused with ReadOnlyError


# ---- encoding ---------------------------------------------------------------------------------


def _bulk(value: object) -> bytes:
    kind = type(value)
    if kind is bytes:
        data = value
    elif kind is str:
        data = value.encode()
    elif kind is int or kind is float:
        data = repr(value).encode()
    elif isinstance(value, str):  # a str enum: its value
        data = str.encode(value)
    elif isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
    elif isinstance(value, float):
        data = float.__repr__(value).encode()
    elif isinstance(value, int) and not isinstance(value, bool):
        data = int.__repr__(value).encode()
    else:
        raise DataError(f"Invalid input of type: {kind.__name__!r}. Convert to bytes, str, int or float first.")
    return b"$%d\r\n%b\r\n" % (len(data), data)


def _encode_into(out: list[bytes], values: Sequence[object]) -> int:
    """Append the bulk strings of `values` (Packed segments as they are) to `out`; returns how
    many arguments they are."""
    count = 0
    for value in values:
        if type(value) is Packed:
            out.append(value.data)
            count += value.count
        else:
            out.append(_bulk(value))
            count += 1
    return count


def encode_command(*args: object) -> bytes:
    """One command in RESP (an array of bulk strings). `args` may hold Packed segments."""
    out: list[bytes] = []
    count = _encode_into(out, args)
    return b"*%d\r\n%b" % (count, b"".join(out))


def _script_command(head: bytes, head_count: int, keys: Sequence[object], args: Sequence[object]) -> bytes:
    out: list[bytes] = []
    key_count = _encode_into(out, keys)
    out.insert(0, _bulk(key_count))
    count = head_count + 1 + key_count + _encode_into(out, args)
    return b"*%d\r\n%b%b" % (count, head, b"".join(out))


def _first_key(keys: Sequence[object]) -> object:
    first = keys[0]
    return first.values[0] if type(first) is Packed else first


def _key_bytes(key: object) -> bytes:
    if type(key) is bytes:
        return key
    if isinstance(key, str):
        return str.encode(key)
    return _bulk(key).split(b"\r\n", 2)[1]


# ---- one connection ---------------------------------------------------------------------------


class _Batch:
    """The replies of several commands sent together, resolving one future with their list."""

    __slots__ = ("future", "remaining", "replies")

    def __init__(self, future: asyncio.Future, count: int):
        self.future = future
        self.remaining = count
        self.replies: list[object] = []


class _Connection(asyncio.Protocol):
    """One pipelined connection: a FIFO of pending replies (futures, or _Batch for commands
    sent together), in the order their commands were written."""

    def __init__(self, loop: asyncio.AbstractEventLoop, address: str, on_lost: Callable[[_Connection], None]):
        self.loop = loop
        self.address = address
        self.on_lost = on_lost
        self.transport: asyncio.Transport | None = None
        self.error: PipelinedConnectionError | None = None
        self._reader = hiredis.Reader(replyError=BaseParser.parse_error)
        self._pending: collections.deque = collections.deque()
        self._out: list[bytes] = []
        self._flush_scheduled = False
        self._busy_since = 0.0  # loop time the FIFO last went from empty to not empty
        self._last_reply_at = 0.0

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        reader = self._reader
        reader.feed(data)
        pending = self._pending
        try:
            while (reply := reader.gets()) is not False:
                entry = pending[0]
                if type(entry) is _Batch:
                    entry.replies.append(reply)
                    entry.remaining -= 1
                    if entry.remaining:
                        continue
                    pending.popleft()
                    if not entry.future.done():
                        entry.future.set_result(entry.replies)
                else:
                    pending.popleft()
                    if not entry.done():
                        entry.set_result(reply)
        except (hiredis.ProtocolError, IndexError) as exc:  # garbage or a reply nobody asked for
            self.close(f"protocol error: {exc!r}")
        self._last_reply_at = self.loop.time()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.error is None:
            self.error = PipelinedConnectionError(f"connection to {self.address} lost" + (f": {exc}" if exc else ""))
        pending, self._pending = self._pending, collections.deque()
        self._out.clear()
        for entry in pending:
            future = entry.future if type(entry) is _Batch else entry
            if not future.done():
                future.set_exception(PipelinedConnectionError(str(self.error)))
        self.on_lost(self)

    # sending

    def send(self, data: bytes, entry: asyncio.Future | _Batch) -> None:
        """Queue `data` (one or more encoded commands) for this loop turn's write and `entry`
        for their replies. Raises PipelinedConnectionError when the connection is gone."""
        if self.error is not None:
            raise PipelinedConnectionError(str(self.error))
        if not self._pending:
            self._busy_since = self.loop.time()
        self._out.append(data)
        self._pending.append(entry)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self.error is None and self._out:
            out = self._out
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))
            out.clear()

    def stalled_for(self) -> float:
        """Seconds since a reply was last awaited in vain (0 when nothing is pending)."""
        if not self._pending:
            return 0.0
        return self.loop.time() - max(self._busy_since, self._last_reply_at)

    def close(self, why: str) -> None:
        """Drop the connection: every pending call fails with PipelinedConnectionError(why)."""
        if self.error is None:
            self.error = PipelinedConnectionError(f"connection to {self.address} closed: {why}")
        if self.transport is not None:
            self.transport.abort()  # connection_lost follows (from the loop)


def _expire(future: asyncio.Future, connection: _Connection | None, stall_seconds: float) -> None:
    """A call's deadline: the caller gets PipelinedTimeoutError now; its reply slot stays."""
    if not future.done():
        future.set_exception(PipelinedTimeoutError("Timeout reading from Redis"))
    if connection is not None and connection.stalled_for() >= stall_seconds:
        connection.close(f"no reply for {stall_seconds} s")


# ---- one node ---------------------------------------------------------------------------------


class _Node:
    """One data node at host:port: one connection, opened on demand and again after a loss (with
    a backoff after a failed attempt)."""

    def __init__(self, host: str, port: int, options: ConnectOptions, on_failure: Callable[[_Node], None]):
        self.host = host
        self.port = port
        self.address = f"{host}:{port}"
        self.options = options
        self.on_failure = on_failure
        self.connection: _Connection | None = None
        self._opening: asyncio.Task | None = None
        self._refuse_until = 0.0
        self._backoff = RECONNECT_BACKOFF_SECONDS[0]
        self._last_error: Exception | None = None
        self.closed = False

    def ready(self) -> _Connection | None:
        """The open connection, or None (then await `connect`)."""
        connection = self.connection
        if connection is not None and connection.error is None:
            return connection
        return None

    async def connect(self) -> _Connection:
        """The open connection, opening it if needed (one attempt shared by every caller).
        Raises PipelinedConnectionError, or redis-py's AuthenticationError / ReadOnlyError."""
        connection = self.ready()
        if connection is not None:
            return connection
        if self.closed:
            raise PipelinedConnectionError("client closed")
        loop = asyncio.get_running_loop()
        if self._opening is None:
            if loop.time() < self._refuse_until:
                raise PipelinedConnectionError(f"{self.address}: reconnecting after {self._last_error!s}")
            self._opening = loop.create_task(self._open())
            self._opening.add_done_callback(_retrieve)
        return await asyncio.shield(self._opening)

    async def _open(self) -> _Connection:
        loop = asyncio.get_running_loop()
        options = self.options
        try:
            async with asyncio.timeout(options.connect_timeout):
                try:
                    _, connection = await loop.create_connection(
                        lambda: _Connection(loop, self.address, self._lost),
                        self.host, self.port, ssl=options.ssl_context,
                        server_hostname=self.host if options.ssl_context is not None else None,
                    )
                except OSError as exc:
                    raise PipelinedConnectionError(f"cannot connect to {self.address}: {exc}") from exc
                try:
                    await _handshake(connection, options)
                except BaseException:
                    connection.close("handshake failed")
                    raise
        except builtins.TimeoutError as exc:
            self._failed(PipelinedConnectionError(f"timeout connecting to {self.address}"))
            raise self._last_error from exc
        except Exception as exc:
            self._failed(exc)
            raise
        finally:
            self._opening = None
        self._backoff = RECONNECT_BACKOFF_SECONDS[0]
        if self.closed:
            connection.close("client closed")
        self.connection = connection
        return connection

    def _failed(self, error: Exception) -> None:
        self._last_error = error
        self._refuse_until = asyncio.get_running_loop().time() + self._backoff
        self._backoff = min(self._backoff * 2, RECONNECT_BACKOFF_SECONDS[1])
        self.on_failure(self)

    def _lost(self, connection: _Connection) -> None:
        if self.connection is connection:
            self.connection = None
            if not self.closed:
                self.on_failure(self)

    def close(self) -> None:
        self.closed = True
        if self.connection is not None:
            self.connection.close("client closed")
        if self._opening is not None and self._opening is not asyncio.current_task():
            self._opening.cancel()


async def _handshake(connection: _Connection, options: ConnectOptions) -> None:
    """AUTH, SELECT and (Sentinel) ROLE, pipelined; raises what the node answers."""
    commands = []
    if options.password is not None:
        auth = ("AUTH", options.username, options.password) if options.username else ("AUTH", options.password)
        commands.append(auth)
    if options.db:
        commands.append(("SELECT", options.db))
    if options.expect_primary:
        commands.append(("ROLE",))
    if not commands:
        return
    replies = await _send_batch(connection, [encode_command(*c) for c in commands])
    for command, reply in zip(commands, replies):
        if isinstance(reply, Exception):
            if command[0] == "AUTH" and not isinstance(reply, AuthenticationError):
                raise AuthenticationError(str(reply))
            raise reply
        if command[0] == "ROLE" and reply[0] != b"master":
            raise ReadOnlyError(f"{connection.address} is a {reply[0].decode()}, not the primary")


async def _send_batch(connection: _Connection, commands: list[bytes]) -> list[object]:
    future = connection.loop.create_future()
    connection.send(b"".join(commands), _Batch(future, len(commands)))
    return await future


# ---- the client -------------------------------------------------------------------------------


class PipelinedRedis:
    """The hot-path client over one topology (`Standalone`, `Cluster` or `SentinelPrimary`).

    `timeout` (seconds): every call's default deadline. `max_in_flight`: how many calls may
    await their replies at once; one more raises InFlightCapReached at once. `stall_seconds`
    (seconds; default max(5, 4 x timeout)): a connection whose pending replies have waited this
    long when a deadline passes is dropped, so a node that stopped answering (a partition, a
    stopped process) is found again through the topology. Build it with `open_pipelined`; use
    it from one event loop."""

    def __init__(self, topology: Topology, *, timeout: float = 0.5, max_in_flight: int = 64, stall_seconds: float | None = None):
        self.topology = topology
        self.timeout = timeout
        self.max_in_flight = max_in_flight
        self.stall_seconds = stall_seconds if stall_seconds is not None else max(5.0, 4 * timeout)
        self.in_flight = 0
        self._heads: dict[str, tuple[bytes, bytes]] = {}

    async def execute(self, *args: object, key: object = None, timeout: float | None = None) -> object:
        """One command (`args`: its name and arguments, Packed segments allowed) on the node
        owning `key` (in a cluster; any node when None). Returns the reply; raises an error
        reply as its redis-py exception, PipelinedTimeoutError after `timeout` seconds (default
        the client's), PipelinedConnectionError, InFlightCapReached."""
        self._enter()
        try:
            replies = await self.topology.run(self, key, [encode_command(*args)], self._deadline(timeout))
        finally:
            self.in_flight -= 1
        reply = replies[0]
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def evalsha(self, script: object, keys: Sequence[object], args: Sequence[object], timeout: float | None = None) -> object:
        """EVALSHA of `script` (anything with `.sha` and `.source`, such as
        extproc.storage.client.LuaScript) with `keys` and `args` (Packed segments allowed), on
        the node owning the first key; NOSCRIPT is answered by EVAL of the source on the same
        node, in the same deadline. Returns the script's reply; raises as `execute`."""
        self._enter()
        try:
            reply = (await self._script(script, keys, args, None, self._deadline(timeout)))[0]
        finally:
            self.in_flight -= 1
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def evalsha_and_wait(
        self, script: object, keys: Sequence[object], args: Sequence[object], replicas: int, timeout_ms: int,
        timeout: float | None = None,
    ) -> tuple[object, int]:
        """The script as `evalsha`, then `WAIT replicas timeout_ms` (milliseconds) written with it
        on the same connection (durable admissions, config `redis.durable_admissions`): returns
        (the script's reply, how many replicas acknowledged every write of that connection so
        far). A redirected or NOSCRIPT call sends both again to the node that runs the script, so
        the count is that node's. The deadline (default: the client's timeout plus timeout_ms)
        covers both. Raises as `execute`."""
        if timeout is None:
            timeout = self.timeout + timeout_ms / 1000
        wait = encode_command("WAIT", replicas, timeout_ms)
        self._enter()
        try:
            reply, acked = await self._script(script, keys, args, wait, self._deadline(timeout))
        finally:
            self.in_flight -= 1
        if isinstance(reply, Exception):
            raise reply
        if isinstance(acked, Exception):
            raise acked
        return reply, int(acked)

    async def aclose(self) -> None:
        """Close every connection; pending calls fail with PipelinedConnectionError."""
        self.topology.close()
        await asyncio.sleep(0)  # let the transports report their loss

    # internals

    def _enter(self) -> None:
        if self.in_flight >= self.max_in_flight:
            raise InFlightCapReached(self.max_in_flight)
        self.in_flight += 1

    def _deadline(self, timeout: float | None) -> float:
        return asyncio.get_running_loop().time() + (self.timeout if timeout is None else timeout)

    async def _script(self, script, keys, args, wait: bytes | None, deadline: float) -> list[object]:
        heads = self._heads.get(script.sha)
        if heads is None:
            heads = self._heads[script.sha] = (
                _bulk("EVALSHA") + _bulk(script.sha), _bulk("EVAL") + _bulk(script.source)
            )
        key = _first_key(keys) if keys else None
        commands = [_script_command(heads[0], 2, keys, args)]
        if wait is not None:
            commands.append(wait)
        replies = await self.topology.run(self, key, commands, deadline)
        if type(replies[0]) is NoScriptError:
            commands[0] = _script_command(heads[1], 2, keys, args)
            replies = await self.topology.run(self, key, commands, deadline)
        return replies

    async def _send(self, node: _Node, commands: list[bytes], deadline: float, asking: bool = False) -> list[object]:
        """`commands` on `node`'s connection, their replies (error replies as exception values),
        in the deadline. ASKING first when `asking` (its reply dropped)."""
        connection = node.ready()
        if connection is None:
            connection = await _until(node.connect(), deadline)
        loop = connection.loop
        future = loop.create_future()
        if asking:
            commands = [_ASKING, *commands]
        if len(commands) == 1:
            connection.send(commands[0], future)
        else:
            connection.send(b"".join(commands), _Batch(future, len(commands)))
        timer = loop.call_at(deadline, _expire, future, connection, self.stall_seconds)
        try:
            reply = await future
        finally:
            timer.cancel()
        if len(commands) == 1:
            return [reply]
        return reply[1:] if asking else reply


_ASKING = encode_command("ASKING")


async def _until(awaitable, deadline: float):
    """`awaitable` (a connect) within the call's deadline; raises PipelinedTimeoutError after."""
    try:
        async with asyncio.timeout_at(deadline):
            return await awaitable
    except builtins.TimeoutError as exc:
        if isinstance(exc, PipelinedTimeoutError):
            raise
        raise PipelinedTimeoutError("Timeout connecting to Redis") from exc


# ---- topologies -------------------------------------------------------------------------------


class Topology:
    """Which node a call goes to, and what a redirect or a failure changes."""

    async def run(self, client: PipelinedRedis, key: object, commands: list[bytes], deadline: float) -> list[object]:
        """Send `commands` (encoded, written together) to the node serving `key` and return
        their replies, error replies as exception values, by `deadline` (event-loop time,
        seconds). Raises PipelinedConnectionError, PipelinedTimeoutError."""
        raise NotImplementedError

    def close(self) -> None:
        """Close every connection (pending calls fail with PipelinedConnectionError)."""
        raise NotImplementedError


class Standalone(Topology):
    """One Redis at `host`:`port`."""

    def __init__(self, host: str, port: int, options: ConnectOptions):
        self.node = _Node(host, port, options, lambda node: None)

    async def run(self, client, key, commands, deadline):
        return await client._send(self.node, commands, deadline)

    def close(self) -> None:
        self.node.close()


class SentinelPrimary(Topology):
    """The primary of `service_name` as the `sentinels` ((host, port) pairs) name it. Asked
    again (at most every REFRESH_INTERVAL_SECONDS) after a connection error, a READONLY reply
    or a node that turns out not to be the primary (ROLE). `sentinel_options`: AUTH and TLS
    for the sentinels themselves."""

    def __init__(self, sentinels: list[tuple[str, int]], service_name: str, options: ConnectOptions,
                 sentinel_options: ConnectOptions):
        self.sentinels = list(sentinels)
        self.service_name = service_name
        self.options = dataclasses.replace(options, expect_primary=True)
        self.sentinel_options = sentinel_options
        self.node: _Node | None = None
        self._asking: asyncio.Task | None = None
        self._asked_at = float("-inf")
        self._closed = False

    async def run(self, client, key, commands, deadline):
        node = self.node
        if node is None:
            node = await _until(self._discover(), deadline)
        try:
            replies = await client._send(node, commands, deadline)
        except (RedisConnectionError, ReadOnlyError):
            self._forget(node)
            raise
        if any(_is_readonly(r) for r in replies):
            self._forget(node)
        return replies

    def _forget(self, node: _Node) -> None:
        """Ask the sentinels again on the next call."""
        if self.node is node:
            self.node = None
            node.close()

    async def _discover(self) -> _Node:
        if self._closed:
            raise PipelinedConnectionError("client closed")
        if self._asking is None:
            self._asking = asyncio.get_running_loop().create_task(self._ask())
        return await asyncio.shield(self._asking)

    async def _ask(self) -> _Node:
        try:
            wait = self._asked_at + REFRESH_INTERVAL_SECONDS - asyncio.get_running_loop().time()
            if wait > 0:
                await asyncio.sleep(wait)
            errors = []
            for host, port in self.sentinels:
                try:
                    reply = await _ask_once(host, port, self.sentinel_options,
                                            encode_command("SENTINEL", "get-master-addr-by-name", self.service_name))
                except (RedisConnectionError, ResponseError, builtins.TimeoutError) as exc:
                    errors.append(f"{host}:{port}: {exc}")
                    continue
                if isinstance(reply, Exception) or not reply:
                    errors.append(f"{host}:{port}: {reply!r}")
                    continue
                if self.node is None:
                    self.node = _Node(reply[0].decode(), int(reply[1]), self.options, self._forget)
                return self.node
            raise PipelinedConnectionError(f"no sentinel names the primary of {self.service_name}: {'; '.join(errors)}")
        finally:
            self._asked_at = asyncio.get_running_loop().time()
            self._asking = None

    def close(self) -> None:
        self._closed = True
        if self.node is not None:
            self.node.close()
        if self._asking is not None:
            self._asking.cancel()


class Cluster(Topology):
    """A Redis Cluster known from `seeds` ((host, port) pairs): keys go to the primary owning
    their hash slot (CLUSTER SLOTS); MOVED updates that slot and refreshes the map, ASK sends
    ASKING and the command to the node named, at most MAX_REDIRECTIONS of them per call;
    TRYAGAIN goes again to the slot's owner after a backoff (TRYAGAIN_BACKOFF_SECONDS) while
    the call's deadline leaves room. A node whose connection fails makes the map be asked
    again from the other nodes (at most every REFRESH_INTERVAL_SECONDS). A slot no node
    serves raises PipelinedConnectionError."""

    SLOTS = 16384

    def __init__(self, seeds: list[tuple[str, int]], options: ConnectOptions):
        self.seeds = list(seeds)
        self.options = options
        self.nodes: dict[tuple[str, int], _Node] = {}
        self.slots: list[_Node | None] = [None] * self.SLOTS
        self._refreshing: asyncio.Task | None = None
        self._refreshed_at = float("-inf")
        self._known = False
        self._closed = False
        self.redirections = 0  # MOVED and ASK replies followed, since the start

    def node(self, host: str, port: int) -> _Node:
        node = self.nodes.get((host, port))
        if node is None:
            node = self.nodes[(host, port)] = _Node(host, port, self.options, self._node_failed)
        return node

    async def run(self, client, key, commands, deadline):
        slot = key_slot(_key_bytes(key)) if key is not None else 0
        node = await self._owner(slot, deadline)
        asking, redirections, backoff = False, 0, TRYAGAIN_BACKOFF_SECONDS[0]
        while True:
            try:
                replies = await client._send(node, commands, deadline, asking)
            except RedisConnectionError:
                self._refresh_soon()  # also while the node refuses calls in its backoff
                raise
            error = replies[0]
            if type(error) is TryAgainError:  # a multi-key command during a slot move
                if asyncio.get_running_loop().time() + backoff >= deadline:
                    return replies
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, TRYAGAIN_BACKOFF_SECONDS[1])
                # From the slot's owner again (the move may have ended): its ASK is followed anew.
                node, asking, redirections = await self._owner(slot, deadline), False, 0
                continue
            if type(error) is not MovedError and type(error) is not AskError:
                return replies
            self.redirections += 1
            redirections += 1
            if redirections >= MAX_REDIRECTIONS:
                return replies
            if type(error) is MovedError:
                node = self.node(*error.node_addr)
                self.slots[error.slot_id] = node
                self._refresh_soon()
                asking = False
            else:
                node, asking = self.node(*error.node_addr), True

    async def _owner(self, slot: int, deadline: float) -> _Node:
        """The node serving `slot`, asking for the map when none is known. Raises
        PipelinedConnectionError (no node serves it), PipelinedTimeoutError."""
        node = self.slots[slot]
        if node is None:
            await _until(self._refresh(wait=not self._known), deadline)
            node = self.slots[slot]
            if node is None:
                raise PipelinedConnectionError(f"no node of the cluster serves slot {slot}")
        return node

    def _node_failed(self, node: _Node) -> None:
        self._refresh_soon()

    def _refresh_soon(self) -> None:
        if self._refreshing is None and not self._closed:
            self._refreshing = asyncio.get_running_loop().create_task(self._load_slots())
            self._refreshing.add_done_callback(_retrieve)

    async def _refresh(self, wait: bool) -> None:
        self._refresh_soon()
        if wait and self._refreshing is not None:
            await asyncio.shield(self._refreshing)

    async def _load_slots(self) -> None:
        """Ask CLUSTER SLOTS of known nodes (the current owners first, then the seeds), taking
        the first answer. Raises PipelinedConnectionError when none answers."""
        try:
            loop = asyncio.get_running_loop()
            wait = self._refreshed_at + REFRESH_INTERVAL_SECONDS - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            candidates = list(dict.fromkeys(
                [*((n.host, n.port) for n in self.nodes.values() if n.ready()), *self.seeds, *self.nodes]
            ))
            errors = []
            for host, port in candidates:
                try:
                    reply = await _ask_once(host, port, self.options, encode_command("CLUSTER", "SLOTS"),
                                            via=self.nodes.get((host, port)))
                except (RedisConnectionError, ResponseError, builtins.TimeoutError) as exc:
                    errors.append(f"{host}:{port}: {exc}")
                    continue
                if isinstance(reply, Exception):
                    errors.append(f"{host}:{port}: {reply}")
                    continue
                self._apply(reply, host)
                self._known = True
                return
            raise PipelinedConnectionError(f"no cluster node answered CLUSTER SLOTS: {'; '.join(errors)}")
        finally:
            self._refreshed_at = asyncio.get_running_loop().time()
            self._refreshing = None

    def _apply(self, reply: list, answered_by: str) -> None:
        slots: list[_Node | None] = [None] * self.SLOTS
        for entry in reply:
            low, high, primary = int(entry[0]), int(entry[1]), entry[2]
            host = primary[0].decode() if primary[0] not in (b"", b"?") else answered_by
            node = self.node(host, int(primary[1]))
            for slot in range(low, high + 1):
                slots[slot] = node
        self.slots = slots

    def close(self) -> None:
        self._closed = True
        for node in self.nodes.values():
            node.close()
        if self._refreshing is not None:
            self._refreshing.cancel()


async def _ask_once(host: str, port: int, options: ConnectOptions, command: bytes, via: _Node | None = None) -> object:
    """One command on the connection of `via` (a node of the client) when it is open, else on a
    connection of its own closed after; within 2 x options.connect_timeout (seconds)."""
    async with asyncio.timeout(options.connect_timeout * 2):
        ready = via.ready() if via is not None else None
        if ready is not None:
            return (await _send_batch(ready, [command]))[0]
        node = _Node(host, port, options, lambda node: None)
        try:
            opened = await node.connect()
            return (await _send_batch(opened, [command]))[0]
        finally:
            node.close()


def _is_readonly(reply: object) -> bool:
    """READONLY, also inside a script's error ("ERR Error running script ... -READONLY ...")."""
    return isinstance(reply, ResponseError) and "READONLY" in str(reply)


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()


# ---- from the config --------------------------------------------------------------------------


def open_pipelined(
    settings: RedisSettings, timeout_seconds: float | None = None, max_in_flight: int | None = None,
    stall_seconds: float | None = None,
) -> PipelinedRedis:
    """A PipelinedRedis for the topology `settings` describe, by the rules of
    extproc.storage.client.open_redis: `timeout_seconds` (seconds; default
    settings.socket_timeout_seconds) bounds connecting and is every call's default deadline;
    `max_in_flight` defaults to settings.max_connections (the calls that may wait on Redis at
    once, as the pool's connections bound them for redis-py); `stall_seconds` as in
    PipelinedRedis. Nothing is contacted yet.

    Raises ConfigError when `password_env` or `sentinel.password_env` names an unset variable,
    or a TLS file cannot be used."""
    timeout = settings.socket_timeout_seconds if timeout_seconds is None else timeout_seconds
    password = secret_from_env(settings.password_env, "redis.password_env")
    tls_settings = redis_tls(settings)
    tls = tls_settings.ssl_context() if tls_settings is not None else None
    common = {"timeout": timeout, "max_in_flight": max_in_flight or settings.max_connections, "stall_seconds": stall_seconds}
    if settings.cluster is not None:
        options = ConnectOptions(settings.username, password, 0, tls, timeout)
        return PipelinedRedis(Cluster([host_port(n) for n in settings.cluster.nodes], options), **common)
    if settings.sentinel is not None:
        options = ConnectOptions(settings.username, password, 0, tls, timeout)
        sentinel_password = secret_from_env(settings.sentinel.password_env, "redis.sentinel.password_env")
        sentinel_options = ConnectOptions(None, sentinel_password, 0, tls, timeout)
        topology = SentinelPrimary([host_port(n) for n in settings.sentinel.sentinels],
                                   settings.sentinel.service_name, options, sentinel_options)
        return PipelinedRedis(topology, **common)
    url = urlparse(settings.url)
    db = int(url.path.lstrip("/") or 0)
    options = ConnectOptions(
        unquote(url.username) if url.username else settings.username,
        unquote(url.password) if url.password else password,
        db, tls, timeout,
    )
    return PipelinedRedis(Standalone(url.hostname or "127.0.0.1", url.port or 6379, options), **common)
