"""The Redis client for the configured topology, and Lua scripts that survive any node.

`open_redis(settings)` builds one client for `config.redis`: a standalone Redis (`url`), a
Redis Cluster (`cluster.nodes`: seed nodes; redis-py's `RedisCluster` learns the slot map and
follows MOVED / ASK), or a primary behind Sentinel (`sentinel`: redis-py's `Sentinel.master_for`,
which asks the sentinels for the primary again after a failover). Every key the routing state
uses carries a hash tag (one per model, one for the instance registry), so no command or script
crosses slots in a cluster.

`LuaScript` runs a script by EVALSHA and answers NOSCRIPT with EVAL of the source on the same
connection: in a cluster that is the node owning the script's first key, so a promoted replica,
a restarted node or a `SCRIPT FLUSH` costs one EVAL, and no `SCRIPT LOAD` has to reach every
primary (one of which may be the dead one).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Awaitable, Sequence
from typing import TypeVar

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError, NoScriptError, RedisClusterException, RedisError

from extproc.config import ConfigError, RedisSettings
from extproc.storage.tls import redis_tls

RedisClient = Redis | RedisCluster


T = TypeVar("T")

REDIS_FAILURES: tuple[type[Exception], ...] = (RedisError, RedisClusterException)
"""What the Redis client raises for a Redis it cannot use, to catch as one: redis-py's cluster
client raises RedisClusterException (and its SlotNotCoveredError, "no node covers this slot")
outside RedisError when no node is reachable."""


async def in_own_task(call: Awaitable[T]) -> T:
    """Await a Redis call in a task of its own, so that a cancellation of the caller (a decision's
    timeout, a lost lease ending its stream, a drain) is raised in the caller at once and never
    lost: on Python 3.11 redis-py's send path (`asyncio.wait_for`) can swallow a cancellation that
    lands while a command is sent (CPython gh-86296, fixed in 3.12). The call itself runs on to
    its end; its result or error is then dropped. Raises what the call raises."""
    task = asyncio.ensure_future(call)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        task.add_done_callback(_retrieve)
        raise


def _retrieve(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


async def redis_time_ms(redis: RedisClient, key: str) -> int:
    """Redis `TIME` in milliseconds, from the node that owns `key` in a Redis Cluster (whose
    clocks may differ: the time a script compares with is its own node's), else from the server.
    Raises what the client raises."""
    if isinstance(redis, RedisCluster):
        await redis.initialize()  # the slot map, once (a no-op after the first command)
        seconds, micros = await redis.execute_command("TIME", target_nodes=redis.get_node_from_key(key))
    else:
        seconds, micros = await redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


def open_redis(settings: RedisSettings, timeout_seconds: float | None = None) -> RedisClient:
    """A client for the configured topology. `timeout_seconds` (seconds) overrides
    `settings.socket_timeout_seconds` for connecting, each command and waiting for a pooled
    connection. TLS as extproc.storage.tls gives it, to every connection (the sentinels' too).
    Nothing is contacted yet.

    Raises ConfigError when `password_env` or `sentinel.password_env` names an unset variable,
    or a TLS file cannot be used."""
    timeout = settings.socket_timeout_seconds if timeout_seconds is None else timeout_seconds
    password = secret_from_env(settings.password_env, "redis.password_env")
    tls = redis_tls(settings)
    tls_kwargs = tls.redis_py_kwargs() if tls is not None else {}
    if settings.cluster is not None:
        return RedisCluster(
            startup_nodes=[ClusterNode(*host_port(node)) for node in settings.cluster.nodes],
            username=settings.username,
            password=password,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            max_connections=settings.max_connections,
            # A slot whose primary is down must not stop the others (its models wait for failover).
            require_full_coverage=False,
            # One retry after a connection error, at once: the client reloads the slot map in between.
            retry=Retry(NoBackoff(), retries=1),
            **tls_kwargs,
        )
    if settings.sentinel is not None:
        common = {"socket_timeout": timeout, "socket_connect_timeout": timeout, **tls_kwargs}
        sentinel_password = secret_from_env(settings.sentinel.password_env, "redis.sentinel.password_env")
        sentinel = Sentinel(
            [host_port(node) for node in settings.sentinel.sentinels],
            min_other_sentinels=0,
            sentinel_kwargs={**common, "password": sentinel_password},
            username=settings.username,
            password=password,
            **common,
        )
        return sentinel.master_for(
            settings.sentinel.service_name,
            max_connections=settings.max_connections,
            retry=Retry(NoBackoff(), retries=1, supported_errors=(ConnectionError,)),  # never a timeout
            retry_on_error=[ConnectionError],
        )
    auth = {k: v for k, v in (("username", settings.username), ("password", password)) if v}
    if tls is not None:  # `rediss://` or `tls: true` with `redis://` alike
        auth.update(tls.redis_py_pool_kwargs())
    return connect(settings.url, timeout, settings.max_connections, **auth)


def connect(url: str, timeout_seconds: float = 0.5, max_connections: int = 64, **connection_kwargs) -> Redis:
    """An asyncio Redis client whose pool waits (up to `timeout_seconds`, seconds) for a free
    connection instead of failing when `max_connections` are busy. Commands time out after
    `timeout_seconds` too, so a dead Redis costs a request at most that long per round trip.

    A command that meets a broken connection (a pooled connection to a Redis that restarted) is
    retried once on a new one: every script is idempotent (admissions replay by lease id). A
    timeout is not retried (redis-py's default would retry it once, so one slow reply cost twice
    the timeout). A pool with no free connection within the timeout raises
    redis.exceptions.ConnectionError "No connection available." (see `state.is_pool_exhausted`).
    `connection_kwargs` (for example username, password) go to every connection."""
    pool = BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=timeout_seconds,
        socket_timeout=timeout_seconds,
        socket_connect_timeout=timeout_seconds,
        retry=Retry(NoBackoff(), retries=1, supported_errors=(ConnectionError,)),
        retry_on_error=[ConnectionError],
        **connection_kwargs,
    )
    return Redis(connection_pool=pool)


class LuaScript:
    """One Lua script, called as `await script(redis, keys, args)`: EVALSHA, and on NOSCRIPT the
    full source by EVAL on the same node (which caches it there for the next EVALSHA). Raises
    redis.exceptions.RedisError like any command."""

    def __init__(self, source: str):
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    async def __call__(self, redis: RedisClient, keys: Sequence[object], args: Sequence[object]) -> object:
        try:
            return await redis.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await redis.eval(self.source, len(keys), *keys, *args)

    async def call_and_wait(
        self, redis: RedisClient, keys: Sequence[object], args: Sequence[object], replicas: int, timeout_ms: int
    ) -> tuple[object, int]:
        """The script, then `WAIT replicas timeout_ms` (milliseconds) on the same connection, in
        one pipeline: returns (the script's reply, how many replicas acknowledged every write of
        that connection so far). WAIT returns at once when the script wrote nothing new. In a
        cluster both commands go to the node owning the first key; when the slot map changed
        under the call (MOVED: the script ran elsewhere) the count is 0. NOSCRIPT is recovered
        as in `__call__`. Raises redis.exceptions.RedisError like any command."""
        reply, acked = await self._pipelined(redis, keys, args, replicas, timeout_ms, ("EVALSHA", self.sha))
        if isinstance(reply, NoScriptError):
            reply, acked = await self._pipelined(redis, keys, args, replicas, timeout_ms, ("EVAL", self.source))
        if isinstance(reply, Exception):
            raise reply
        if isinstance(acked, Exception):
            raise acked
        return reply, int(acked)

    async def _pipelined(self, redis, keys, args, replicas, timeout_ms, command) -> tuple[object, object]:
        wait_on = {}
        node = None
        if isinstance(redis, RedisCluster):
            await redis.initialize()  # the slot map (a no-op once known)
            node = redis.get_node_from_key(keys[0])
            wait_on = {"target_nodes": node}
        async with redis.pipeline(transaction=False) as pipe:
            pipe.execute_command(*command, len(keys), *keys, *args)
            pipe.execute_command("WAIT", replicas, timeout_ms, **wait_on)
            reply, acked = await pipe.execute(raise_on_error=False)
        if node is not None and redis.get_node_from_key(keys[0]) is not node and not isinstance(acked, Exception):
            acked = 0
        return reply, acked

    async def load(self, redis: RedisClient) -> None:
        """SCRIPT LOAD (in a cluster, on every primary). Optional: calls load on demand."""
        await redis.script_load(self.source)


def secret_from_env(env: str | None, field: str) -> str | None:
    """The value of the environment variable `env` (None when `env` is None). Raises ConfigError,
    naming the setting `field`, when the variable is unset or empty."""
    if env is None:
        return None
    value = os.environ.get(env)
    if not value:
        raise ConfigError("environment", [f"{field}: environment variable {env} is not set"])
    return value


def host_port(node: str) -> tuple[str, int]:
    """`host:port` (IPv6 in brackets) as (host, port)."""
    host, port = node.rsplit(":", 1)
    return host.strip("[]"), int(port)


def is_pool_exhausted(error: BaseException) -> bool:
    """Whether `error` is the connection pool's "no free connection within the timeout": load on
    this process, not a sign that Redis is gone (redis-py raises ConnectionError for both)."""
    return isinstance(error, ConnectionError) and isinstance(error.__cause__, (TimeoutError, asyncio.TimeoutError))
