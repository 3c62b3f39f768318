"""The reproductions of issue 10, items 5, 6 and 7, rerun: each prints the figure with the
shipped behaviour and with the behaviour before the fix. Real Envoy, real Redis, simulated
providers on loopback.

    python -m bench.envoy_faults            # every reproduction
    python -m bench.envoy_faults 6          # some of them

5: SIGTERM to one of two ext_proc servers behind one Envoy under load (long streams across the
   SIGTERM, new requests through the drain): failed requests with server.drain_delay_seconds 0
   (the old drain: streams refused at once) and with the default.
6: N concurrent streams through one Envoy (HTTP/2 clients): failed requests and Envoy's overflow
   counters without circuit breakers (Envoy's 1024 defaults) and with envoy.yaml's.
7: a pinned provider SIGKILLed (health check every 1 s, 2 failures): failed turns of its session
   before one is served elsewhere, without the connect source and with it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import signal
import tempfile
import threading
import time
from pathlib import Path

import httpx

from irislab import envoy_config
from irislab.local_gateway import LocalGateway, ProviderSimulation
from tests.gateway.test_drain import config as drain_config
from tests.gateway.test_envoy_capacity import SIMULATION, concurrent_streams, envoy_stats, raise_fd_limit
from tests.gateway.test_envoy_capacity import config as capacity_config
from tests.support.gateway import MODEL, chat_body, wait_until


def repro_5(work: Path) -> None:
    for delay in (0, None):
        data = drain_config()
        if delay is not None:
            data["server"] = {**data["server"], "drain_delay_seconds": delay}
        sim = ProviderSimulation(ttft_ms=5, per_token_ms=50, block_tokens=8)
        with LocalGateway(config_data=data, extproc_servers=2, default_simulation=sim, work_dir=work / f"5-{delay}") as gw:
            outcomes: list[int] = []
            stop = threading.Event()

            def long_stream(i: int) -> None:
                body = chat_body("long", max_tokens=160, stream=True)
                try:
                    with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json=body, headers={"x-user-id": f"l{i}"}, timeout=60) as r:
                        done = "data: [DONE]" in list(r.iter_lines())
                    outcomes.append(r.status_code if done else 0)
                except httpx.HTTPError:
                    outcomes.append(0)

            def new_requests(w: int) -> None:
                with httpx.Client(timeout=30) as http:
                    for n in itertools.count():
                        if stop.is_set():
                            return
                        try:
                            r = http.post(f"{gw.url}/v1/chat/completions", json=chat_body(f"s{w}{n}"), headers={"x-user-id": f"w{w}-{n}"})
                            outcomes.append(r.status_code)
                        except httpx.HTTPError:
                            outcomes.append(0)

            threads = [threading.Thread(target=long_stream, args=(i,)) for i in range(8)]
            threads += [threading.Thread(target=new_requests, args=(w,)) for w in range(2)]
            for t in threads:
                t.start()
            time.sleep(1.0)
            drained = gw.running[0].extprocs[0]
            drained.popen.send_signal(signal.SIGTERM)
            drained.popen.wait(timeout=60)
            time.sleep(1.0)
            stop.set()
            for t in threads:
                t.join(timeout=60)
            counts = collections.Counter(outcomes)
            failed = sum(v for k, v in counts.items() if k != 200)
            label = "drain_delay_seconds 0 (old)" if delay == 0 else "shipped drain (delay 3 s)"
            print(f"5  {label:32s} {failed} of {len(outcomes)} requests failed  {dict(counts)}")


def repro_6(work: Path, streams: int) -> None:
    raise_fd_limit(4 * streams + 1024)
    for variant in ("no circuit breakers", "envoy.yaml"):
        source = envoy_config.DEFAULT_ENVOY_YAML
        if variant == "no circuit breakers":
            bootstrap = envoy_config.load_envoy_yaml()
            for cluster in bootstrap["static_resources"]["clusters"]:
                cluster.pop("circuit_breakers", None)
            (work / "6").mkdir(parents=True, exist_ok=True)
            source = envoy_config.write(bootstrap, work / "6" / "envoy-source.yaml")
        with LocalGateway(config_data=capacity_config(), extproc_servers=2, default_simulation=SIMULATION,
                          work_dir=work / f"6-{variant.split()[0]}", envoy_source=source) as gw:
            results, peak = asyncio.run(concurrent_streams(gw, streams))
            stats = envoy_stats(gw)
        failed = sum(1 for r in results if r != (200, True))
        overflows = {k: v for k, v in stats.items() if k.endswith("_overflow") and v}
        print(f"6  {variant:22s} {streams} streams: {failed} failed, providers' peak in flight {peak}, overflows {overflows}")


def repro_7(work: Path) -> None:
    check = {"url": "http://127.0.0.1:1/health", "interval_seconds": 1, "timeout_seconds": 0.5,
             "failures_before_degraded": 2, "successes_before_healthy": 1}
    for enabled in (False, True):
        data = {
            "redis": {"key_prefix": "r7"},
            "session": {"trusted_identity_headers": ["x-user-id"]},
            "server": {"expose_routing_headers": True},
            "degradation": {"connect": {"enabled": enabled}},
            "providers": [
                {"name": "iris-1", "kind": "managed", "cluster": "iris-1", "health_check": check,
                 "models": {MODEL: {"features": ["chat"], "limits": {"max_pinned_sessions": 10}}}},
                {"name": "iris-2", "kind": "managed", "cluster": "iris-2", "health_check": check,
                 "models": {MODEL: {"features": ["chat"], "limits": {"max_pinned_sessions": 10}}}},
                {"name": "tensorx", "kind": "unlimited", "cluster": "tensorx", "models": {MODEL: {"features": ["chat"]}}},
            ],
        }
        sim = ProviderSimulation(ttft_ms=2, per_token_ms=1, block_tokens=8)
        with LocalGateway(config_data=data, default_simulation=sim, work_dir=work / f"7-{enabled}") as gw:
            def turn() -> httpx.Response:
                return httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body("one conversation"), headers={"x-user-id": "a"}, timeout=30)
            assert turn().headers["x-iris-provider"] == "iris-1"
            gw.providers["iris-1"].kill()
            started, failed = time.monotonic(), []
            served = wait_until(lambda: (r := turn()).status_code == 200 or failed.append(r.status_code), 30.0, interval_seconds=0.05)
            elapsed = time.monotonic() - started
        label = "connect source on (shipped)" if enabled else "connect source off (old)"
        print(f"7  {label:30s} {len(failed)} failed turns {collections.Counter(failed)} over {elapsed:.1f} s, then served: {bool(served)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("items", nargs="*", default=["5", "6", "7"])
    parser.add_argument("--streams", type=int, default=1500, help="concurrent streams of reproduction 6")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="envoy-faults-"))
    for item in args.items:
        if item == "5":
            repro_5(work)
        elif item == "6":
            repro_6(work, args.streams)
        elif item == "7":
            repro_7(work)
    print(f"work directory: {work}")


if __name__ == "__main__":
    main()
