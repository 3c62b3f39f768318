"""The pipelined hot-path client (extproc.storage.pipelined) against a real primary and replica
watched by 3 sentinels (irislab.redis_topologies.LocalSentinel): calls reach the primary the
sentinels name (ROLE checked), WAIT counts the replica, a node that turns out to be a replica is
left for the sentinels' primary, and the primary killed with calls in flight leaves no caller
hanging and the calls served by the promoted replica after the failover."""

from __future__ import annotations

import asyncio

import pytest
import redis

from extproc.config import RedisSettings
from extproc.storage.client import REDIS_FAILURES
from extproc.storage.pipelined import PipelinedRedis, SentinelPrimary, open_pipelined
from irislab.redis_topologies import SERVICE_NAME, LocalSentinel
from tests.support.pipelined_load import WRITE, Writers, until


@pytest.fixture
def sentinel(tmp_path):
    """A topology of its own for each test: the failover test kills its primary."""
    with LocalSentinel(tmp_path / "sentinel") as topology:
        yield topology


def client_for(sentinel: LocalSentinel, **kwargs) -> PipelinedRedis:
    settings = RedisSettings(sentinel={"sentinels": sentinel.addresses, "service_name": SERVICE_NAME})
    return open_pipelined(settings, **{"timeout_seconds": 5.0, "max_in_flight": 2000, **kwargs})


def direct(port: int) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)


async def test_calls_reach_the_primary_and_wait_counts_the_replica(sentinel):
    client = client_for(sentinel)
    try:
        assert await client.evalsha(WRITE, ["s:key"], ["v"]) == b"v"
        assert client.topology.node.port == sentinel.primary.port
        assert direct(sentinel.primary.port).get("s:key") == b"v"
        reply, acked = await client.evalsha_and_wait(WRITE, ["s:durable"], ["yes"], replicas=1, timeout_ms=2000)
        assert (reply, acked) == (b"yes", 1)
        assert direct(sentinel.replica.port).get("s:durable") == b"yes"
    finally:
        await client.aclose()


async def test_a_replica_where_the_primary_was_is_left_for_the_sentinels_primary(sentinel):
    """The node the client holds becomes a replica (as an old primary does when it comes back
    after a failover): its READONLY reply makes the client ask the sentinels again, and a
    connection to a node whose ROLE is not master is refused."""
    client = client_for(sentinel)
    primary, replica = sentinel.primary.port, sentinel.replica.port
    try:
        assert await client.execute("SET", "s:first", "1") == b"OK"
        topology: SentinelPrimary = client.topology
        # The client's node answers as a replica, while the sentinels still name it: both refused.
        direct(replica).execute_command("REPLICAOF", "NO", "ONE")
        direct(primary).execute_command("REPLICAOF", "127.0.0.1", replica)
        with pytest.raises(redis.ResponseError) as raised:
            await client.evalsha(WRITE, ["s:second"], ["2"])
        assert "READONLY" in str(raised.value) and isinstance(raised.value, REDIS_FAILURES)
        assert topology.node is None  # the sentinels are asked again on the next call
        with pytest.raises(redis.exceptions.ReadOnlyError):  # ROLE on connect: a replica is no primary
            await client.execute("SET", "s:second", "2")
    finally:
        await client.aclose()
        direct(primary).execute_command("REPLICAOF", "NO", "ONE")
        direct(replica).execute_command("REPLICAOF", "127.0.0.1", primary)


async def test_the_primary_killed_mid_pipeline_fails_over(sentinel):
    client = client_for(sentinel, timeout_seconds=30.0, max_in_flight=10_000)
    keys = [f"s:{i}" for i in range(50)]
    try:
        old = sentinel.primary
        writers = Writers(client, keys)
        outcomes = writers.outcomes
        await until(lambda: len(outcomes) > 2000, "2000 calls answered before the kill")
        assert client.in_flight > 0  # calls wait on the primary
        old.stop()
        await until(lambda: writers.failures() > 0, "calls failing")
        promoted = await asyncio.to_thread(sentinel.wait_for_failover)
        answered = len(outcomes)
        await until(lambda: outcomes[answered:].count(b"x") > 1000, "calls succeeding after the failover", attempts=3000)
        await writers.stop(within_seconds=60)  # the calls' deadline is 30 s: none may hang near it
        assert client.in_flight == 0
        assert all(o == b"x" or isinstance(o, REDIS_FAILURES) for o in outcomes)
        assert client.topology.node.port == promoted.port != old.port
        assert await asyncio.gather(*(client.execute("GET", k) for k in keys)) == [b"x"] * len(keys)
        assert direct(promoted.port).mget(keys) == [b"x"] * len(keys)
    finally:
        await client.aclose()
