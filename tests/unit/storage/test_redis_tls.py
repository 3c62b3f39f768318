"""TLS to Redis, the same for both clients (extproc.storage.tls): a throwaway CA (trustme) and a
TLS terminator in front of a plain Redis (irislab.tls_redis: the redis-server here is built
without TLS). The terminator's port speaks TLS only, so a call that answers went over TLS,
verified against the CA and the name 127.0.0.1.

Standalone here; a Redis Cluster and Sentinel over TLS in tests/gateway/test_redis_tls_topologies.py."""

from __future__ import annotations

import pytest

from extproc.config import ConfigError, RedisSettings, parse_config
from extproc.routing.state import RoutingState
from extproc.storage.client import open_redis
from extproc.storage.pipelined import open_pipelined
from extproc.storage.tls import is_tls_failure
from irislab.tls_redis import TlsCa, TlsStandalone, start_terminator
from tests.support.configs import small_config_data
from tests.support.redis_tls import admit_and_release, routing_config, serve_once


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    with TlsStandalone(tmp_path_factory.mktemp("tls-redis")) as started:
        yield started


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory) -> TlsCa:
    """A CA that signed nothing the server shows."""
    return TlsCa(tmp_path_factory.mktemp("other-ca"), name="other CA").write()


@pytest.mark.parametrize("how", ["rediss-url", "tls-flag-with-redis-url"])
async def test_both_clients_run_the_routing_scripts_over_tls(tls_redis, how):
    """`rediss://` with `tls_ca_file`, and `tls: true` with a `redis://` URL: redis-py and the
    pipelined client both reach the TLS-only port and run the admission and release scripts."""
    url = tls_redis.url if how == "rediss-url" else tls_redis.url.replace("rediss://", "redis://")
    config = routing_config(url=url, tls_ca_file=str(tls_redis.ca.ca_file), tls=how != "rediss-url")
    redis_py = open_redis(config.redis, timeout_seconds=5)
    pipelined = open_pipelined(config.redis, timeout_seconds=5)
    try:
        await redis_py.flushall()
        over_redis_py = await admit_and_release(RoutingState(redis_py, config))
        await redis_py.flushall()
        over_pipelined = await admit_and_release(RoutingState(redis_py, config, hot_path=pipelined))
        assert await pipelined.execute("PING") == b"PONG"
    finally:
        await pipelined.aclose()
        await redis_py.aclose()
    assert over_redis_py == over_pipelined == ("ADMITTED", "RELEASED")


async def test_a_wrong_ca_is_refused_by_both_clients(tls_redis, other_ca):
    """A CA that did not sign the server's certificate: both clients fail the handshake
    (CERTIFICATE_VERIFY_FAILED), neither reaches Redis."""
    settings = RedisSettings(url=tls_redis.url, tls_ca_file=str(other_ca.ca_file))
    errors = []
    redis_py, pipelined = open_redis(settings, timeout_seconds=5), open_pipelined(settings, timeout_seconds=5)
    try:
        for call in (redis_py.ping, lambda: pipelined.execute("PING")):
            with pytest.raises(Exception) as raised:
                await call()
            errors.append(raised.value)
    finally:
        await pipelined.aclose()
        await redis_py.aclose()
    assert all(is_tls_failure(error) and "CERTIFICATE_VERIFY_FAILED" in str(error) for error in errors), errors


async def test_a_client_certificate_reaches_a_redis_that_asks_for_one(tls_redis, tmp_path):
    """A terminator that asks for a client certificate (Redis's `tls-auth-clients yes`): both
    clients present `tls_cert_file` / `tls_key_file`; without them both are turned away."""
    asking = start_terminator(tmp_path, tls_redis.redis.port, tls_redis.ca, client_certificates=True)
    clients = []
    try:
        url = f"rediss://127.0.0.1:{asking.port}/0"
        ca = tls_redis.ca
        with_cert = RedisSettings(url=url, tls_ca_file=str(ca.ca_file), tls_cert_file=str(ca.client_cert),
                                  tls_key_file=str(ca.client_key))
        without = RedisSettings(url=url, tls_ca_file=str(ca.ca_file))
        clients = [open_redis(with_cert, timeout_seconds=5), open_pipelined(with_cert, timeout_seconds=5),
                   open_redis(without, timeout_seconds=2), open_pipelined(without, timeout_seconds=2)]
        assert await clients[0].ping() is True
        assert await clients[1].execute("PING") == b"PONG"
        for client in clients[2:]:
            with pytest.raises(Exception):
                await (client.ping() if hasattr(client, "ping") else client.execute("PING"))
    finally:
        for client in clients:
            await client.aclose()
        asking.stop()


def test_serve_refuses_to_start_when_the_ca_does_not_verify_redis(tls_redis, other_ca, tmp_path):
    """`iris-extproc serve` with a CA that does not verify Redis exits 2 at start with the
    handshake's error, instead of serving with every decision going to the third party."""
    done = serve_once(tmp_path, {"url": tls_redis.url, "tls_ca_file": str(other_ca.ca_file)})
    assert done.returncode == 2, done.stderr[-3000:]
    assert "TLS handshake failed" in done.stderr and "CERTIFICATE_VERIFY_FAILED" in done.stderr, done.stderr[-3000:]
    assert str(other_ca.ca_file) in done.stderr


@pytest.mark.parametrize("redis, problem", [
    ({"url": "redis://127.0.0.1:6379/0", "tls_ca_file": "/ca.pem"}, "redis.tls_ca_file: TLS is off"),
    ({"url": "rediss://127.0.0.1:6379/0", "tls_key_file": "/k.pem"}, "redis.tls_key_file: needs redis.tls_cert_file"),
    ({"url": "rediss://127.0.0.1:6379/0?ssl_cert_reqs=none"}, "redis.url: query options are not supported"),
])
def test_tls_settings_that_cannot_work_are_refused_with_the_config(redis, problem):
    with pytest.raises(ConfigError) as raised:
        parse_config(small_config_data(redis["url"], redis=redis))
    assert any(p.startswith(problem) for p in raised.value.problems), raised.value.problems


def test_a_ca_file_that_cannot_be_read_is_refused_by_both_clients(tmp_path):
    settings = RedisSettings(url="rediss://127.0.0.1:6379/0", tls_ca_file=str(tmp_path / "missing.pem"))
    for open_client in (open_redis, open_pipelined):
        with pytest.raises(ConfigError, match="redis.tls_ca_file: cannot use"):
            open_client(settings)
