"""Shared fixtures: a real redis-server on a free loopback port, started once per test session
and stopped by pid; each test gets an empty database and a config."""

from __future__ import annotations

from pathlib import Path

import pytest

from extproc.config import parse_config
from extproc.state import RoutingState, connect
from irislab.processes import start_redis

ROOT = Path(__file__).resolve().parent.parent


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


def small_config_data(redis_url: str = "redis://127.0.0.1:6379/0", **overrides) -> dict:
    """Two managed providers with small limits for model m, one unlimited third party."""
    limits = {
        "max_pinned_sessions": 2,
        "max_global_in_flight_request_slots": 4,
        "global_in_flight_request_slots_reserved_for_pinned_sessions": 1,
        "max_per_session_in_flight_request_slots": 2,
    }
    data = {
        "providers": [
            {"name": "iris-1", "kind": "managed", "cluster": "iris-1",
             "models": {"m": {"features": ["chat", "completions", "tools"], "limits": limits},
                        "e": {"features": ["embeddings"], "limits": limits}}},
            {"name": "iris-2", "kind": "managed", "cluster": "iris-2",
             "models": {"m": {"features": ["chat", "completions"], "limits": limits}}},
            {"name": "tensorx", "kind": "unlimited", "cluster": "tensorx",
             "models": {"m": {"features": ["chat", "completions", "tools"]},
                        "e": {"features": ["embeddings"]}}},
        ],
        "redis": {"url": redis_url, "key_prefix": "t"},
    }
    data.update(overrides)
    return data


@pytest.fixture
def small_config(redis_url):
    return parse_config(small_config_data(redis_url))


@pytest.fixture
def state(redis_client, small_config) -> RoutingState:
    return RoutingState(redis_client, small_config)
