"""Redis topologies (issue 13): a standalone Redis with a password, a Redis Cluster of 3
primaries with a replica each, and a primary + replica watched by 3 sentinels, all real local
processes of the same redis-server binary (irislab.redis_topologies).

Every script and every other command of the routing state runs unchanged on each topology (a
command crossing slots fails in a cluster with CROSSSLOT); NOSCRIPT is recovered on whichever
node answers; and a primary killed under load (long streams across the failover) leaves routing
degraded only until the failover, with no hang, crash or leak. The routing scripts run over both
of their clients (config `redis.hot_path_client`: redis-py, and the pipelined client the
gateways of the failover tests use by default). The failover tests print what they
measure: the provider-observed in-flight peak over the limit and how long routing was degraded."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
import redis
from redis.cluster import ClusterNode
from redis.cluster import RedisCluster as SyncCluster

from extproc import metrics
from extproc.config import ConfigError, parse_config
from extproc.operations.fleet_state import FleetStateReader
from extproc.operations.health import HealthMonitor
from extproc.routing.degraded import DegradedFlags
from extproc.routing.lease_table import Held, LeaseTable
from extproc.routing.outage import InstanceRegistry, OutagePolicy, RedisBreaker
from extproc.routing.router import Router, RoutingRequest
from extproc.routing.state import EpochSeen, PinMatch, Result, RoutingState, script_source, watching_epoch
from extproc.storage.client import LuaScript, open_redis
from extproc.storage.pipelined import PipelinedRedis, open_pipelined
from irislab.local_gateway import LocalGateway, ProviderSimulation
from irislab.processes import start_redis
from irislab.redis_topologies import SERVICE_NAME, LocalCluster, LocalSentinel
from tests.support.configs import small_config_data
from tests.support.fleet import LoadPlan, run_load
from tests.support.gateway import MODEL, gateway_config, provider_stats, redis_now_ms

ENVOY_MESSAGE_TIMEOUT_SECONDS = 5.0  # envoy/envoy.yaml: no request may wait on routing longer
MODELS = ["m", "e", "alpha", "beta", "gamma", "delta"]  # spread over the shards (checked below)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalCluster(tmp_path_factory.mktemp("cluster")) as topology:
        yield topology


@pytest.fixture(scope="module")
def sentinel(tmp_path_factory):
    with LocalSentinel(tmp_path_factory.mktemp("sentinel")) as topology:
        yield topology


def many_models_config(redis_section: dict):
    """small_config_data with more models on iris-1, so that their hash tags land on several shards."""
    data = small_config_data(redis=redis_section)
    for model in MODELS[2:]:
        data["providers"][0]["models"][model] = {"features": ["chat"], "limits": {"max_global_in_flight_request_slots": 2}}
    return parse_config(data)


def hot_path_for(kind: str, config) -> PipelinedRedis | None:
    """The routing scripts' client of `kind` (config `redis.hot_path_client`): None for redis-py."""
    return None if kind == "redis-py" else open_pipelined(config.redis, timeout_seconds=5)


async def close_both(client, hot_path: PipelinedRedis | None) -> None:
    if hot_path is not None:
        await hot_path.aclose()
    await client.aclose()


async def exercise_everything(config, client_kind: str) -> None:
    """Every routing-state transition (its scripts over the client of `client_kind`), the instance
    registry, degraded flags (set, refresh, the pipelined forms), the fleet-state read and the
    passive window, on every model of `config`."""
    client = open_redis(config.redis, timeout_seconds=5)
    hot_path = hot_path_for(client_kind, config)
    try:
        state = RoutingState(client, config, hot_path=hot_path)
        await state.load_scripts()
        for model in config.models():
            eligible = [p.name for p in config.providers_for(model)][:1]
            pin, admission = await state.get_pin_and_try_admit(model, "s1", eligible)
            assert pin is None and admission.result is Result.ADMITTED, (model, admission)
            assert (await state.get_pin(model, "s1")).provider == eligible[0]
            assert (await state.try_admit_pinned_session_request(model, "s1")).result is Result.ADMITTED
            other = await state.try_admit_unpinned_session_request(eligible[0], model, "s2")
            assert other.result in (Result.ADMITTED, Result.PIN_LIMIT_REACHED, Result.GLOBAL_IN_FLIGHT_REQUEST_LIMIT_REACHED)
            cas = await state.try_compare_and_swap_pin_and_admit_request(admission.pin, model, "s1", eligible[0])
            assert cas.pin_match is PinMatch.MATCHED
            assert (await state.renew_request_lease(admission.lease)).result is Result.RENEWED
            assert (await state.release_request_lease(admission.lease, refresh_pin=True)).result is Result.RELEASED
            temporary = await state.try_admit_request_without_pin(eligible[0], model)
            assert temporary.result in (Result.ADMITTED, Result.GLOBAL_IN_FLIGHT_REQUEST_LIMIT_REACHED,
                                        Result.UNRESERVED_IN_FLIGHT_REQUEST_LIMIT_REACHED)
            adopted = await state.adopt_request_lease(admission.lease)
            assert adopted.result is Result.ADMITTED
            await state.release_request_lease(adopted.lease, refresh_pin=False)
        registry = InstanceRegistry(client, config.redis.key_prefix)
        assert await registry.heartbeat() >= 1
        await registry.leave()
        flags = DegradedFlags(client, config)
        pairs = flags.pairs()
        await flags.set_many(pairs, "test", 30, "health")
        await flags.set(*pairs[0], "drained", 30)
        assert set((await flags.refresh())) == set(pairs)
        fleet = await FleetStateReader(config, client).read()  # one pipeline of a script per model: per shard
        assert [len(p.flags) for p in fleet.pairs if (p.provider, p.model) == pairs[0]] == [2]
        assert {(p.provider, p.model) for p in fleet.pairs if p.flags} == set(pairs)
        await flags.clear_many(pairs, "health")
        await flags.clear(*pairs[0])
        assert await flags.refresh() == {}
        monitor = HealthMonitor(config, client, flags)
        for provider, model in pairs:
            assert await monitor.record_failure(provider, model, "status 503") is False
    finally:
        await close_both(client, hot_path)


CLIENT_KINDS = pytest.mark.parametrize("client_kind", ["redis-py", "pipelined"])


@CLIENT_KINDS
def test_cluster_runs_every_command_without_crossing_slots(cluster, client_kind):
    prefix = f"t-{client_kind}"  # the cluster is the module's: each run its own keys
    config = many_models_config({"key_prefix": prefix, "cluster": {"nodes": cluster.seeds[:1]}})
    owners = {cluster.primary_for(f"{{{prefix}:{model}}}").port for model in MODELS}
    assert len(owners) >= 2, "the models should spread over several shards"
    asyncio.run(exercise_everything(config, client_kind))


@CLIENT_KINDS
def test_cluster_batches_renewals_and_releases_per_hash_tag(cluster, client_kind):
    """Issue 24: leases of models on several shards renew in one sweep and release in one loop
    turn, one script call per model (its hash tag, one slot): no CROSSSLOT, every answer its own."""
    prefix = f"tb-{client_kind}"
    config = many_models_config({"key_prefix": prefix, "cluster": {"nodes": cluster.seeds[:1]}})

    async def run() -> None:
        client = open_redis(config.redis, timeout_seconds=5)
        hot_path = hot_path_for(client_kind, config)
        try:
            state = RoutingState(client, config, hot_path=hot_path)
            leases = {}
            for model in config.models():
                provider = config.providers_for(model)[0].name
                admitted = [await state.try_admit_unpinned_session_request(provider, model, f"s{i}") for i in range(2)]
                leases[model] = [a.lease for a in admitted if a.lease is not None]
                assert leases[model], (model, admitted)
            for model, held in leases.items():
                assert {u.result for u in await state.renew_request_leases(held)} == {Result.RENEWED}
            releases = await asyncio.gather(*(state.release_request_leases([(lease, True) for lease in held])
                                              for held in leases.values()))
            assert {u.result for answers in releases for u in answers} == {Result.RELEASED}
        finally:
            await close_both(client, hot_path)

    asyncio.run(run())


def test_cluster_time_comes_from_the_node_that_owns_the_key(cluster):
    """The epoch's age and the instance registry compare with the Redis time of the node their
    key lives on (redis_time_ms), not of whichever node the client picks."""
    from extproc.storage.client import redis_time_ms

    config = many_models_config({"key_prefix": "t3", "cluster": {"nodes": cluster.seeds[:1]}})

    async def run() -> tuple[int, int]:
        client = open_redis(config.redis)
        try:
            key = "{t3}:epoch"
            node = cluster.primary_for(key)
            seconds, micros = cluster.client(node).time()
            return await redis_time_ms(client, key), seconds * 1000 + micros // 1000
        finally:
            await client.aclose()

    ours, owner = asyncio.run(run())
    assert abs(ours - owner) < 1000


@CLIENT_KINDS
def test_cluster_recovers_noscript_on_the_node_that_answers(cluster, client_kind):
    prefix = f"t2-{client_kind}"
    config = many_models_config({"key_prefix": prefix, "cluster": {"nodes": cluster.seeds}})

    async def run() -> None:
        client = open_redis(config.redis, timeout_seconds=5)
        hot_path = hot_path_for(client_kind, config)
        try:
            state = RoutingState(client, config, hot_path=hot_path)  # scripts never loaded: the first call of each meets NOSCRIPT
            for node in cluster.live_nodes():
                cluster.client(node).script_flush()
            for model in MODELS:
                pin, admission = await state.get_pin_and_try_admit(model, "s", ["iris-1"])
                assert admission.result is Result.ADMITTED
            for node in cluster.live_nodes():
                cluster.client(node).script_flush()
            for model in MODELS:  # renewals on every shard after a flush, as after a promotion
                assert (await state.renew_request_lease((await state.try_admit_pinned_session_request(model, "s")).lease)).result \
                    is Result.RENEWED
        finally:
            await close_both(client, hot_path)

    asyncio.run(run())
    sha = LuaScript(script_source("admit_pinned")).sha
    # The script is now cached on exactly the primaries that own a model's slot.
    owners = {cluster.primary_for(f"{{{prefix}:{model}}}").port for model in MODELS}
    cached = {node.port for node in cluster.live_nodes() if cluster.client(node).script_exists(sha)[0]}
    assert owners <= cached


@CLIENT_KINDS
def test_sentinel_runs_every_command(sentinel, client_kind):
    config = many_models_config({"key_prefix": f"s-{client_kind}", "sentinel": {"sentinels": sentinel.addresses,
                                                                             "service_name": SERVICE_NAME}})
    asyncio.run(exercise_everything(config, client_kind))


async def decide_on_every_model(config, client_kind: str) -> tuple[set, str]:
    """A lease table's decision on every chat model of `config` (its scripts over `client_kind`),
    each admitted on iris-1, and the epochs an admission script of each model saw inside
    `watching_epoch` (issue 24). Returns (those epochs, the table's epoch)."""
    client = open_redis(config.redis, timeout_seconds=5)
    hot_path = hot_path_for(client_kind, config)
    try:
        state = RoutingState(client, config, hot_path=hot_path)
        router = Router(config, state, DegradedFlags(client, config))
        table = LeaseTable(config, state, router, OutagePolicy(config, router, InstanceRegistry(client, config.redis.key_prefix)),
                           RedisBreaker(client, 3))
        table.start()
        await table.refresh_epoch()
        seen = EpochSeen()
        for model in [m for m in MODELS if m != "e"]:
            held = await table.decide(RoutingRequest(model, "chat", frozenset(), "s"))
            assert isinstance(held, Held) and held.decision.provider.name == "iris-1", (model, held)
            table.end(held, succeeded=True)
            _, admission = await watching_epoch(state.get_pin_and_try_admit(model, "s2", ["iris-1"]), seen)
            assert admission.result is Result.ADMITTED
        assert not table.breaker.is_open and not table.rebuilding
        await table.drain()
        return seen.epochs, table.epoch
    finally:
        await close_both(client, hot_path)


@CLIENT_KINDS
def test_the_epoch_rides_in_the_scripts_on_sentinel_and_is_read_apart_on_cluster(cluster, sentinel, client_kind):
    """Issue 24: on Sentinel (no hash slots) the admission scripts read the epoch key themselves;
    in a cluster the epoch key `{prefix}:epoch` is in another slot than every model's keys, so
    no script touches it (no CROSSSLOT) and the lease table reads it apart, as before."""
    clustered = many_models_config({"key_prefix": f"t4-{client_kind}", "cluster": {"nodes": cluster.seeds[:1]}})
    epochs, _ = asyncio.run(decide_on_every_model(clustered, client_kind))
    assert epochs == set()
    watched = many_models_config({"key_prefix": f"s4-{client_kind}", "sentinel": {"sentinels": sentinel.addresses,
                                                                                 "service_name": SERVICE_NAME}})
    epochs, epoch = asyncio.run(decide_on_every_model(watched, client_kind))
    assert epochs == {epoch}


def replica_zscore(port: int, key: str, member: str, cluster: bool) -> float | None:
    """ZSCORE read on a replica itself (a cluster replica answers reads after READONLY)."""
    client = redis.Redis(host="127.0.0.1", port=port, single_connection_client=True, socket_timeout=5)
    try:
        if cluster:
            client.execute_command("READONLY")
        return client.zscore(key, member)
    finally:
        client.close()


def durable_admissions_land_on_replicas(config, replica_ports_for, client_kind: str) -> None:
    """With redis.durable_admissions every admission of every model (its scripts over the client
    of `client_kind`) is on a replica of the primary owning the model's slot when it is answered,
    and none counts as not replicated."""
    before = metrics.ADMISSIONS_NOT_REPLICATED._value.get()

    async def run() -> None:
        client = open_redis(config.redis, timeout_seconds=5)
        hot_path = hot_path_for(client_kind, config)
        try:
            state = RoutingState(client, config, hot_path=hot_path)
            await state.load_scripts()  # so that each admission is one EVALSHA and one WAIT (no NOSCRIPT retry)
            for model in MODELS:
                pin, admission = await state.get_pin_and_try_admit(model, "durable", ["iris-1"])
                assert admission.result is Result.ADMITTED
                key = state.keys.provider_leases(model, "iris-1")
                cluster = config.redis.cluster is not None
                held = [replica_zscore(port, key, admission.lease.id, cluster) for port in replica_ports_for(key)]
                assert held and all(score is not None for score in held), (model, held)
        finally:
            await close_both(client, hot_path)

    asyncio.run(run())
    assert metrics.ADMISSIONS_NOT_REPLICATED._value.get() == before


@CLIENT_KINDS
def test_cluster_durable_admissions_wait_on_the_node_owning_the_key(cluster, client_kind):
    prefix = f"t3-{client_kind}"
    config = many_models_config({"key_prefix": prefix, "cluster": {"nodes": cluster.seeds[:1]},
                                 "durable_admissions": {"replicas": 1, "timeout_ms": 400}})
    primaries = [node for node in cluster.live_nodes() if cluster.client(node).execute_command("ROLE")[0] == b"master"]

    def waits() -> dict[int, int]:
        return {node.port: int(cluster.client(node).info("commandstats").get("cmdstat_wait", {"calls": 0})["calls"])
                for node in primaries}

    before = waits()
    durable_admissions_land_on_replicas(config, lambda key: [r.port for r in cluster.replicas_of(cluster.primary_for(key))], client_kind)
    after = waits()
    # One WAIT per admission, each on the primary owning the model's slot (it counts that node's writes only).
    expected = {node.port: 0 for node in primaries}
    for model in MODELS:
        expected[cluster.primary_for(f"{{{prefix}:{model}}}").port] += 1
    assert {port: after[port] - before[port] for port in after} == expected


@CLIENT_KINDS
def test_sentinel_durable_admissions(sentinel, client_kind):
    config = many_models_config({"key_prefix": f"s3-{client_kind}", "sentinel": {"sentinels": sentinel.addresses, "service_name": SERVICE_NAME},
                                 "durable_admissions": {"replicas": 1, "timeout_ms": 400}})
    durable_admissions_land_on_replicas(config, lambda key: [sentinel.replica.port], client_kind)


@CLIENT_KINDS
def test_standalone_with_a_password(tmp_path, monkeypatch, client_kind):
    server = start_redis(tmp_path, extra_args=["--requirepass", "s3cret-pass"])
    try:
        url = f"redis://127.0.0.1:{server.port}/0"
        monkeypatch.setenv("IRIS_TEST_REDIS_PASSWORD", "s3cret-pass")
        asyncio.run(exercise_everything(many_models_config({"url": url, "key_prefix": "p", "password_env": "IRIS_TEST_REDIS_PASSWORD"}),
                                        client_kind))
        # Without it the server refuses; with an unset variable the client is never built.
        with pytest.raises(redis.AuthenticationError):
            asyncio.run(exercise_everything(many_models_config({"url": url, "key_prefix": "p"}), client_kind))
        monkeypatch.delenv("IRIS_TEST_REDIS_PASSWORD")
        with pytest.raises(ConfigError, match="redis.password_env: environment variable IRIS_TEST_REDIS_PASSWORD is not set"):
            open_redis(many_models_config({"url": url, "password_env": "IRIS_TEST_REDIS_PASSWORD"}).redis)
        # A password in the URL works as well.
        asyncio.run(exercise_everything(many_models_config({"url": f"redis://:s3cret-pass@127.0.0.1:{server.port}/0", "key_prefix": "q"}),
                                        client_kind))
    finally:
        server.stop()


# --- a primary killed under load -----------------------------------------------------------

FAILOVER_LIMITS = {
    "max_pinned_sessions": 4,
    "max_global_in_flight_request_slots": 8,
    "global_in_flight_request_slots_reserved_for_pinned_sessions": 2,
    "max_per_session_in_flight_request_slots": 2,
}
LEASE_TIMEOUT_SECONDS = 9.0  # renewals every 3 s: the 6 s streams renew across the failover


def failover_gateway(work_dir, redis_section: dict, probe_model: str) -> LocalGateway:
    """Two instances; MODEL with limits on both own providers; `probe_model` on iris-1 without
    limits, so a probe with a new session pins whenever shared routing works."""
    data = gateway_config(lease_timeout_seconds=LEASE_TIMEOUT_SECONDS, redis={"key_prefix": "fo", **redis_section})
    for provider in data["providers"][:2]:
        provider["models"][MODEL]["limits"] = FAILOVER_LIMITS
    data["providers"][0]["models"][probe_model] = {"features": ["chat"]}
    sims = {name: ProviderSimulation(ttft_ms=5, per_token_ms=20, block_tokens=8) for name in ("iris-1", "iris-2", "tensorx")}
    gateway = LocalGateway(config_data=data, instances=2, simulations=sims, work_dir=work_dir)
    gateway.__enter__()
    return gateway


def probe_until(gateway: LocalGateway, model: str, stop: threading.Event, out: list) -> None:
    """Every 50 ms per instance, a one-token request of a new session for `model`: appends
    (time.monotonic(), instance, status, route reason) to `out` until `stop` is set."""
    attempt = 0
    with httpx.Client(timeout=10) as http:
        while not stop.is_set():
            for index, instance in enumerate(gateway.running):
                attempt += 1
                body = {"model": model, "messages": [{"role": "user", "content": f"probe {attempt}"}], "max_tokens": 1}
                sent = time.monotonic()
                try:
                    response = http.post(f"{instance.url}/v1/chat/completions", json=body, headers={"x-user-id": f"probe-{attempt}"})
                    out.append((sent, index, response.status_code, response.headers.get("x-iris-route-reason")))
                except httpx.HTTPError:
                    out.append((sent, index, None, None))
            time.sleep(0.05)


def degraded_seconds(probes: list, killed_at: float, instances: int) -> list[float]:
    """Per instance, seconds from the kill to the end of its last probe that was not routed
    with shared state (no new pin), or 0 when none was."""
    out = []
    for index in range(instances):
        bad = [sent for sent, i, status, reason in probes if i == index and sent >= killed_at and reason != "new_pin"]
        out.append(round(max(bad) - killed_at, 2) if bad else 0.0)
    return out


def wait_until_shared_routing(gateway: LocalGateway, within_seconds: float) -> bool:
    """Whether every instance makes new pins (shared routing) again within `within_seconds`."""
    deadline = time.monotonic() + within_seconds
    pending, attempt = set(range(len(gateway.running))), 0
    while pending and time.monotonic() < deadline:
        for index in list(pending):
            attempt += 1
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"after failover {attempt}"}], "max_tokens": 1}
            response = httpx.post(f"{gateway.running[index].url}/v1/chat/completions", json=body,
                                  headers={"x-user-id": f"probe-{attempt}"}, timeout=10)
            if response.headers.get("x-iris-route-reason") == "new_pin":
                pending.discard(index)
        time.sleep(0.1)
    return not pending


def live_leases(client) -> int:
    """Live request leases over every pair (test-only: KEYS, on every primary of a cluster)."""
    now = redis_now_ms(client)
    if isinstance(client, SyncCluster):
        keys = client.keys("*:leases:*", target_nodes=SyncCluster.PRIMARIES)
    else:
        keys = client.keys("*:leases:*")
    return sum(client.zcount(k, f"({now}", "+inf") for k in keys)


def run_failover(gateway: LocalGateway, kill, wait_for_failover, client, probe_model: str) -> dict:
    """Long streams from both instances; `kill()` SIGKILLs the primary 1 s in; the load runs on
    across the failover, and probes of `probe_model` (same shard) see when shared routing is
    back. `client()`: a sync client of the topology as it is now. Checks what must hold and
    returns the figures."""
    deadline = time.monotonic() + 15  # both instances registered, so each knows its share
    while time.monotonic() < deadline and client().zcount("{fo}:instances", f"({redis_now_ms(client())}", "+inf") < 2:
        time.sleep(0.05)
    plan = LoadPlan(requests=96, sessions=48, concurrency=24, stream_share=1.0, abort_share=0.0, max_tokens=300, seed=13)
    box: dict = {}
    thread = threading.Thread(target=lambda: box.setdefault("result", asyncio.run(run_load([i.url for i in gateway.running], plan))))
    probes: list = []
    stop_probes = threading.Event()
    prober = threading.Thread(target=probe_until, args=(gateway, probe_model, stop_probes, probes))
    thread.start()
    prober.start()
    time.sleep(1.0)  # the first streams (6 s) are under way, and outlast a failover of up to 5 s
    killed_at = time.monotonic()
    kill()
    wait_for_failover()
    failover_seconds = time.monotonic() - killed_at
    thread.join(timeout=120)
    stop_probes.set()
    prober.join(timeout=30)
    records = box["result"].records
    assert len(records) == plan.requests
    assert [r for r in records if r.transport_error] == []
    assert {r.status for r in records} == {200}, {(r.status, r.error_code) for r in records}
    # Nothing waited on routing past the bound Envoy enforces (a hang would be its 5 s timeout).
    assert all(r.headers_at - r.started < ENVOY_MESSAGE_TIMEOUT_SECONDS for r in records)
    overlapping = [r for r in records if r.started < killed_at and r.ended > killed_at + failover_seconds]
    assert overlapping, ("no stream overlapped the failover", failover_seconds)
    assert all(instance.extproc.alive() and instance.envoy.alive() for instance in gateway.running)
    assert wait_until_shared_routing(gateway, within_seconds=20.0)
    # Probes never failed: during the failover they were routed by the outage policy.
    assert {status for _, _, status, _ in probes} == {200}
    assert any(reason == "new_pin" and sent > killed_at + failover_seconds for sent, _, _, reason in probes)
    # Every lease is released or expires within the lease timeout (releases sent to the dead primary are lost).
    deadline = time.monotonic() + LEASE_TIMEOUT_SECONDS + 2
    while time.monotonic() < deadline and live_leases(client()) > 0:
        time.sleep(0.1)
    assert live_leases(client()) == 0
    limit = FAILOVER_LIMITS["max_global_in_flight_request_slots"]
    peaks = {name: provider_stats(gateway, name)["max_in_flight_by_model"].get(MODEL, 0) for name in ("iris-1", "iris-2")}
    # docs/routing-state.md's promise under `degrade`: a managed pair takes nothing new without Redis, so it
    # stays within its limit (on loopback the replication-lag window holds no admission).
    for provider, peak in peaks.items():
        assert peak <= limit, (provider, peak)
    figures = {
        "failover_seconds": round(failover_seconds, 2),
        "degraded_seconds_per_instance": degraded_seconds(probes, killed_at, len(gateway.running)),
        "provider_peaks": peaks,
        "limit": limit,
        "over_admitted": {name: max(0, peak - limit) for name, peak in peaks.items()},
        "max_headers_seconds": round(max(r.headers_at - r.started for r in records), 3),
    }
    print("failover figures:", figures)
    return figures


@pytest.mark.slow
def test_cluster_primary_killed_under_load(tmp_path):
    with LocalCluster(tmp_path / "cluster") as topology:
        key = f"{{fo:{MODEL}}}"
        victim = topology.primary_for(key)
        probe = next(f"probe-{i}" for i in range(1000) if topology.primary_for(f"{{fo:probe-{i}}}") is victim)
        gateway = failover_gateway(tmp_path / "gateway", {"cluster": {"nodes": topology.seeds[:2]}}, probe)
        try:
            client = SyncCluster(startup_nodes=[ClusterNode("127.0.0.1", n.port) for n in topology.nodes], require_full_coverage=False)
            run_failover(gateway, victim.kill, lambda: topology.wait_for_failover(key, victim), lambda: client, probe)
        finally:
            gateway.stop()


@pytest.mark.slow
def test_sentinel_primary_killed_under_load(tmp_path):
    with LocalSentinel(tmp_path / "sentinel") as topology:
        redis_section = {"sentinel": {"sentinels": topology.addresses, "service_name": SERVICE_NAME}}
        gateway = failover_gateway(tmp_path / "gateway", redis_section, "probe")
        try:
            def client() -> redis.Redis:
                return redis.Redis(host="127.0.0.1", port=topology.current_primary_port())

            run_failover(gateway, topology.primary.kill, topology.wait_for_failover, client, "probe")
        finally:
            gateway.stop()
