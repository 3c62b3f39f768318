"""A Redis Cluster slot moved under traffic, and a shard that cannot serve one model (issue 29
items 3 and 4), through two gateway instances on a real 3-primary Cluster (irislab.redis_topologies).

While a slot is IMPORTING/MIGRATING, Redis answers TRYAGAIN to a multi-key call whose keys are
split between the two nodes or missing, which every routing script of the moving model is (a new
session's pin does not exist yet). The slot is moved with the steps `redis-cli --cluster reshard`
takes (SETSLOT IMPORTING/MIGRATING, MIGRATE, SETSLOT NODE) and held in the middle state while
requests run. What must hold: the other models' decisions stay on their own providers and their
leases keep renewing; no pair ever exceeds its limit (the providers' in-flight peaks); the moving
model follows the outage policy during the move and routes through Redis again within a bound
after it (docs/routing-state.md "When Redis is gone": `redis.probe_interval_seconds` + 2 x
`redis.socket_timeout_seconds`, 1.5 s with the defaults). The tests print what they measure."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import httpx
import pytest
import redis

from extproc.config import parse_config
from extproc.routing.degraded import DegradedFlags
from extproc.routing.lease_table import Held, LeaseTable
from extproc.routing.outage import InstanceRegistry, OutagePolicy, RedisBreaker
from extproc.routing.router import Reason, Router, RoutingRequest
from extproc.routing.state import RoutingState
from extproc.storage.client import open_redis
from extproc.storage.pipelined import open_pipelined
from irislab.local_gateway import LocalGateway, ProviderSimulation
from irislab.redis_topologies import LocalCluster
from tests.support.configs import small_config_data
from tests.support.gateway import MODEL, gateway_config, provider_stats

PROBE_INTERVAL_SECONDS = 0.5  # redis.probe_interval_seconds (the default)
SOCKET_TIMEOUT_SECONDS = 0.5  # redis.socket_timeout_seconds (the default): a call's deadline
# The next probe, then the degraded flags' refresh and the model's probe call, each within a call's deadline.
ROUTES_AGAIN_BOUND_SECONDS = PROBE_INTERVAL_SECONDS + 2 * SOCKET_TIMEOUT_SECONDS
LOAD_SLACK_SECONDS = 1.5  # the machine is shared: the bound is checked with this much added


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalCluster(tmp_path_factory.mktemp("cluster"), primaries=3, replicas=0) as topology:
        yield topology


@dataclass(frozen=True)
class Sent:
    """One request as the client saw it (time.monotonic() seconds)."""

    model: str
    instance: int
    started: float
    ended: float
    status: int | None
    provider: str | None
    reason: str | None


def send(url: str, model: str, instance: int, user: str, max_tokens: int, http: httpx.Client) -> Sent:
    body = {"model": model, "messages": [{"role": "user", "content": f"hello from {user}"}], "max_tokens": max_tokens}
    started = time.monotonic()
    try:
        response = http.post(f"{url}/v1/chat/completions", json=body, headers={"x-user-id": user})
    except httpx.HTTPError:
        return Sent(model, instance, started, time.monotonic(), None, None, None)
    return Sent(model, instance, started, time.monotonic(), response.status_code, response.headers.get("x-iris-provider"),
                response.headers.get("x-iris-route-reason"))


class Load:
    """Workers that each send one request at a time (a new session each) until `stop`."""

    def __init__(self) -> None:
        self.sent: list[Sent] = []
        self.stopping = threading.Event()
        self.threads: list[threading.Thread] = []

    def add(self, gateway: LocalGateway, instance: int, model: str, workers: int, max_tokens: int) -> None:
        url = gateway.running[instance].url
        for worker in range(workers):
            tag = f"{model}-{instance}-{worker}-{len(self.threads)}"
            thread = threading.Thread(target=self._run, args=(url, model, instance, tag, max_tokens), daemon=True)
            self.threads.append(thread)
            thread.start()

    def _run(self, url: str, model: str, instance: int, tag: str, max_tokens: int) -> None:
        with httpx.Client(timeout=30) as http:
            count = 0
            while not self.stopping.is_set():
                count += 1
                self.sent.append(send(url, model, instance, f"{tag}-{count}", max_tokens, http))

    def stop(self) -> list[Sent]:
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=60)
        return list(self.sent)


def model_on_another_shard(cluster: LocalCluster, prefix: str, avoid: str) -> str:
    """A model name whose hash tag `{prefix:name}` lives on another primary than `avoid`'s and
    than the fleet's keys `{prefix}`."""
    taken = {cluster.primary_for(f"{{{prefix}:{avoid}}}").port, cluster.primary_for(f"{{{prefix}}}").port}
    return next(name for name in (f"moving-{i}" for i in range(1000))
                if cluster.primary_for(f"{{{prefix}:{name}}}").port not in taken)


def start_two_instances(tmp_path, cluster: LocalCluster, prefix: str, lease_timeout: float, models: dict) -> LocalGateway:
    """Two instances on `cluster` under `prefix`; `models`: provider name -> {model: limits or
    None}, replacing gateway_config's models of those providers."""
    data = gateway_config(lease_timeout_seconds=lease_timeout, redis={"key_prefix": prefix, "cluster": {"nodes": cluster.seeds}})
    for provider in data["providers"]:
        if provider["name"] in models:
            provider["models"] = {
                model: {"features": ["chat"], **({"limits": limits} if limits else {})} for model, limits in models[provider["name"]].items()
            }
    sims = {name: ProviderSimulation(ttft_ms=5, per_token_ms=20, block_tokens=8) for name in ("iris-1", "iris-2", "tensorx")}
    gateway = LocalGateway(config_data=data, instances=2, simulations=sims, work_dir=tmp_path)
    gateway.__enter__()
    fleet = redis.RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
    try:
        wait_for(lambda: fleet.zcount(f"{{{prefix}}}:instances", "-inf", "+inf") >= 2, 20, "both instances registered")
    finally:
        fleet.close()
    return gateway


def wait_for(predicate, within_seconds: float, what: str) -> None:
    deadline = time.monotonic() + within_seconds
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {within_seconds} s"
        time.sleep(0.05)


def slot_of(cluster: LocalCluster, key: str) -> int:
    return int(cluster.client(cluster.nodes[0]).cluster("keyslot", key))


def move_target(cluster: LocalCluster, source, avoid: set[int]):
    return next(n for n in cluster.live_primaries() if n.port != source.port and n.port not in avoid)


def peaks(gateway: LocalGateway, provider: str) -> dict[str, int]:
    return provider_stats(gateway, provider)["max_in_flight_by_model"]


def live_on(client: redis.Redis, key: str) -> int:
    """Live leases in the provider-leases zset `key` of a node (the node's own time)."""
    seconds, micros = client.time()
    return client.zcount(key, f"({seconds * 1000 + micros // 1000}", "+inf")


def live_leases_of(cluster: LocalCluster, prefix: str) -> int:
    """Live request leases under `prefix` on every primary (test-only: KEYS on each node)."""
    return sum(live_on(cluster.client(node), key.decode())
               for node in cluster.live_primaries() for key in cluster.client(node).keys(f"{{{prefix}:*}}:leases:*"))


def wait_until_released(cluster: LocalCluster, prefix: str, lease_timeout: float) -> None:
    """Every lease under `prefix` released, or expired, within a lease timeout (and some slack)."""
    wait_for(lambda: live_leases_of(cluster, prefix) == 0, lease_timeout + 5, "every lease released or expired")


@pytest.mark.slow
def test_a_slot_move_costs_only_the_moving_model(tmp_path, cluster):
    """Issue 29 item 3. Each instance runs 2 workers of MODEL (limit 4 on each own provider) and
    3 of the moving model (limit 3 on iris-1, and the unlimited third party; short requests, so
    its failed decisions come in a row); its slot is held half-migrated for 4 s while they run.
    Before the fix the process-wide breaker opened on the moving model's TRYAGAIN and MODEL's
    decisions went to the third party."""
    prefix = "sm"
    moving = model_on_another_shard(cluster, prefix, MODEL)
    mine, theirs = {"max_global_in_flight_request_slots": 4}, {"max_global_in_flight_request_slots": 3}
    gateway = start_two_instances(tmp_path, cluster, prefix, 6.0, {
        "iris-1": {MODEL: mine, moving: theirs}, "iris-2": {MODEL: mine}, "tensorx": {MODEL: None, moving: None},
    })
    load = Load()
    try:
        for instance in (0, 1):  # the moving model's requests are short: its failures come in a row
            load.add(gateway, instance, MODEL, workers=2, max_tokens=30)
            load.add(gateway, instance, moving, workers=3, max_tokens=2)
        wait_for(lambda: sum(1 for s in load.sent if s.model == moving and s.reason == "new_pin") >= 4, 20,
                 "the moving model routed through Redis before the move")
        slot = slot_of(cluster, f"{{{prefix}:{moving}}}")
        source = cluster.primary_for(f"{{{prefix}:{moving}}}")
        target = move_target(cluster, source, {cluster.primary_for(f"{{{prefix}:{MODEL}}}").port})
        moved_keys = cluster.begin_slot_move(slot, source, target)
        began = time.monotonic()

        def outage_policy_on_both() -> bool:  # each instance decided the moving model without Redis
            return {s.instance for s in load.sent if s.model == moving and s.started > began and s.reason == "unpinned"} == {0, 1}

        wait_for(outage_policy_on_both, 20, "the moving model under the outage policy on both instances")
        time.sleep(max(0.0, began + 4.0 - time.monotonic()))  # the middle state overlaps 4 s of traffic at least
        cluster.end_slot_move(slot, source, target)
        ended = time.monotonic()

        def routes_again() -> bool:
            return {s.instance for s in load.sent if s.model == moving and s.started > ended and s.reason == "new_pin"} == {0, 1}

        wait_for(routes_again, 20, "the moving model routed through Redis again")
        time.sleep(1.0)
        sent = load.stop()
        wait_until_released(cluster, prefix, 6.0)
    finally:
        sent = load.stop()
        stats = {name: peaks(gateway, name) for name in ("iris-1", "iris-2")}
        gateway.stop()
    during = [s for s in sent if s.model == MODEL and began <= s.started <= ended]
    # How long after the move's end the moving model's decisions still went to the outage policy.
    outage = [s.started - ended for s in sent if s.model == moving and s.started > began and s.reason == "unpinned"]
    routes_again_after = round(max(0.0, *outage), 2)
    print("slot move figures:", {
        "moved_keys_at_begin": moved_keys, "middle_state_seconds": round(ended - began, 2),
        "other_model_requests_during_move": len(during),
        "of_them_to_the_third_party": sum(1 for s in during if s.provider == "tensorx"),
        "provider_peaks": stats, "moving_model_outage_decisions": len(outage),
        "moving_model_routes_again_after_seconds": routes_again_after, "bound_seconds": ROUTES_AGAIN_BOUND_SECONDS,
    })
    assert [s for s in sent if s.status != 200] == []
    assert during, "no request of the other model overlapped the move"
    assert {s.provider for s in during} <= {"iris-1", "iris-2"}, {s.provider for s in during}
    assert {s.reason for s in during} == {"new_pin"}
    assert stats["iris-1"].get(MODEL, 0) <= 4 and stats["iris-2"].get(MODEL, 0) <= 4, stats
    assert stats["iris-1"].get(moving, 0) <= 3, stats
    assert routes_again_after <= ROUTES_AGAIN_BOUND_SECONDS + LOAD_SLACK_SECONDS


class SlotMove:
    """The slot of `{prefix:moving}` held half-moved (keys split between its owner and another
    primary than MODEL's) from `begin` to `end`."""

    def __init__(self, cluster: LocalCluster, prefix: str, moving: str):
        key = f"{{{prefix}:{moving}}}"
        self.cluster, self.slot = cluster, slot_of(cluster, key)
        self.source = cluster.primary_for(key)
        self.target = move_target(cluster, self.source, {cluster.primary_for(f"{{{prefix}:{MODEL}}}").port})

    def begin(self) -> None:
        self.cluster.begin_slot_move(self.slot, self.source, self.target)

    def end(self) -> None:
        self.cluster.end_slot_move(self.slot, self.source, self.target)


class PausedPrimary:
    """The primary owning the slot of `{prefix:moving}` answers no client (CLIENT PAUSE ALL, the
    cluster bus untouched: no failover) for `seconds` from `begin`: one shard unavailable."""

    def __init__(self, cluster: LocalCluster, prefix: str, moving: str, seconds: float = 6.5):
        self.node, self.seconds = cluster.primary_for(self.key(prefix, moving)), seconds
        self.client = cluster.client(self.node)

    @staticmethod
    def key(prefix: str, moving: str) -> str:
        return f"{{{prefix}:{moving}}}"

    def begin(self) -> None:
        self.client.execute_command("CLIENT", "PAUSE", round(self.seconds * 1000), "ALL")

    def end(self) -> None:
        wait_for(lambda: self.client.ping(), self.seconds + 10, "the paused primary answering again")


class PausedFleetPrimary(PausedPrimary):
    """The primary of the fleet's keys `{prefix}` (the epoch, the instance registry) paused:
    every decision follows the outage policy (none can be checked against the epoch), and the
    leases of the models on the other shards must keep renewing."""

    @staticmethod
    def key(prefix: str, moving: str) -> str:
        return f"{{{prefix}}}"


@pytest.mark.slow
@pytest.mark.parametrize("fault", [SlotMove, PausedPrimary, PausedFleetPrimary], ids=["slot_move", "paused_primary", "paused_fleet_primary"])
def test_a_shard_in_trouble_lets_no_lease_of_another_model_expire(tmp_path, cluster, fault):
    """Issue 29 item 4. Lease timeout 3 s. Instance A runs 6 long requests of MODEL on iris-1
    (limit 6) and 2 of model `m`; a shard other than MODEL's is in trouble for 6 s (`fault`: m's
    slot held half-moved, m's primary paused, or the fleet keys' primary paused) while A keeps
    being asked for m (m's scope, or the fleet's, opens) and instance B keeps deciding MODEL.
    Before the fix A's breaker opened for every model, A renewed none of its leases, they
    expired in Redis after 3 s and B admitted MODEL on iris-1 over the limit (with the fleet's
    keys paused B cannot admit, but A's MODEL leases expired all the same)."""
    prefix = next(p for p in (f"so-{fault.__name__}-{i}" for i in range(100))  # MODEL apart from the fleet's keys
                  if cluster.primary_for(f"{{{p}:{MODEL}}}").port != cluster.primary_for(f"{{{p}}}").port)
    moving = model_on_another_shard(cluster, prefix, MODEL)
    gateway = start_two_instances(tmp_path, cluster, prefix, 3.0, {
        "iris-1": {MODEL: {"max_global_in_flight_request_slots": 6}, moving: {"max_global_in_flight_request_slots": 2}},
        "iris-2": {"spare": None},
        "tensorx": {MODEL: None, moving: None},
    })
    trouble = fault(cluster, prefix, moving)
    url = gateway.running[0].url
    long_ones: list[Sent] = []
    http = httpx.Client(timeout=60)
    held = [threading.Thread(target=lambda m=model, i=i: long_ones.append(send(url, m, 0, f"long-{m}-{i}", 650, http)), daemon=True)
            for i, model in enumerate([MODEL] * 6 + [moving] * 2)]
    load = Load()
    leases_key = f"{{{prefix}:{MODEL}}}:leases:iris-1"
    owner = cluster.client(cluster.primary_for(f"{{{prefix}:{MODEL}}}"))
    renewed_through = []
    try:
        for thread in held:
            thread.start()
        wait_for(lambda: provider_stats(gateway, "iris-1")["in_flight_by_model"].get(MODEL, 0) == 6
                 and provider_stats(gateway, "iris-1")["in_flight_by_model"].get(moving, 0) == 2, 20, "A's long requests running")
        trouble.begin()
        began = time.monotonic()
        load.add(gateway, 0, moving, workers=2, max_tokens=5)  # A's decisions of m fail
        load.add(gateway, 1, MODEL, workers=3, max_tokens=50)  # B decides MODEL meanwhile
        while time.monotonic() < began + 6.0:  # two lease timeouts: A's MODEL leases stay live in Redis
            renewed_through.append(live_on(owner, leases_key))
            time.sleep(0.2)
        sent = load.stop()
        trouble.end()
        for thread in held:
            thread.join(timeout=60)
        stats = {name: peaks(gateway, name) for name in ("iris-1", "tensorx")}
        wait_until_released(cluster, prefix, 3.0)
    finally:
        load.stop()
        http.close()
        gateway.stop()
    by_b = [s for s in sent if s.instance == 1]
    print(f"{fault.__name__} figures:", {
        "live_MODEL_leases_on_iris-1_during_trouble": (min(renewed_through), max(renewed_through)),
        "B_requests": len(by_b), "B_providers": sorted({s.provider or "" for s in by_b}), "provider_peaks": stats,
    })
    assert len(long_ones) == 8 and {s.status for s in long_ones} == {200}, long_ones
    assert {s.provider for s in long_ones if s.model == MODEL} == {"iris-1"}
    assert by_b and {s.status for s in by_b} == {200}
    assert stats["iris-1"].get(MODEL, 0) <= 6, stats  # no over-admit
    assert stats["iris-1"].get(moving, 0) <= 2, stats
    assert min(renewed_through) >= 6  # A's 6 MODEL leases kept renewing (B's add none: iris-1 is full)


def test_the_lease_table_counts_and_recovers_each_model_on_its_own(cluster):
    """The lease table alone (no gateway), lease timeout 1.5 s, leases of model m and of a moving
    model held: during the move the moving model's failed decisions and renewals (each after
    TRYAGAIN retried for a call's deadline) open its scope only; m still decides through Redis and its lease keeps
    renewing past a lease timeout; a recovery during the move leaves the moving model open and m
    untouched; the first one after it closes the moving model's scope and adopts its lease."""
    prefix = "lt"
    moving = model_on_another_shard(cluster, prefix, "m")
    data = small_config_data(lease_timeout_seconds=1.5, redis={"key_prefix": prefix, "cluster": {"nodes": cluster.seeds}})
    data["providers"][0]["models"][moving] = {"features": ["chat"], "limits": {"max_global_in_flight_request_slots": 4}}
    data["providers"][2]["models"][moving] = {"features": ["chat"]}
    config = parse_config(data)
    move = SlotMove(cluster, prefix, moving)

    def chat(model: str, session: str) -> RoutingRequest:
        return RoutingRequest(model, "chat", frozenset(), session)

    async def run() -> None:
        client = open_redis(config.redis, timeout_seconds=5)
        hot_path = open_pipelined(config.redis)  # a call's deadline: socket_timeout_seconds (0.5 s)
        state = RoutingState(client, config, hot_path=hot_path)
        router = Router(config, state, DegradedFlags(client, config))
        table = LeaseTable(config, state, router, OutagePolicy(config, router, InstanceRegistry(client, prefix)), RedisBreaker(client, 3))
        table.start()
        await table.refresh_epoch()
        kept = [await table.decide(chat("m", "kept")), await table.decide(chat(moving, "kept"))]
        assert all(isinstance(h, Held) and h.decision.provider.name == "iris-1" for h in kept), kept
        move.begin()
        try:
            began = time.monotonic()
            during = [await table.decide(chat(moving, f"during-{i}")) for i in range(3)]
            assert all(isinstance(h, Held) and h.decision.provider.name == "tensorx" for h in during), during
            assert time.monotonic() - began >= 0.4  # the first retried TRYAGAIN for about a call's deadline
            assert table.breaker.open_models == {moving} and not table.breaker.fleet_open
            other = await table.decide(chat("m", "during"))
            assert isinstance(other, Held) and other.decision.reason is Reason.NEW_PIN
            assert await table.recover() == 0
            assert table.breaker.open_models == {moving}
            while time.monotonic() < began + 2 * config.lease_timeout_seconds:  # m's lease renews meanwhile
                await asyncio.sleep(0.1)
            assert not kept[0].lost.is_set() and not kept[0].unconfirmed
            now = await client.time()
            expiry = await client.zscore(state.keys.provider_leases("m", "iris-1"), kept[0].lease.id)
            assert expiry is not None and expiry > now[0] * 1000 + now[1] // 1000
        finally:
            move.end()
        await table.recover()
        assert not table.breaker.is_open
        assert not kept[1].unconfirmed and not kept[1].lost.is_set()  # adopted back
        after = await table.decide(chat(moving, "after"))
        assert isinstance(after, Held) and after.decision.reason is Reason.NEW_PIN
        for held in [*kept, *during, other, after]:
            table.end(held, succeeded=True)
        await table.drain()
        await hot_path.aclose()
        await client.aclose()

    asyncio.run(run())
