"""Faults of issue 20's review, each overlapping its fault: requests run across the reload, the
empty restart, the cluster freeze and the long stream; the providers' own in-flight peaks and what
Redis holds afterwards are the evidence.

1. A reload that raises `lease_timeout_seconds` more than threefold: leases admitted just before
   it keep their renewals every third of their own timeout (before: every third of the new one,
   extended by the old, so they expired in Redis between renewals, the pair was over-admitted and
   the requests were cancelled as lost).
2. An epoch adoption interrupted by a Redis write stall: the table's own worker resumes it, and
   managed pairs admit nothing new until every running lease is adopted (before: the adoption ran
   in one request's task, one error ended it, and the pair was over-admitted).
3. A Redis Cluster with no reachable node: RedisClusterException is a Redis failure (outage
   policy, not a 500), and a running request's renewal survives it: a renewal that reaches Redis
   only when the cluster wakes, after its lease expired, is adopted, not reported lost.
5. A Responses stream longer than the lease timeout keeps its chain: the record's TTL starts again
   at the answer's end (before: at its first event, so the next chained turn met a 404).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai
import pytest
import redis
import yaml

from extproc import cli
from irislab.local_gateway import LocalGateway, ProviderSimulation
from irislab.redis_topologies import LocalCluster
from tests.support.gateway import provider_stats, redis_now_ms, wait_for_no_leases, wait_until

MODEL = "m"


def config(limit: int, lease_timeout: float, **extra) -> dict:
    limits = {"max_pinned_sessions": 1000, "max_global_in_flight_request_slots": limit, "max_per_session_in_flight_request_slots": limit}
    data = {
        "lease_timeout_seconds": lease_timeout,
        "redis": {"key_prefix": "r3"},
        "server": {"expose_routing_headers": True, "reload_poll_seconds": 0},
        "providers": [
            {"name": "iris-1", "kind": "managed", "cluster": "iris-1", "models": {MODEL: {"features": ["chat", "responses"], "limits": limits}}},
            {"name": "iris-2", "kind": "managed", "cluster": "iris-2", "models": {MODEL: {"features": ["chat", "responses"], "limits": limits}}},
            {"name": "tensorx", "kind": "unlimited", "cluster": "tensorx", "models": {MODEL: {"features": ["chat", "responses"]}}},
        ],
    }
    data.update(extra)
    return data


class Streams:
    """`count` streamed chat requests at once (new sessions), each `tokens` tokens long, run in
    threads; `results` gets (status, provider, ended with [DONE]) of each, `answered` counts the
    streams whose response headers reached their client (the router has answered them)."""

    def __init__(self, url: str, count: int, tokens: int, prefix: str):
        self.results: list[tuple[int, str, bool]] = []
        self.answered = 0
        self.threads = [threading.Thread(target=self._one, args=(url, f"{prefix}-{i}", tokens), daemon=True) for i in range(count)]
        for thread in self.threads:
            thread.start()

    def _one(self, url: str, name: str, tokens: int) -> None:
        body = {"model": MODEL, "stream": True, "max_tokens": tokens, "messages": [{"role": "user", "content": name}]}
        try:
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers={"x-session-id": name}, timeout=120) as response:
                self.answered += 1
                text = response.read().decode()
                self.results.append((response.status_code, response.headers.get("x-iris-provider", ""), text.rstrip().endswith("data: [DONE]")))
        except httpx.HTTPError as exc:
            self.results.append((0, type(exc).__name__, False))

    def join(self) -> list[tuple[int, str, bool]]:
        for thread in self.threads:
            thread.join(timeout=120)
        return self.results


def pair_leases(client: redis.Redis, provider: str) -> int:
    return client.zcount(f"{{r3:{MODEL}}}:leases:{provider}", f"({redis_now_ms(client)}", "+inf")


def test_a_reload_that_raises_the_lease_timeout_keeps_running_leases(tmp_path):
    sims = {name: ProviderSimulation(ttft_ms=5, per_token_ms=100) for name in ("iris-1", "iris-2", "tensorx")}
    with LocalGateway(config_data=config(limit=2, lease_timeout=3), simulations=sims, work_dir=tmp_path) as gateway:
        instance = gateway.running[0]
        state = redis.Redis.from_url(gateway.redis_url)
        running = Streams(instance.url, count=2, tokens=120, prefix="long")  # 12 s each: past the third request
        assert wait_until(lambda: provider_stats(gateway, "iris-1")["in_flight"] == 2, within_seconds=10)
        raised = yaml.safe_load(instance.config_path.read_text())
        raised["lease_timeout_seconds"] = 12  # renewals every 4 s if taken from the new timeout
        instance.config_path.write_text(yaml.safe_dump(raised))
        os.kill(instance.extproc.pid, signal.SIGHUP)  # within the first third of the leases' 3 s
        assert wait_until(lambda: "(reload 1)" in instance.extproc.log_tail(100_000), within_seconds=10)
        counted = []
        deadline = time.monotonic() + 6  # past the point where the old renewals let the leases lapse
        while time.monotonic() < deadline:
            counted.append(pair_leases(state, "iris-1"))
            time.sleep(0.1)
        third = Streams(instance.url, count=1, tokens=2, prefix="third").join()
        results = running.join()
        assert min(counted) == 2, counted  # Redis counted both running requests all along
        assert third[0][:2] == (200, "iris-2")  # the full pair admitted nothing more
        assert results == [(200, "iris-1", True)] * 2  # neither was cancelled as lost
        assert provider_stats(gateway, "iris-1")["max_in_flight"] == 2
        assert wait_for_no_leases(state, within_seconds=15) == 0


def test_an_adoption_interrupted_by_a_write_stall_is_resumed_before_new_admissions(tmp_path):
    """Redis loses its state under `limit` running streams (renewed only every 10 s); the new
    epoch is already written when the instance sees it, and Redis then stalls every write for
    1.5 s, so the adoption's first writes fail. New requests keep coming across the epoch grace:
    none may find the pair's slots free before the running leases are all adopted."""
    limit = 8
    sims = {name: ProviderSimulation(ttft_ms=5, per_token_ms=100) for name in ("iris-1", "iris-2", "tensorx")}
    data = config(limit=limit, lease_timeout=30)
    with LocalGateway(config_data=data, simulations=sims, work_dir=tmp_path) as gateway:
        instance = gateway.running[0]
        state = redis.Redis.from_url(gateway.redis_url)
        running = Streams(instance.url, count=limit, tokens=100, prefix="held")  # 10 s each
        assert wait_until(lambda: provider_stats(gateway, "iris-1")["in_flight"] == limit, within_seconds=15)
        state.flushall()  # Redis lost its state: a new epoch, written before the instance looks
        seconds, micros = state.time()
        state.set("{r3}:epoch", f"{os.urandom(16).hex()}@{seconds * 1000 + micros // 1000}")
        state.execute_command("CLIENT", "PAUSE", 1500, "WRITE")  # the adoption's writes stall past the socket timeout
        newcomers = []
        deadline = time.monotonic() + 6  # past the epoch grace (3 s) while the first streams still run
        while time.monotonic() < deadline:
            newcomers += Streams(instance.url, count=2, tokens=2, prefix=f"new-{len(newcomers)}").join()
        assert pair_leases(state, "iris-1") == limit  # every running lease adopted
        assert running.join() == [(200, "iris-1", True)] * limit
        assert all(status == 200 for status, _, _ in newcomers), newcomers
        assert provider_stats(gateway, "iris-1")["max_in_flight"] == limit  # never over-admitted
        assert wait_for_no_leases(state, within_seconds=15) == 0


def test_a_long_responses_stream_keeps_its_chain_until_its_pin_ends(tmp_path):
    """Pin 4 s + lease 2 s = a 6 s chain TTL; the first answer streams for 8 s on iris-2 (iris-1
    drained meanwhile); its next turn must reach iris-2 again (iris-1, undrained, would answer 404
    previous_response_not_found)."""
    sims = {name: ProviderSimulation(ttft_ms=5, per_token_ms=100) for name in ("iris-1", "iris-2", "tensorx")}
    data = config(limit=4, lease_timeout=2, pin_inactivity_timeout_seconds=4)
    data["server"]["degraded_refresh_seconds"] = 0.1
    with LocalGateway(config_data=data, simulations=sims, work_dir=tmp_path) as gateway:
        instance = gateway.running[0]
        api = openai.OpenAI(base_url=f"{instance.url}/v1", api_key="sk-chain", max_retries=0, timeout=60)
        config_path = str(instance.config_path)
        assert cli.main(["drain", "iris-1", "--config", config_path]) == 0
        assert wait_until(lambda: api.responses.with_raw_response.create(
            model=MODEL, input="probe", max_output_tokens=1).headers["x-iris-provider"] == "iris-2", within_seconds=10)
        raw = api.responses.with_raw_response.create(model=MODEL, input="a long answer", max_output_tokens=80, stream=True)
        assert raw.headers["x-iris-provider"] == "iris-2"
        response_id = None
        for event in raw.parse():  # 8 s: longer than the 6 s TTL counted from the first event
            if event.type == "response.created":
                response_id = event.response.id
                assert cli.main(["undrain", "iris-1", "--config", config_path]) == 0
        second = api.responses.with_raw_response.create(model=MODEL, input="and then?", max_output_tokens=2, previous_response_id=response_id)
        assert second.headers["x-iris-provider"] == "iris-2"
        assert provider_stats(gateway, "iris-1")["requests_by_status"].get("404", 0) == 0


@pytest.mark.slow
def test_a_cluster_with_no_reachable_node_is_a_redis_outage_and_renewals_survive_it(tmp_path):
    with LocalCluster(tmp_path / "cluster") as topology:
        sims = {name: ProviderSimulation(ttft_ms=5, per_token_ms=100) for name in ("iris-1", "iris-2", "tensorx")}
        data = config(limit=4, lease_timeout=3, redis={"key_prefix": "r3", "cluster": {"nodes": topology.seeds[:2]}})
        with LocalGateway(config_data=data, simulations=sims, work_dir=tmp_path / "gateway") as gateway:
            instance = gateway.running[0]
            stream = Streams(instance.url, count=1, tokens=150, prefix="through-the-freeze")  # 15 s
            assert wait_until(lambda: provider_stats(gateway, "iris-1")["in_flight"] == 1, within_seconds=10)
            for node in topology.nodes:
                os.kill(node.pid, signal.SIGSTOP)
            try:
                time.sleep(1.5)  # the breaker opens on the failures of the heartbeat and renewals
                during = Streams(instance.url, count=1, tokens=2, prefix="during").join()
                time.sleep(3)  # a whole lease timeout: the frozen lease is gone in Redis time too
            finally:
                for node in topology.nodes:
                    os.kill(node.pid, signal.SIGCONT)
            assert during[0][0] == 200, during  # the outage policy, not a 500
            leases = redis.cluster.RedisCluster(host="127.0.0.1", port=topology.nodes[0].port)
            key = f"{{r3:{MODEL}}}:leases:iris-1"

            def adopted() -> bool:
                return leases.zcount(key, f"({redis_now_ms(leases)}", "+inf") == 1

            assert wait_until(adopted, within_seconds=20)  # the running request's lease is back
            assert stream.join() == [(200, "iris-1", True)]  # never cancelled: its renewals did not reach Redis in time
            assert "internal_error" not in instance.extproc.log_tail(1_000_000)
