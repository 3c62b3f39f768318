"""Issue 10 end to end (real Envoy, real Redis, simulated providers): one owner for every lease.
A decision abandoned mid-call leaves nothing; running requests survive a Redis restart (empty)
and an outage; the limits the providers observe hold during and after, under each policy."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import httpx
import pytest

from tests.support.fleet import LoadPlan, run_load
from tests.support.gateway import (
    LIMITS,
    MODEL,
    chat_body,
    gateway_config,
    live_leases,
    provider_stats,
    redis_client,
    start_gateway,
    wait_for_instances_to_know_each_other,
    wait_for_no_leases,
    wait_until,
)

LEASE_TIMEOUT = 1.5  # renewals every 0.5 s


def stream_in_thread(url: str, user: str, max_tokens: int, out: dict) -> threading.Thread:
    """A streamed request from `user` whose outcome (status, whether it reached [DONE], error)
    lands in out[user]."""

    def run() -> None:
        body = chat_body(f"long story for {user}", max_tokens=max_tokens, stream=True)
        try:
            with httpx.Client(timeout=60) as http:
                with http.stream("POST", f"{url}/v1/chat/completions", json=body, headers={"x-user-id": user}) as response:
                    lines = list(response.iter_lines())
                    out[user] = (response.status_code, "data: [DONE]" in lines, None, response.headers.get("x-iris-provider"))
        except httpx.HTTPError as exc:
            out[user] = (None, False, type(exc).__name__, None)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def own_peaks(gateway) -> dict[str, int]:
    return {name: provider_stats(gateway, name)["max_in_flight_by_model"].get(MODEL, 0) for name in ("iris-1", "iris-2")}


def pins(client) -> int:
    return len(client.keys("*:pin:*"))


@pytest.mark.slow
def test_redis_restarted_empty_while_ten_streams_run(tmp_path):
    gateway = start_gateway(tmp_path, lease_timeout_seconds=LEASE_TIMEOUT)
    try:
        out: dict = {}
        threads = [stream_in_thread(gateway.url, f"user-{i}", 300, out) for i in range(10)]  # 300 x 20 ms: 6 s
        assert wait_until(lambda: live_leases(redis_client(gateway)) == 10, within_seconds=10)
        gateway.stop_redis()
        gateway.start_redis_again()  # empty
        # Every running lease is adopted into the new Redis (the epoch changed): counts exact.
        assert wait_until(lambda: live_leases(redis_client(gateway)) == 10, within_seconds=5)
        for thread in threads:
            thread.join(timeout=60)
        assert sorted(out.values(), key=str) == sorted([(200, True, None, out[u][3]) for u in out], key=str)
        assert len(out) == 10
        assert wait_for_no_leases(redis_client(gateway), within_seconds=1.0) == 0
    finally:
        gateway.stop()


def test_a_lease_redis_saw_expire_is_still_lost(tmp_path):
    """The lease expired in Redis (the epoch intact) and its pair's slots went to others meanwhile:
    it cannot come back within the limit (issue 29, item 0), so its request is cancelled."""
    gateway = start_gateway(tmp_path, lease_timeout_seconds=LEASE_TIMEOUT, server={"expose_routing_headers": True})
    try:
        client = redis_client(gateway)
        out: dict = {}
        thread = stream_in_thread(gateway.url, "u", 300, out)
        assert wait_until(lambda: live_leases(client) == 1, within_seconds=10)
        seconds, _ = client.time()
        for key in client.keys("*:leases:*"):
            members = client.zrange(key, 0, -1)
            # Its slots go to others first: a renewal between the two steps finds its lease live.
            taken = {f"taken-{i}": seconds * 1000 + 60_000 for i in range(LIMITS["max_global_in_flight_request_slots"])}
            client.zadd(key, taken)
            client.zadd(key, {member: seconds * 1000 - 1000 for member in members}, xx=True)  # expired, the epoch intact
        thread.join(timeout=60)
        status, done, error, _ = out["u"]
        assert not done  # cut short: the request was cancelled
        assert error is not None or status != 200 or not done
    finally:
        gateway.stop()


def test_client_hang_up_during_a_decision_on_a_stalled_redis_leaves_nothing(tmp_path):
    gateway = start_gateway(tmp_path, lease_timeout_seconds=30, server={"expose_routing_headers": True})
    try:
        client = redis_client(gateway)
        # Writes paused: each decision's epoch read is answered, its admission script stalls.
        client.execute_command("CLIENT", "PAUSE", 3000, "WRITE")
        try:
            for i in range(5):
                with pytest.raises(httpx.TimeoutException):
                    httpx.post(f"{gateway.url}/v1/chat/completions", json=chat_body(f"hi {i}"), headers={"x-user-id": f"gone-{i}"},
                               timeout=0.3)
            time.sleep(1.0)  # the decisions time out into the outage path meanwhile
        finally:
            client.execute_command("CLIENT", "UNPAUSE")
        # The admissions sent before the hang-ups ran when Redis resumed; their abandonment ends them.
        assert wait_until(lambda: live_leases(client) == 0 and pins(client) == 0, within_seconds=5)
        time.sleep(0.5)
        assert (live_leases(client), pins(client)) == (0, 0)
    finally:
        gateway.stop()


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["degrade", "local_share"])
def test_an_outage_under_long_streams_keeps_every_limit(tmp_path, policy):
    data = gateway_config()
    gateway = start_gateway(
        tmp_path, lease_timeout_seconds=LEASE_TIMEOUT, redis=dict(data["redis"], outage_policy=policy, socket_timeout_seconds=0.2)
    )
    try:
        assert wait_for_instances_to_know_each_other(gateway)  # the divisor of the local share
        out: dict = {}
        # 3 long streams (4 s each): 2 pinned on iris-1, 1 on iris-2 (pin limit 2), room left there.
        long = [stream_in_thread(gateway.url, f"long-{i}", 200, out) for i in range(3)]
        assert wait_until(lambda: live_leases(redis_client(gateway)) == 3, within_seconds=10)
        gateway.redis.popen.send_signal(signal.SIGSTOP)  # longer than the lease timeout
        try:
            during = [stream_in_thread(gateway.url, f"during-{i}", 20, out) for i in range(6)]
            time.sleep(2.5)
        finally:
            gateway.redis.popen.send_signal(signal.SIGCONT)
        after = [stream_in_thread(gateway.url, f"after-{i}", 20, out) for i in range(6)]
        for thread in long + during + after:
            thread.join(timeout=60)
        assert all(out[f"long-{i}"][:3] == (200, True, None) for i in range(3)), out  # none cancelled
        assert all(out[f"{kind}-{i}"][0] in (200, 429, 503) for kind in ("during", "after") for i in range(6)), out
        for provider, peak in own_peaks(gateway).items():
            assert peak <= LIMITS["max_global_in_flight_request_slots"], (provider, peak)
        assert wait_for_no_leases(redis_client(gateway), within_seconds=1.0) == 0
    finally:
        gateway.stop()


def local_leases(metrics_url: str) -> float:
    for line in httpx.get(metrics_url, timeout=5).text.splitlines():
        if line.startswith("iris_local_leases "):
            return float(line.split()[1])
    raise AssertionError("no iris_local_leases metric")


def outage_series(metrics_url: str) -> str:
    """The router's series on Redis, its breaker, the outage policy and its decisions."""
    text = httpx.get(metrics_url, timeout=5).text
    return "\n".join(line for line in text.splitlines()
                     if line.startswith(("iris_redis", "iris_outage", "iris_local", "iris_routing_decisions", "iris_decisions")))


@pytest.mark.slow
def test_continuous_traffic_through_a_recovery_leaves_no_local_lease(tmp_path):
    data = gateway_config()
    gateway = start_gateway(
        tmp_path, lease_timeout_seconds=LEASE_TIMEOUT, redis=dict(data["redis"], outage_policy="local_share", socket_timeout_seconds=0.2)
    )
    metrics_url = gateway.running[0].metrics_url
    try:
        assert wait_for_instances_to_know_each_other(gateway)  # the divisor of the local share
        stop = threading.Event()
        plan = LoadPlan(requests=100_000, sessions=40, concurrency=8, stream_share=1.0, abort_share=0.0, max_tokens=10)
        box: dict = {}

        def load() -> None:
            async def run():
                flag = asyncio.Event()
                watcher = asyncio.get_running_loop().run_in_executor(None, lambda: stop.wait(120))
                watcher.add_done_callback(lambda _: flag.set())
                return await run_load([gateway.url], plan, stop=flag)

            box["result"] = asyncio.run(run())

        thread = threading.Thread(target=load)
        thread.start()
        time.sleep(1.0)
        gateway.redis.popen.send_signal(signal.SIGSTOP)
        # Own providers take their local share meanwhile (the series say why not, if ever).
        assert wait_until(lambda: local_leases(metrics_url) > 0, within_seconds=5), outage_series(metrics_url)
        gateway.redis.popen.send_signal(signal.SIGCONT)
        # Traffic goes on; recovery adopts until nothing local is left.
        assert wait_until(lambda: local_leases(metrics_url) == 0, within_seconds=10)
        time.sleep(1.0)
        assert local_leases(metrics_url) == 0
        stop.set()
        thread.join(timeout=60)
        records = box["result"].records
        assert records and [r for r in records if r.transport_error] == []
        for provider, peak in own_peaks(gateway).items():
            assert peak <= LIMITS["max_global_in_flight_request_slots"], (provider, peak)
        assert wait_for_no_leases(redis_client(gateway), within_seconds=2.0) == 0
    finally:
        gateway.redis.popen.send_signal(signal.SIGCONT)
        gateway.stop()


@pytest.mark.slow
def test_new_requests_right_after_an_empty_restart_keep_the_limit(tmp_path):
    """Three instances, every managed slot taken by long streams; Redis restarted empty while new
    requests keep arriving at every instance. An instance back first must not admit on the empty
    Redis before the others have adopted their running leases (issue 10: the epoch grace)."""
    data = gateway_config()
    limits = {**LIMITS, "max_pinned_sessions": 10, "max_global_in_flight_request_slots": 3,
              "global_in_flight_request_slots_reserved_for_pinned_sessions": 0}
    for provider in data["providers"][:2]:
        provider["models"][MODEL]["limits"] = limits
    gateway = start_gateway(tmp_path, instances=3, lease_timeout_seconds=LEASE_TIMEOUT, providers=data["providers"])
    try:
        assert wait_for_instances_to_know_each_other(gateway)  # each registered, its epoch read
        out: dict = {}
        # 6 long streams (6 s each), 2 per instance: both own providers full (3 + 3).
        long = [stream_in_thread(gateway.running[i % 3].url, f"long-{i}", 300, out) for i in range(6)]
        assert wait_until(lambda: live_leases(redis_client(gateway)) == 6, within_seconds=10)
        stop = threading.Event()

        def keep_asking(index: int) -> None:
            n = 0
            while not stop.is_set() and n < 400:
                n += 1
                body = chat_body(f"short {index}-{n}", max_tokens=2)
                try:
                    httpx.post(f"{gateway.running[index].url}/v1/chat/completions", json=body, timeout=10)
                except httpx.HTTPError:
                    pass

        askers = [threading.Thread(target=keep_asking, args=(i,)) for i in range(3) for _ in range(2)]
        for thread in askers:
            thread.start()
        try:
            gateway.stop_redis()
            gateway.start_redis_again()  # empty
            time.sleep(3.0)
        finally:
            stop.set()
            for thread in askers:
                thread.join(timeout=30)
        for thread in long:
            thread.join(timeout=60)
        assert all(out[f"long-{i}"][:3] == (200, True, None) for i in range(6)), out  # none cancelled
        for provider, peak in own_peaks(gateway).items():
            assert peak <= limits["max_global_in_flight_request_slots"], (provider, peak)
        assert wait_for_no_leases(redis_client(gateway), within_seconds=1.0) == 0
    finally:
        gateway.stop()
