"""TLS to a Redis Cluster and to Sentinel, the same for both clients (extproc.storage.tls):
`tls: true` with `tls_ca_file` (a trustme CA) reaches every node of a 3-primary Cluster whose
nodes announce TLS-only ports, and, behind Sentinel, the sentinel itself and the primary it
names (irislab.tls_redis: terminators before plain Redis and sentinel processes). A wrong CA is
refused by both clients, and by `serve` at start."""

from __future__ import annotations

import pytest

from extproc.routing.state import RoutingState
from extproc.storage.client import open_redis
from extproc.storage.pipelined import open_pipelined
from extproc.storage.tls import is_tls_failure
from irislab.redis_topologies import SERVICE_NAME
from irislab.tls_redis import TlsCa, TlsCluster, TlsSentinel, tls_connections
from tests.support.gateway import wait_until
from tests.support.redis_tls import admit_and_release, routing_config, serve_once


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory):
    with TlsCluster(tmp_path_factory.mktemp("tls-cluster")) as started:
        yield started


@pytest.fixture(scope="module")
def tls_sentinel(tmp_path_factory):
    with TlsSentinel(tmp_path_factory.mktemp("tls-sentinel")) as started:
        yield started


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory) -> TlsCa:
    """A CA that signed nothing the servers show."""
    return TlsCa(tmp_path_factory.mktemp("other-ca"), name="other CA").write()


def topology(started: TlsCluster | TlsSentinel) -> dict:
    if isinstance(started, TlsCluster):
        return {"cluster": {"nodes": started.seeds}}
    return {"sentinel": {"sentinels": started.addresses, "service_name": SERVICE_NAME}}


@pytest.fixture(params=["cluster", "sentinel"])
def tls_topology(request):
    return request.getfixturevalue(f"tls_{request.param}")


async def test_both_clients_run_the_routing_scripts_over_tls(tls_topology):
    """redis-py and the pipelined client run the admission and release scripts through TLS
    verified against the CA: in the Cluster on the nodes' TLS-only ports, behind Sentinel on the
    primary's terminator (whose TLS connections are counted: the sentinel's own are plain)."""
    config = routing_config(**topology(tls_topology), tls=True, tls_ca_file=str(tls_topology.ca.ca_file))
    primary_tls = getattr(tls_topology, "primary_tls", None)
    redis_py = open_redis(config.redis, timeout_seconds=5)
    pipelined = open_pipelined(config.redis, timeout_seconds=5)
    try:
        before = primary_tls and tls_connections(primary_tls)
        over_redis_py = await admit_and_release(RoutingState(redis_py, config))
        if primary_tls is not None:
            assert wait_until(lambda: tls_connections(primary_tls) > before, 10), "no TLS connection to the primary"
            before = tls_connections(primary_tls)
        over_pipelined = await admit_and_release(RoutingState(redis_py, config, hot_path=pipelined))
        if primary_tls is not None:
            assert wait_until(lambda: tls_connections(primary_tls) > before, 10), "no TLS connection to the primary"
    finally:
        await pipelined.aclose()
        await redis_py.aclose()
    assert over_redis_py == over_pipelined == ("ADMITTED", "RELEASED")


async def test_a_wrong_ca_is_refused_by_both_clients(tls_topology, other_ca):
    config = routing_config(**topology(tls_topology), tls=True, tls_ca_file=str(other_ca.ca_file))
    redis_py, pipelined = open_redis(config.redis, timeout_seconds=5), open_pipelined(config.redis, timeout_seconds=5)
    errors = []
    try:
        for call in (lambda: redis_py.set("{m}x", 1), lambda: pipelined.execute("SET", "{m}x", 1, key="{m}x")):
            with pytest.raises(Exception) as raised:
                await call()
            errors.append(raised.value)
    finally:
        await pipelined.aclose()
        await redis_py.aclose()
    assert all(is_tls_failure(error) and "CERTIFICATE_VERIFY_FAILED" in str(error) for error in errors), errors


def test_serve_refuses_to_start_when_the_ca_does_not_verify_redis(tls_topology, other_ca, tmp_path):
    done = serve_once(tmp_path, {**topology(tls_topology), "tls": True, "tls_ca_file": str(other_ca.ca_file)})
    assert done.returncode == 2, done.stderr[-3000:]
    assert "TLS handshake failed" in done.stderr and "CERTIFICATE_VERIFY_FAILED" in done.stderr, done.stderr[-3000:]
