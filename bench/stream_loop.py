"""The stream loop's own cost, in one process: what the ext_proc server's Python does for a
request, without gRPC, Envoy or the other processes that share the cores with it.

A `Gateway` (extproc.operations.gateway, the `roomy_config` of bench.common, Redis started here
without persistence) gets the three Envoy messages of a pinned chat request, built once, straight
into `ExternalProcessor._handle`: request headers, request body (parse, session, decision through
the lease table, the routing answer), response headers (status 200); then the stream's end
(the release, batched, in the background). Each request is one of `--users` users, so after
the warm-up every decision is a pinned session's (`get_pin_and_admit`, then `release`).

Rows: decisions through Redis (the hot path), and, with the Redis breaker held open, decisions
of the outage policy (`local_share`, on the same provider, with no Redis call at all: the
routing scripts' share is the difference; the gateway's background loops are stopped), one
request at a time and `--concurrency` at once. This process's CPU per request
(time.process_time, microseconds: Redis's own CPU is not in it) and the wall time per request.

Then the pause of one full collection of the garbage collector over the gateway's heap, before
and after `freeze_start_up_heap` (milliseconds): the event loop, and every request in flight,
waits for it.

    python -m bench.stream_loop [--requests 5000] [--concurrency 32] [--rounds 3]

The figure comparable across machines is the ratio between rows; bench.overhead measures the
same server behind Envoy, where this work runs with colder caches (docs/results/issue24/README.md "Where
the rest goes").
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import tempfile
import time
from pathlib import Path

import orjson
import uvloop
from envoy.config.core.v3.base_pb2 import HeaderValue
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest

from bench.common import MODEL, USER_IDENTITY_HEADER, load_average, print_figure, print_table, roomy_config
from extproc.config import parse_config
from extproc.operations.gateway import Gateway
from extproc.protocol.stream import StreamState
from irislab.processes import free_port, start_redis

SECRET = b"x9Qm2vLr8TzP4kWn7cYb3HfD6sJg1aEu"


def _headers(pairs: list[tuple[str, str]], into) -> None:
    for key, value in pairs:
        into.headers.headers.append(HeaderValue(key=key, raw_value=value.encode()))


def request_messages(user: str) -> tuple[ProcessingRequest, ProcessingRequest]:
    """(request headers, request body) of a short chat request from `user`."""
    body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": f"hello from {user}"}], "max_tokens": 8})
    headers = ProcessingRequest()
    _headers([(":path", "/v1/chat/completions"), (":method", "POST"), ("content-type", "application/json"),
              (USER_IDENTITY_HEADER, user), ("content-length", str(len(body)))], headers.request_headers)
    message = ProcessingRequest()
    message.request_body.body = body
    message.request_body.end_of_stream = True
    return headers, message


def response_headers() -> ProcessingRequest:
    message = ProcessingRequest()
    _headers([(":status", "200"), ("content-type", "application/json")], message.response_headers)
    return message


async def drive(gateway: Gateway, messages: list[tuple[ProcessingRequest, ProcessingRequest]], requests: int,
                concurrency: int) -> tuple[float, float]:
    """Run `requests` requests, `concurrency` at once; (CPU us, wall us) per request. Fails when a
    request is not routed (a refusal or an error answer)."""
    processor, answered = gateway.processor, response_headers()

    async def one(index: int) -> None:
        stream = StreamState()
        headers, body = messages[index % len(messages)]
        await processor._handle(stream, headers)
        answer = await processor._handle(stream, body)
        if stream.held is None:
            raise RuntimeError(f"request {index} was not routed: {answer}")
        await processor._handle(stream, answered)
        processor._end_stream(stream)

    async def worker(first: int) -> None:
        for index in range(first, requests, concurrency):
            await one(index)

    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    await gateway.leases.releases_settled()  # the last releases, before the next run
    return cpu * 1e6 / requests, wall * 1e6 / requests


def full_collection_ms() -> float:
    started = time.perf_counter()
    gc.collect()
    return (time.perf_counter() - started) * 1000


async def measure(args: argparse.Namespace, work: Path) -> tuple[list[list], dict[str, float]]:
    redis = start_redis(work)
    try:
        data = roomy_config()
        data["redis"]["url"] = f"redis://127.0.0.1:{redis.port}/0"
        data["redis"]["outage_policy"] = "local_share"  # the breaker open: this instance's share, on iris-1
        data["server"]["listen"] = f"127.0.0.1:{free_port()}"
        gateway = Gateway(parse_config(data), SECRET)
        pauses = {"before": statistics.median(full_collection_ms() for _ in range(3))}
        await gateway.start()  # freezes the start-up heap
        pauses["after"] = statistics.median(full_collection_ms() for _ in range(3))
        for task in gateway._background:  # no probe closes the breaker this bench holds open
            task.cancel()
        await gateway._heartbeat_once()  # one live instance: the local share is the pair's whole
        messages = [request_messages(f"user-{i}") for i in range(args.users)]
        results: dict[tuple[str, int], list[tuple[float, float]]] = {}
        try:
            for _ in range(args.rounds):
                for decisions in ("redis", "outage policy"):
                    if decisions == "redis":
                        gateway.breaker.close()
                    else:
                        gateway.breaker.trip(RuntimeError("bench.stream_loop: decisions of the outage policy"))
                    for concurrency in (1, args.concurrency):
                        await drive(gateway, messages, args.users * 2, concurrency)  # warm-up: pins, code paths
                        results.setdefault((decisions, concurrency), []).append(
                            await drive(gateway, messages, args.requests, concurrency))
        finally:
            gateway.breaker.close()
            await gateway.drain(delay_seconds=0)
            gc.unfreeze()
        rows = [[decisions, concurrency, min(c for c, _ in runs), statistics.median(c for c, _ in runs),
                 min(w for _, w in runs)] for (decisions, concurrency), runs in results.items()]
        return rows, pauses
    finally:
        redis.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.stream_loop", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=5000, help="requests per run")
    parser.add_argument("--concurrency", type=int, default=32, help="requests at once in the concurrent runs")
    parser.add_argument("--users", type=int, default=100, help="users (pinned sessions) the requests come from")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each row (the lowest and the median CPU are shown)")
    args = parser.parse_args(argv)
    print(f"1-min load average before: {load_average()}")
    with tempfile.TemporaryDirectory(prefix="iris-bench-stream-loop-") as tmp:
        rows, pauses = uvloop.run(measure(args, Path(tmp)))
    print_table("The stream loop's CPU per request (this process; us)",
                ["decisions", "at once", "CPU lowest", "CPU median", "wall lowest"], rows)
    print_table("One full garbage collection of the gateway's heap (ms)", ["start-up heap", "pause"],
                [["not frozen", pauses["before"]], ["frozen", pauses["after"]]])
    for decisions, concurrency, lowest, _, _ in rows:
        print_figure(f"stream_loop_cpu_us:{decisions.replace(' ', '_')}@{concurrency}", lowest)
    print_figure("full_collection_ms:not_frozen", pauses["before"])
    print_figure("full_collection_ms:frozen", pauses["after"])
    print(f"1-min load average after: {load_average()}")


if __name__ == "__main__":
    main()
