"""What tracing and token accounting cost (issue 22; docs/results/issue22/README.md "Tracing and token usage").

    python -m bench.observability_cost [--requests 2000] [--rounds 5] [--streams 20] [--tokens 200] [--baseline TREE]

1. Per decision, tracing off and on: requests driven through the ext_proc stream loop
   (`ExternalProcessor`, in this process, no gRPC) phase by phase (request headers, body and the
   decision, response headers, stream end and the release), one at a time: (a) without Redis
   (the breaker open: the outage policy decides), so the loop's own CPU is all that is measured,
   then (b) against a real Redis. Tracing on exports over OTLP/gRPC to a collector in another
   process (`python -m irislab.otlp_collector`), sampled (ratio 1) or not (ratio 0: the trace
   context still goes to the provider). `--baseline TREE` adds the same loop on another tree's
   `extproc` with nothing of tracing (the tree before it). Variants alternate within each round;
   the medians of the rounds are printed, in microseconds per request (CPU of this process, every
   thread, and wall time).
2. Reading the usage of answers: a whole gateway (Envoy, the ext_proc server, simulated
   providers), streams of `--tokens` chunks and JSON answers from the third party, with
   `token_usage.providers` `none` and `unlimited`: the ext_proc server's and Envoy's CPU time
   per chunk and per answer, and the streams' wall time.

Every process runs on 127.0.0.1 and is stopped by its pid.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import orjson
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3.external_processor_pb2 import HttpBody, HttpHeaders, ProcessingRequest

from bench.common import cpu_seconds, load_average
from extproc.config import parse_config
from extproc.protocol.live import build_live
from extproc.protocol.stream import ExternalProcessor, StreamState
from extproc.routing.degraded import DegradedFlags
from extproc.routing.lease_table import LeaseTable
from extproc.routing.outage import InstanceRegistry, OutagePolicy, RedisBreaker
from extproc.routing.state import connect
from irislab.local_gateway import LocalGateway, ProviderSimulation
from irislab.processes import free_port, spawn, start_redis, wait_for_port
from tests.support.configs import small_config_data
from tests.support.gateway import MODEL, gateway_config

CLIENT_TRACE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
# One own provider without limits (the outage policy may choose it) and the third party.
PROVIDERS = [
    {"name": "iris-1", "kind": "managed", "cluster": "iris-1", "models": {"m": {"features": ["chat"]}}},
    {"name": "tensorx", "kind": "unlimited", "cluster": "tensorx", "models": {"m": {"features": ["chat"]}}},
]


def headers_message(headers: dict[str, str]) -> ProcessingRequest:
    values = [HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]
    return ProcessingRequest(request_headers=HttpHeaders(headers=HeaderMap(headers=values)))


REQUEST_HEADERS = headers_message({
    ":path": "/v1/chat/completions", ":method": "POST", "content-type": "application/json", "x-session-id": "bench",
    "authorization": "Bearer client-key",  # no trace context: the sample ratio decides
})
REQUEST_BODY = ProcessingRequest(request_body=HttpBody(
    body=orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hello " * 50}], "max_tokens": 8}), end_of_stream=True,
))
RESPONSE_HEADERS = ProcessingRequest(response_headers=HttpHeaders(headers=HeaderMap(headers=[
    HeaderValue(key=":status", raw_value=b"200"), HeaderValue(key="content-type", raw_value=b"application/json"),
])))


async def stream_loop(url: str, tracing: dict | None, requests: int, with_redis: bool) -> tuple[float, float]:
    """(wall, CPU) microseconds per request through the stream loop (module docstring) with
    `tracing` (None: off). `with_redis` False: the Redis breaker is open, decisions are the
    outage policy's and call no Redis, so the loop's own CPU is all there is. The CPU is this
    process's, every thread's: the span exporter's included (its queue is flushed before the
    clock stops), Redis's not. Runs on the tree before tracing too (`--baseline`)."""
    redis = connect(url, timeout_seconds=2.0)
    config = parse_config(small_config_data(url, providers=PROVIDERS, **({"tracing": tracing} if tracing else {})))
    live = build_live(config, redis, DegradedFlags(redis, config), b"bench-secret")
    breaker = RedisBreaker(redis)
    if not with_redis:
        breaker.trip(ConnectionError("bench: decisions without Redis"))
    leases = LeaseTable(config, live.state, live.router, OutagePolicy(config, live.router, InstanceRegistry(redis, "t")), breaker)
    leases.start()
    tracer = None
    if tracing:
        from extproc.protocol.tracing import RequestTracer

        tracer = RequestTracer(config.tracing)
    processor = ExternalProcessor(live, leases, breaker, **({"tracer": tracer} if tracer else {}))
    for warm in (True, False):
        started, cpu = time.perf_counter(), time.process_time()
        for _ in range(requests // 10 if warm else requests):
            stream = StreamState()
            for message in (REQUEST_HEADERS, REQUEST_BODY, RESPONSE_HEADERS):
                await processor._handle(stream, message)
            processor._end_stream(stream)
            await leases.releases_settled()
        if tracer is not None:
            tracer._provider.force_flush()
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    await leases.drain()
    if tracer is not None:
        tracer.shutdown()
    await redis.aclose()
    return elapsed / requests * 1e6, cpu / requests * 1e6


def baseline(tree: str, url: str, requests: int, with_redis: bool) -> tuple[float, float]:
    """stream_loop with tracing off, run by this file on another tree's `extproc` (PYTHONPATH)."""
    argv = [sys.executable, __file__, "--child", url, str(requests), "1" if with_redis else "0"]
    out = subprocess.run(argv, env={**os.environ, "PYTHONPATH": tree}, capture_output=True, text=True, check=True).stdout
    wall, cpu = orjson.loads(out.strip().splitlines()[-1])
    return wall, cpu


def tracer_calls_us(endpoint: str, ratio: float, carrier: dict[str, str] | None, n: int = 2000) -> float:
    """CPU microseconds per request of the tracer's own calls (start, routed, finish), the
    export of the spans excluded (they wait in the batch processor's queue)."""
    from extproc.protocol.tracing import RequestTracer

    config = parse_config(small_config_data(tracing={"otlp_endpoint": endpoint, "sample_ratio": ratio}))
    tracer, provider = RequestTracer(config.tracing), config.providers[0]
    cpu = time.process_time()
    for _ in range(n):
        span = tracer.start(carrier, "chat", "m")
        tracer.routed(span, provider, "pinned", "0" * 32, 0.5)
        tracer.finish(span, 200)
    cpu = time.process_time() - cpu
    tracer.shutdown()
    return cpu / n * 1e6


def part_one(requests: int, rounds: int, work: Path, base: str | None) -> None:
    redis = start_redis(work / "redis")
    port = free_port()
    collector = spawn("otlp-collector", [sys.executable, "-m", "irislab.otlp_collector", "--port", str(port)], work)
    wait_for_port(port, process=collector.popen)
    endpoint = f"http://127.0.0.1:{port}"
    url = f"redis://127.0.0.1:{redis.port}/0"
    variants: dict[str, dict | None] = {"tracing off": None, "tracing on, not sampled": {"otlp_endpoint": endpoint, "sample_ratio": 0.0},
                                        "tracing on, sampled": {"otlp_endpoint": endpoint}}
    before = f"before tracing ({base})"
    try:
        for with_redis in (False, True):
            found: dict[str, list[tuple[float, float]]] = {name: [] for name in ([before] if base else []) + list(variants)}
            for _ in range(rounds):
                if base:
                    found[before].append(baseline(base, url, requests, with_redis))
                for name, tracing in variants.items():
                    found[name].append(asyncio.run(stream_loop(url, tracing, requests, with_redis)))
            where = "decisions in Redis, round trips included" if with_redis else "no Redis (the outage policy decides)"
            print(f"1{'b' if with_redis else 'a'}. per request through the stream loop, one at a time, {where} "
                  f"({requests} requests x {rounds} rounds, load {load_average():.1f}); medians of the rounds:")
            off_wall, off_cpu = (statistics.median(v[i] for v in found["tracing off"]) for i in (0, 1))
            for name, values in found.items():
                wall, cpu = (statistics.median(v[i] for v in values) for i in (0, 1))
                print(f"   {name:24s} CPU {cpu:6.1f} us ({cpu - off_cpu:+6.1f})  wall {wall:7.1f} us ({wall - off_wall:+6.1f}); "
                      f"CPU rounds {', '.join(f'{v[1]:.0f}' for v in values)}")
        for ratio, carrier, what in ((1.0, None, "sampled"), (0.0, None, "not sampled"),
                                     (0.0, {"traceparent": CLIENT_TRACE}, "sampled by the client's flag")):
            print(f"   the tracer's own calls, a span {what}: {tracer_calls_us(endpoint, ratio, carrier):.1f} us CPU per request")
    finally:
        collector.stop()
        redis.stop()


def vision_body(stream: bool, tokens: int) -> dict:
    content = [{"type": "text", "text": "look " * 20}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": tokens, "stream": stream}
    return body | ({"stream_options": {"include_usage": True}} if stream else {})


def usage_run(work: Path, providers: str, streams: int, tokens: int) -> dict[str, float]:
    """CPU (ext_proc, Envoy) per chunk and per JSON answer, and the streams' mean wall time (s)."""
    sims = {name: ProviderSimulation(ttft_ms=1, per_token_ms=1) for name in ("iris-1", "iris-2", "tensorx")}
    config = gateway_config(token_usage={"providers": providers})
    with LocalGateway(config_data=config, simulations=sims, work_dir=work / f"gateway-{providers}-{time.monotonic_ns()}") as gw:
        instance = gw.running[0]
        pids = (instance.extproc.popen.pid, instance.envoy.popen.pid)
        url = f"{instance.url}/v1/chat/completions"

        def one(body: dict) -> float:
            started = time.perf_counter()
            response = httpx.post(url, json=body, headers={"x-user-id": "bench"}, timeout=60)
            assert response.status_code == 200 and response.headers["x-iris-provider"] == "tensorx", response.text[:200]
            return time.perf_counter() - started

        for _ in range(3):
            one(vision_body(True, tokens))
        before = [cpu_seconds(pid) for pid in pids]
        with ThreadPoolExecutor(max_workers=4) as pool:
            walls = list(pool.map(one, [vision_body(True, tokens)] * streams))
        middle = [cpu_seconds(pid) for pid in pids]
        with ThreadPoolExecutor(max_workers=4) as pool:
            list(pool.map(one, [vision_body(False, tokens)] * (streams * 10)))
        after = [cpu_seconds(pid) for pid in pids]
    chunks = streams * (tokens + 2)  # each token, the usage chunk, [DONE]
    return {
        "extproc_us_per_chunk": (middle[0] - before[0]) / chunks * 1e6, "envoy_us_per_chunk": (middle[1] - before[1]) / chunks * 1e6,
        "extproc_us_per_answer": (after[0] - middle[0]) / (streams * 10) * 1e6,
        "envoy_us_per_answer": (after[1] - middle[1]) / (streams * 10) * 1e6,
        "stream_seconds": statistics.mean(walls),
    }


def part_two(streams: int, tokens: int, work: Path) -> None:
    runs = {"none": [], "unlimited": []}
    for _ in range(2):
        for providers in runs:
            runs[providers].append(usage_run(work, providers, streams, tokens))
    print(f"2. reading the usage of the third party's answers ({streams} streams of {tokens} tokens, 4 at once, "
          f"then {streams * 10} JSON answers; load {load_average():.1f}):")
    for providers, results in runs.items():
        mean = {key: statistics.mean(r[key] for r in results) for key in results[0]}
        print(f"   token_usage.providers {providers:9s} ext_proc {mean['extproc_us_per_chunk']:6.1f} us/chunk "
              f"{mean['extproc_us_per_answer']:7.1f} us/JSON answer; Envoy {mean['envoy_us_per_chunk']:6.1f} us/chunk "
              f"{mean['envoy_us_per_answer']:7.1f} us/JSON answer; a stream {mean['stream_seconds'] * 1000:6.0f} ms")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--streams", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--part", choices=["1", "2", "both"], default="both")
    parser.add_argument("--baseline", metavar="TREE", help="also measure part 1 with tracing off on another tree's extproc "
                        "(for example `git archive <commit> | tar -x -C TREE`): the tree before tracing")
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":  # the --baseline run, on the other tree: (wall, CPU) as JSON
        url, requests, with_redis = argv[1], int(argv[2]), argv[3] == "1"
        print(orjson.dumps(asyncio.run(stream_loop(url, None, requests, with_redis))).decode())
        return
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="iris-observability-cost-"))
    if args.part in ("1", "both"):
        part_one(args.requests, args.rounds, work, args.baseline)
    if args.part in ("2", "both"):
        part_two(args.streams, args.tokens, work)


if __name__ == "__main__":
    main()
