"""Shared fixtures: a real redis-server on a free loopback port, started once per test session
and stopped by pid; each test gets an empty database and a config. Helpers live in tests/support.

The tree mirrors the product: unit/<package>/ for each extproc package, gateway/ for the whole
gateway (real Envoy, Redis and simulated providers), model_based/ for the reference model and the
differential checks, packaging/ for the wheel, the deployment files and the import layers,
benchmarks/ for the benchmarks' smoke runs, lab/ for irislab, docs/ for the documentation."""

from __future__ import annotations

import pytest

from extproc.config import RedisSettings, parse_config
from extproc.routing.state import RoutingState, connect
from extproc.storage.pipelined import open_pipelined
from irislab.processes import start_redis
from tests.support.configs import small_config_data


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    process = start_redis(tmp_path_factory.mktemp("redis"))
    yield process
    process.stop()


@pytest.fixture
def redis_url(redis_server) -> str:
    return f"redis://127.0.0.1:{redis_server.port}/0"


@pytest.fixture
async def redis_client(redis_url):
    client = connect(redis_url, timeout_seconds=5)
    await client.flushall()
    yield client
    await client.aclose()


@pytest.fixture
def small_config(redis_url):
    return parse_config(small_config_data(redis_url))


@pytest.fixture(params=["redis-py", "pipelined"])
async def hot_path(request, redis_url):
    """The client the routing scripts go over (config `redis.hot_path_client`), each in turn:
    None (redis-py, the `redis_client`) or the pipelined client (closed after the test)."""
    if request.param == "redis-py":
        yield None
        return
    client = open_pipelined(RedisSettings(url=redis_url), timeout_seconds=5)
    yield client
    await client.aclose()


@pytest.fixture
def state(redis_client, small_config, hot_path) -> RoutingState:
    """The routing state of `small_config`, its scripts over each `hot_path` client in turn."""
    return RoutingState(redis_client, small_config, hot_path=hot_path)
