"""The gateway's wiring of the routing scripts' client (extproc.operations.gateway.open_hot_path
and extproc.protocol.live.build_live): `redis.hot_path_client` picks it, it is restart-only, and
every config a reload builds shares the process's one client."""

from __future__ import annotations

from extproc.config import parse_config, restart_only_fields
from extproc.config.schema import RedisSettings
from extproc.operations.gateway import open_hot_path
from extproc.operations.reload import keep_restart_only
from extproc.protocol.live import build_live
from extproc.routing.degraded import DegradedFlags
from extproc.storage.pipelined import PipelinedRedis
from tests.support.configs import small_config_data


def config_with(client: str | None, redis_url: str):
    data = small_config_data(redis_url)
    if client is not None:
        data["redis"]["hot_path_client"] = client
    return parse_config(data)


async def test_pipelined_is_the_default_and_redis_py_falls_back(redis_url):
    default = open_hot_path(config_with(None, redis_url))
    assert isinstance(default, PipelinedRedis) and default.max_in_flight == 8 * 64 and default.timeout == 0.5
    await default.aclose()
    assert open_hot_path(config_with("redis-py", redis_url)) is None


async def test_every_config_shares_the_one_client(redis_client, redis_url):
    config = config_with("pipelined", redis_url)
    hot_path = open_hot_path(config)
    degraded = DegradedFlags(redis_client, config)
    first = build_live(config, redis_client, degraded, b"secret", hot_path=hot_path)
    reloaded = build_live(config_with("pipelined", redis_url), redis_client, degraded, b"secret", hot_path=hot_path)
    assert first.state.hot_path is hot_path and reloaded.state.hot_path is hot_path
    pin, admission = await reloaded.state.get_pin_and_try_admit("m", "s", ["iris-1"])
    assert pin is None and admission.lease is not None
    await hot_path.aclose()


def test_the_client_is_restart_only(redis_url):
    assert "hot_path_client" in restart_only_fields(RedisSettings)
    running, new = config_with("pipelined", redis_url), config_with("redis-py", redis_url)
    kept, changed = keep_restart_only(running, new)
    assert kept.redis.hot_path_client == "pipelined" and changed == ["redis.hot_path_client"]
