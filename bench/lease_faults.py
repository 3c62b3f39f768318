"""The reproductions of issue 10 (items 1-4, 8, 9), rerun: each prints the figure the issue
reported and the one measured now. Real Envoy, real Redis, simulated providers on loopback.

    python -m bench.lease_faults            # every reproduction
    python -m bench.lease_faults 1 8        # some of them

Redis is slowed or blackholed by SIGSTOP / SIGCONT of its process; figures are counts read from
Redis, the providers' own in-flight counters and the ext_proc server's metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import signal
import tempfile
import threading
import time
from pathlib import Path

import httpx

from extproc.config import parse_config
from extproc.routing.state import Result, RoutingState
from extproc.storage.client import connect
from irislab.processes import start_redis
from tests.support.configs import small_config_data
from tests.support.gateway import MODEL, chat_body, gateway_config, live_leases, provider_stats, redis_client, start_gateway, wait_until


def metric(url: str, name: str) -> float:
    for line in httpx.get(url, timeout=5).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def pins(client) -> int:
    return len(client.keys("*:pin:*"))


def repro_1(work: Path) -> None:
    print("1a. client hang-up during a decision, Redis stopped 0.4 s (issue: 1 lease for lease_timeout, 1 pin)")
    gateway = start_gateway(work / "1a")
    try:
        client = redis_client(gateway)
        gateway.redis.popen.send_signal(signal.SIGSTOP)
        try:
            try:
                httpx.post(f"{gateway.url}/v1/chat/completions", json=chat_body("hi"), headers={"x-user-id": "gone"}, timeout=0.1)
            except httpx.TimeoutException:
                pass
            time.sleep(0.4)
        finally:
            gateway.redis.popen.send_signal(signal.SIGCONT)
        time.sleep(1.0)
        print(f"    now: {live_leases(client)} live leases, {pins(client)} pins left")
    finally:
        gateway.stop()
    print("1b. 2 s black hole with 20 requests, decisions time out into the outage path (issue: 2 orphan leases)")
    gateway = start_gateway(work / "1b", redis={"key_prefix": "e2e", "socket_timeout_seconds": 0.5})
    try:
        client = redis_client(gateway)
        gateway.redis.popen.send_signal(signal.SIGSTOP)
        statuses = []
        try:
            threads = [threading.Thread(target=lambda i=i: statuses.append(httpx.post(
                f"{gateway.url}/v1/chat/completions", json=chat_body(f"q{i}"), headers={"x-user-id": f"u{i}"}, timeout=30).status_code))
                for i in range(20)]
            for thread in threads:
                thread.start()
            time.sleep(2.0)
        finally:
            gateway.redis.popen.send_signal(signal.SIGCONT)
        for thread in threads:
            thread.join(timeout=30)
        time.sleep(1.0)  # the abandonments reach Redis; every request has ended
        print(f"    now: statuses {sorted(set(statuses))}, {live_leases(client)} orphan leases once Redis answers")
    finally:
        gateway.stop()


def stream(url: str, user: str, max_tokens: int, out: dict) -> threading.Thread:
    def run() -> None:
        body = chat_body(f"story {user}", max_tokens=max_tokens, stream=True)
        try:
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers={"x-user-id": user}, timeout=60) as response:
                out[user] = (response.status_code, "data: [DONE]" in list(response.iter_lines()))
        except httpx.HTTPError as exc:
            out[user] = (type(exc).__name__, False)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def repro_2(work: Path) -> None:
    repro_2a(work)
    repro_2b(work)
    repro_2c(work)


def repro_2a(work: Path) -> None:
    limits = {"max_global_in_flight_request_slots": 4, "max_per_session_in_flight_request_slots": 4}
    for policy in ("degrade", "local_share"):
        print(f"2a. limit 4, 3 running, Redis stopped 3 s, 6 more requests; policy {policy} (issue: 6 in flight)")
        data = gateway_config(lease_timeout_seconds=1.5)
        data["providers"] = [data["providers"][0], data["providers"][2]]
        data["providers"][0] = {**data["providers"][0], "models": {MODEL: {"features": ["chat"], "limits": limits}}}
        gateway = start_gateway(work / f"2a-{policy}", providers=data["providers"], lease_timeout_seconds=1.5,
                                redis={"key_prefix": "e2e", "outage_policy": policy, "socket_timeout_seconds": 0.2})
        try:
            time.sleep(1.2)
            out: dict = {}
            running = [stream(gateway.url, f"r{i}", 200, out) for i in range(3)]
            wait_until(lambda: live_leases(redis_client(gateway)) == 3, within_seconds=10)
            gateway.redis.popen.send_signal(signal.SIGSTOP)
            try:
                more = [stream(gateway.url, f"m{i}", 100, out) for i in range(6)]
                time.sleep(3.0)
            finally:
                gateway.redis.popen.send_signal(signal.SIGCONT)
            for thread in running + more:
                thread.join(timeout=60)
            peak = provider_stats(gateway, "iris-1")["max_in_flight_by_model"].get(MODEL, 0)
            survived = sum(1 for i in range(3) if out[f"r{i}"] == (200, True))
            print(f"    now: iris-1 in-flight peak {peak} (limit 4); {survived}/3 running requests completed")
        finally:
            gateway.stop()


def repro_2b(work: Path) -> None:
    print("2b. pool exhaustion: the pool's only connection held, 5 decisions (issue: breaker opened)")
    process = start_redis(work / "redis-2b")
    try:
        asyncio.run(_repro_2b(f"redis://127.0.0.1:{process.port}/0"))
    finally:
        process.stop()


async def _repro_2b(url: str) -> None:
    from extproc.routing.degraded import DegradedFlags
    from extproc.routing.lease_table import LeaseTable
    from extproc.routing.outage import InstanceRegistry, OutagePolicy, RedisBreaker
    from extproc.routing.router import Router, RoutingRequest

    busy = connect(url, timeout_seconds=0.2, max_connections=1)
    config = parse_config(small_config_data(url))
    state = RoutingState(busy, config)
    router = Router(config, state, DegradedFlags(busy, config))
    table = LeaseTable(config, state, router, OutagePolicy(config, router, InstanceRegistry(busy, "t")), RedisBreaker(busy, 3))
    table.start()
    await busy.ping()
    taken = await busy.connection_pool.get_connection()
    outcomes = [await table.decide(RoutingRequest("m", "chat", frozenset(), f"s{i}")) for i in range(5)]
    await busy.connection_pool.release(taken)
    print(f"    now: {collections.Counter(getattr(o, 'value', type(o).__name__) for o in outcomes)} "
          f"(the server answers 429 routing_overloaded); breaker open: {table.breaker.is_open}")
    await table.drain()
    await busy.aclose()


def repro_2c(work: Path) -> None:
    print("2c. one slow reply (Redis stopped 0.7 s, socket timeout 0.5 s) (issue: 2 x 0.5 s, breaker opened)")
    gateway = start_gateway(work / "2c", redis={"key_prefix": "e2e", "socket_timeout_seconds": 0.5})
    try:
        time.sleep(1.2)
        gateway.redis.popen.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        response = httpx.post(f"{gateway.url}/v1/chat/completions", json=chat_body("slow"), headers={"x-user-id": "slow"}, timeout=30)
        decided = time.monotonic() - started
        time.sleep(max(0.0, 0.7 - decided))
        gateway.redis.popen.send_signal(signal.SIGCONT)
        print(f"    now: answered {response.status_code} after {decided:.2f} s; breaker open: "
              f"{metric(gateway.running[0].metrics_url, 'iris_redis_breaker_open')}")
    finally:
        gateway.redis.popen.send_signal(signal.SIGCONT)
        gateway.stop()


def repro_3(work: Path) -> None:
    print("3. Redis restarted empty while 10 streams run (lease timeout 1.5 s) (issue: every one cancelled)")
    gateway = start_gateway(work / "3", lease_timeout_seconds=1.5)
    try:
        out: dict = {}
        threads = [stream(gateway.url, f"s{i}", 150, out) for i in range(10)]
        wait_until(lambda: live_leases(redis_client(gateway)) == 10, within_seconds=10)
        gateway.stop_redis()
        gateway.start_redis_again()
        adopted = wait_until(lambda: live_leases(redis_client(gateway)) == 10, within_seconds=5)
        for thread in threads:
            thread.join(timeout=60)
        done = sum(1 for v in out.values() if v == (200, True))
        print(f"    now: {done}/10 completed with 200 and [DONE]; leases re-created in the new Redis: {bool(adopted)}; "
              f"left afterwards: {live_leases(redis_client(gateway))}")
    finally:
        gateway.stop()


def repro_4(work: Path) -> None:
    print("4. continuous traffic through a recovery, local_share (issue: 253 local leases never adopted)")
    from tests.support.fleet import LoadPlan, run_load

    gateway = start_gateway(work / "4", lease_timeout_seconds=1.5,
                            redis={"key_prefix": "e2e", "outage_policy": "local_share", "socket_timeout_seconds": 0.2})
    try:
        time.sleep(1.2)
        stop = threading.Event()
        box: dict = {}

        async def load():
            flag = asyncio.Event()
            watcher = asyncio.get_running_loop().run_in_executor(None, lambda: stop.wait(120))
            watcher.add_done_callback(lambda _: flag.set())
            plan = LoadPlan(requests=100_000, sessions=40, concurrency=8, stream_share=1.0, abort_share=0.0, max_tokens=10)
            return await run_load([gateway.url], plan, stop=flag)

        thread = threading.Thread(target=lambda: box.setdefault("r", asyncio.run(load())))
        thread.start()
        time.sleep(1.0)
        gateway.redis.popen.send_signal(signal.SIGSTOP)
        time.sleep(2.0)
        during = metric(gateway.running[0].metrics_url, "iris_local_leases")
        gateway.redis.popen.send_signal(signal.SIGCONT)
        time.sleep(3.0)
        after = metric(gateway.running[0].metrics_url, "iris_local_leases")
        stop.set()
        thread.join(timeout=60)
        adopted = metric(gateway.running[0].metrics_url, "iris_leases_adopted_total")
        print(f"    now: {during:.0f} local leases during the outage, {after:.0f} left 3 s after recovery under traffic "
              f"({adopted:.0f} adopted, {len(box['r'].records)} requests)")
    finally:
        gateway.redis.popen.send_signal(signal.SIGCONT)
        gateway.stop()


async def _repro_8_9(url: str) -> None:
    redis = connect(url, timeout_seconds=5)
    await redis.flushall()
    state = RoutingState(redis, parse_config(small_config_data(url)))
    t0 = 1_000_000_000
    first = await state.try_admit_unpinned_session_request("iris-1", "m", "s", now_ms=t0)
    await state.try_admit_pinned_session_request("m", "s", now_ms=t0 + 1)
    away = await state.try_compare_and_swap_pin_and_admit_request(first.pin, "m", "s", "iris-2", now_ms=t0 + 2)
    await state.release_request_lease(away.admission.lease, refresh_pin=False, now_ms=t0 + 3)
    back = await state.try_compare_and_swap_pin_and_admit_request(away.admission.pin, "m", "s", "iris-1", now_ms=t0 + 4)
    more = await state.try_admit_pinned_session_request("m", "s", now_ms=t0 + 5)
    admitted = 2 + sum(1 for a in (back.admission, more) if a.result is Result.ADMITTED and a.lease.provider == "iris-1")
    print("8. per-session limit 2 after a repin to iris-2 and back with 2 running on iris-1 (issue: 4 in flight)")
    print(f"    now: {admitted} in flight for the session on iris-1 (the repin back answers {back.admission.result.value})")
    print("9. a pinned session's lease id replayed after it expired (issue: AttributeError)")
    try:
        await state.try_admit_unpinned_session_request("iris-2", "m", "s9", lease_id="y", now_ms=t0)
        later = t0 + 60_000  # the lease (30 s) expired, the pin (300 s) lives
        pin, admission = await state.get_pin_and_try_admit("m", "s9", ["iris-2"], lease_id="y", now_ms=later)
        print(f"    now: answers {admission.result.value if admission else None} with the pin seen on {pin.provider if pin else None}")
    except AttributeError as exc:
        print(f"    now: AttributeError {exc}")
    await redis.aclose()


def repro_8_9(work: Path) -> None:
    process = start_redis(work / "redis-8")
    try:
        asyncio.run(_repro_8_9(f"redis://127.0.0.1:{process.port}/0"))
    finally:
        process.stop()


REPRODUCTIONS = {
    "1": repro_1, "2": repro_2, "2a": repro_2a, "2b": repro_2b, "2c": repro_2c, "3": repro_3, "4": repro_4, "8": repro_8_9, "9": repro_8_9,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("items", nargs="*", default=["1", "2", "3", "4", "8"], help="issue 10 items (9 runs with 8)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lease-faults-"))
    done = set()
    for item in args.items:
        function = REPRODUCTIONS[item]
        if function not in done:
            done.add(function)
            function(work)


if __name__ == "__main__":
    main()
