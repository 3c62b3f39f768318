"""The pipelined hot-path client (extproc.storage.pipelined) against a real Redis Cluster of 3
primaries with a replica each (irislab.redis_topologies.LocalCluster): every key goes to the
primary owning its hash slot without a redirection, a slot migration is followed (ASK during it,
MOVED after it), WAIT counts the owner's replica, and a primary killed with calls in flight
leaves no caller hanging and the slot served again once its replica is promoted."""

from __future__ import annotations

import asyncio
import random

import pytest
import redis
from redis.crc import key_slot

from extproc.config import RedisSettings
from extproc.storage.client import REDIS_FAILURES, LuaScript
from extproc.storage.pipelined import Packed, PipelinedRedis, open_pipelined
from irislab.redis_topologies import LocalCluster
from tests.support.pipelined_load import WRITE, Writers, until

ECHO = LuaScript("return {redis.call('GET', KEYS[1]), ARGV[1], #KEYS}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalCluster(tmp_path_factory.mktemp("cluster")) as topology:
        yield topology


def client_for(cluster: LocalCluster, seeds: int = 1, **kwargs) -> PipelinedRedis:
    settings = RedisSettings(cluster={"nodes": cluster.seeds[:seeds]})
    return open_pipelined(settings, **{"timeout_seconds": 5.0, "max_in_flight": 2000, **kwargs})


def node_id(cluster: LocalCluster, node) -> str:
    return cluster.client(node).execute_command("CLUSTER", "MYID").decode()


def owner_client(cluster: LocalCluster, key: str) -> redis.Redis:
    return cluster.client(cluster.primary_for(key))


async def test_every_key_goes_to_the_primary_owning_its_slot(cluster):
    client = client_for(cluster)
    rng = random.Random(7)
    keys = [f"{{tag-{rng.randrange(10**6)}}}:k{i}" for i in range(300)] + [f"plain-{i}" for i in range(300)]
    try:
        assert await client.execute("SET", keys[0], "warm", key=keys[0]) == b"OK"
        before = client.topology.redirections
        replies = await asyncio.gather(*(client.evalsha(WRITE, [k, Packed([k + ":other"])] if "{" in k else [k], [k])
                                         for k in keys))
        assert replies == [k.encode() for k in keys]
        assert client.topology.redirections == before  # each went straight to its owner
        slots = {key_slot(k.encode()) for k in keys}
        assert len({id(client.topology.slots[s]) for s in slots}) == 3  # spread over the 3 primaries
        direct = {node.port: cluster.client(node) for node in cluster.live_nodes()}
        for key in keys:  # on the node our map names, which answers for the slot itself (no MOVED)
            assert direct[client.topology.slots[key_slot(key.encode())].port].get(key) == key.encode(), key
        echoed = await asyncio.gather(*(client.evalsha(ECHO, [k], [i]) for i, k in enumerate(keys)))
        assert echoed == [[k.encode(), str(i).encode(), 1] for i, k in enumerate(keys)]
    finally:
        await client.aclose()


async def test_a_slot_migration_is_followed_by_ask_then_moved(cluster):
    client = client_for(cluster, seeds=len(cluster.seeds))
    key, fresh = "{migrating}:old", "{migrating}:new"
    slot = key_slot(key.encode())
    try:
        assert await client.execute("SET", key, "before", key=key) == b"OK"
        source = cluster.primary_for(key)
        target = next(n for n in cluster.live_nodes() if n is not source
                      and cluster.client(n).execute_command("ROLE")[0] == b"master")
        source_id, target_id = node_id(cluster, source), node_id(cluster, target)
        cluster.client(target).execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
        cluster.client(source).execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
        asks = client.topology.redirections
        # A key the source does not have goes to the target (ASK), which takes it after ASKING.
        assert await client.execute("SET", fresh, "on-target", key=fresh) == b"OK"
        assert client.topology.redirections == asks + 1
        cluster.client(source).execute_command("MIGRATE", "127.0.0.1", target.port, key, 0, 5000)
        assert await client.evalsha(ECHO, [key], ["a"]) == [b"before", b"a", 1]  # moved: ASK again
        assert client.topology.redirections == asks + 2
        asking = redis.Redis(host="127.0.0.1", port=target.port, single_connection_client=True)
        asking.execute_command("ASKING")
        assert asking.get(fresh) == b"on-target"
        asking.close()
        for node in cluster.live_nodes():
            if cluster.client(node).execute_command("ROLE")[0] == b"master":
                cluster.client(node).execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
        moved = client.topology.redirections
        assert await client.execute("GET", key, key=key) == b"before"  # MOVED: the slot map is updated
        assert client.topology.redirections == moved + 1
        assert client.topology.slots[slot].port == target.port
        assert await client.execute("GET", fresh, key=fresh) == b"on-target"
        assert client.topology.redirections == moved + 1  # no redirection any more
    finally:
        await client.aclose()


async def test_wait_counts_the_replica_of_the_owner(cluster):
    client = client_for(cluster)
    try:
        for key in ("{a}:durable", "{b}:durable", "{c}:durable"):
            reply, acked = await client.evalsha_and_wait(WRITE, [key], ["yes"], replicas=1, timeout_ms=2000)
            assert (reply, acked) == (b"yes", 1), key
    finally:
        await client.aclose()


# ---- a primary killed mid-pipeline ------------------------------------------------------------


@pytest.fixture
def doomed_cluster(tmp_path):
    """A cluster of its own: the test kills one of its primaries."""
    with LocalCluster(tmp_path / "doomed") as topology:
        yield topology


async def test_a_primary_killed_mid_pipeline(doomed_cluster):
    cluster = doomed_cluster
    client = client_for(cluster, seeds=len(cluster.seeds), timeout_seconds=30.0, max_in_flight=10_000)
    keys = [f"{{k{i}}}" for i in range(60)]
    victim_key = keys[0]
    try:
        await asyncio.gather(*(client.execute("SET", k, "0", key=k) for k in keys))
        victim = cluster.primary_for(victim_key)
        writers = Writers(client, keys)
        outcomes = writers.outcomes
        await until(lambda: len(outcomes) > 2000, "2000 calls answered before the kill")
        assert client.in_flight > 0  # calls wait on every primary, the victim's too
        victim.stop()
        failed = writers.failures()
        await until(lambda: writers.failures() > failed, "calls failing")
        await asyncio.to_thread(cluster.wait_for_failover, victim_key, victim)
        # Every key answered again, the dead primary's too: the client has asked for the map
        # since the promotion (a call to the dead node fails at once until then).
        answered = writers.answered.copy()
        await until(lambda: all(writers.answered[k] > answered[k] for k in keys),
                    "calls succeeding on every key after the failover", attempts=3000)
        await writers.stop(within_seconds=60)  # the deadline of the calls is 30 s: none may hang near it
        assert client.in_flight == 0
        assert all(o == b"x" or isinstance(o, REDIS_FAILURES) for o in outcomes)
        # Every key is served again, the dead primary's slot by its promoted replica.
        assert await asyncio.gather(*(client.execute("GET", k, key=k) for k in keys)) == [b"x"] * len(keys)
        promoted = cluster.primary_for(victim_key)
        assert client.topology.slots[key_slot(victim_key.encode())].port == promoted.port != victim.port
    finally:
        await client.aclose()


async def test_tryagain_during_a_slot_move_is_retried_within_the_calls_deadline(cluster):
    """Issue 29 item 3: a multi-key call on a slot whose keys are split by a move answers
    TRYAGAIN for as long as the move lasts (seconds). The client goes again, with a backoff,
    while the call's deadline leaves room: a move that ends within it is invisible to the caller;
    one that outlasts it is a TryAgainError at the deadline (the caller's breaker counts it). It
    gave up after 5 x 10 ms before."""
    from redis.exceptions import TryAgainError

    client = client_for(cluster, seeds=len(cluster.seeds), timeout_seconds=1.5)
    tag = "{moving-slot}"
    present, missing = f"{tag}:present", f"{tag}:missing"
    slot = key_slot(present.encode())
    two_keys = LuaScript("return #KEYS")
    try:
        assert await client.execute("SET", present, "x", key=present) == b"OK"
        source = cluster.primary_for(present)
        target = next(n for n in cluster.live_primaries() if n.port != source.port)
        cluster.begin_slot_move(slot, source, target, share=0.0)
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(TryAgainError):  # the move outlasts the call: TRYAGAIN at its deadline
            await client.evalsha(two_keys, [present, missing], [], timeout=0.4)
        assert 0.3 <= loop.time() - started < 1.0
        loop.call_later(0.3, cluster.end_slot_move, slot, source, target)
        started = loop.time()
        assert await client.evalsha(two_keys, [present, missing], []) == 2  # the move ended within the deadline
        assert 0.25 <= loop.time() - started < 1.5
    finally:
        await client.aclose()
