"""`redis.durable_admissions` (issue 13) on a real primary and replica: every admitting script is
followed by `WAIT <replicas> <timeout_ms>` on the same connection, so an admission answered
ADMITTED is already on the replica; with the replica gone the admission still stands after the
timeout and is counted (iris_admissions_not_replicated_total) and logged. The cluster and
sentinel forms run in tests/gateway/test_redis_topologies.py."""

from __future__ import annotations

import logging

import pytest
import redis

from extproc import metrics
from extproc.config import ConfigError, parse_config
from extproc.routing.state import ADMITTING_SCRIPTS, CAPACITY_RESULTS, SCRIPT_NAMES, Result, RoutingState
from extproc.storage.client import LuaScript, connect
from extproc.storage.pipelined import open_pipelined
from irislab.processes import start_redis
from irislab.redis_topologies import start_replica
from tests.support.configs import small_config_data


@pytest.fixture
def replicated(tmp_path):
    primary = start_redis(tmp_path / "primary")
    replica = start_replica(tmp_path / "replica", primary.port)
    yield primary, replica
    replica.stop()
    primary.stop()


def durable_config(url: str, timeout_ms: int = 50):
    return parse_config(small_config_data(url, redis={"url": url, "key_prefix": "d",
                                                      "durable_admissions": {"replicas": 1, "timeout_ms": timeout_ms}}))


def hot_path_for(kind: str, config):
    """The routing scripts' client of `kind` (config `redis.hot_path_client`): None for redis-py."""
    return None if kind == "redis-py" else open_pipelined(config.redis, timeout_seconds=5)


async def close(hot_path) -> None:
    if hot_path is not None:
        await hot_path.aclose()


def not_replicated() -> float:
    return metrics.ADMISSIONS_NOT_REPLICATED._value.get()


def on_replica(replica, state: RoutingState, lease) -> bool:
    """Whether the replica's pair leases key holds `lease`, read without waiting."""
    client = redis.Redis(host="127.0.0.1", port=replica.port)
    return client.zscore(state.keys.provider_leases(lease.model, lease.provider), lease.id) is not None


def test_every_admitting_script_is_named():
    assert ADMITTING_SCRIPTS <= set(SCRIPT_NAMES)
    assert {"renew", "release", "abandon", "get_pin"}.isdisjoint(ADMITTING_SCRIPTS)


async def test_wait_answers_one_replica_on_the_connection_that_wrote(replicated):
    primary, replica = replicated
    client = connect(f"redis://127.0.0.1:{primary.port}/0", timeout_seconds=5)
    try:
        script = LuaScript("redis.call('SET', KEYS[1], ARGV[1]) return 'OK'")
        await client.script_flush()  # the first call meets NOSCRIPT: EVAL then WAIT, on one connection
        assert await script.call_and_wait(client, ["k"], ["v"], 1, 1000) == (b"OK", 1)
        assert await script.call_and_wait(client, ["k"], ["w"], 1, 1000) == (b"OK", 1)
    finally:
        await client.aclose()
    assert redis.Redis(host="127.0.0.1", port=replica.port).get("k") == b"w"


@pytest.mark.parametrize("client_kind", ["redis-py", "pipelined"])
async def test_admissions_are_on_the_replica_when_answered(replicated, client_kind):
    primary, replica = replicated
    config = durable_config(f"redis://127.0.0.1:{primary.port}/0", timeout_ms=400)
    client = connect(config.redis.url, timeout_seconds=5)
    hot_path = hot_path_for(client_kind, config)
    before = not_replicated()
    try:
        state = RoutingState(client, config, hot_path=hot_path)
        pin, first = await state.get_pin_and_try_admit("m", "s1", ["iris-1"])
        assert first.result is Result.ADMITTED and on_replica(replica, state, first.lease)
        second = await state.try_admit_pinned_session_request("m", "s1")
        assert second.result is Result.ADMITTED and on_replica(replica, state, second.lease)
        temporary = await state.try_admit_request_without_pin("iris-2", "m")
        assert temporary.result is Result.ADMITTED and on_replica(replica, state, temporary.lease)
        repinned = await state.try_compare_and_swap_pin_and_admit_request(first.pin, "m", "s1", "iris-2")
        assert repinned.admission.result is Result.ADMITTED and on_replica(replica, state, repinned.admission.lease)
        await state.release_request_lease(temporary.lease, refresh_pin=False)
        adopted = await state.adopt_request_lease(temporary.lease)
        assert adopted.result is Result.ADMITTED and on_replica(replica, state, adopted.lease)
        # A refusal is answered as before (it wrote nothing new to wait for).
        assert (await state.try_admit_unpinned_session_request("iris-1", "m", "s2")).result is Result.ADMITTED
        assert (await state.try_admit_unpinned_session_request("iris-1", "m", "s3")).result in CAPACITY_RESULTS
    finally:
        await close(hot_path)
        await client.aclose()
    assert not_replicated() == before


@pytest.mark.parametrize("client_kind", ["redis-py", "pipelined"])
async def test_with_the_replica_gone_admissions_stand_and_are_counted(replicated, caplog, client_kind):
    primary, replica = replicated
    config = durable_config(f"redis://127.0.0.1:{primary.port}/0", timeout_ms=50)
    client = connect(config.redis.url, timeout_seconds=5)
    hot_path = hot_path_for(client_kind, config)
    replica.stop()
    before = not_replicated()
    try:
        state = RoutingState(client, config, hot_path=hot_path)
        with caplog.at_level(logging.WARNING, logger="extproc.routing.state"):
            first = await state.try_admit_unpinned_session_request("iris-1", "m", "s1")
            second = await state.try_admit_pinned_session_request("m", "s1")
        assert first.result is Result.ADMITTED and second.result is Result.ADMITTED
        # They hold their slots like any lease: the primary counts them.
        assert await client.zcard(state.keys.provider_leases("m", "iris-1")) == 2
        other = await state.try_admit_unpinned_session_request("iris-1", "m", "s2")
        refused = await state.try_admit_unpinned_session_request("iris-1", "m", "s3")
        assert other.result is Result.ADMITTED and refused.result is Result.PIN_LIMIT_REACHED
    finally:
        await close(hot_path)
        await client.aclose()
    assert not_replicated() - before == 3  # the refusal is not an admission
    warnings = [r for r in caplog.records if "not acknowledged" in r.getMessage()]
    assert len(warnings) == 1  # one line per interval, whatever the count
    assert "model m" in warnings[0].getMessage()


def test_config_rejects_a_wait_longer_than_the_command_timeout():
    data = small_config_data(redis={"url": "redis://127.0.0.1:6379/0", "socket_timeout_seconds": 0.05,
                                    "durable_admissions": {"replicas": 1, "timeout_ms": 50}})
    with pytest.raises(ConfigError, match="durable_admissions.timeout_ms"):
        parse_config(data)
    assert parse_config(small_config_data()).redis.durable_admissions is None
    defaults = parse_config(small_config_data(redis={"durable_admissions": {}})).redis.durable_admissions
    assert (defaults.replicas, defaults.timeout_ms) == (1, 50)

