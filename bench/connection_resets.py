"""Requests lost to connection resets between Envoy and real engines (issue 30, item 6).

    python -m bench.connection_resets [--requests 300] [--clients 4] [--engines 2] [--front gateway|envoy] [--tiny] [--json PATH]

Short streamed chats (`--max-tokens`, default 2) through the gateway (`gateway`: Envoy + ext_proc +
Redis, the pool of llama-servers as one managed provider, envoy/envoy.yaml's cluster, as
bench.real_engines runs it) or plain Envoy round robin (`envoy`: bench.common.pool_cluster),
`--clients` at a time, each client sending its next request as soon as the last ended. Printed:
the clients' outcomes (`200 <provider>`, `<status> <code>`), Envoy's access log of the chats by
(status, response flags, details), and the pool cluster's connection counters (upstream
connections, those closed by the engine under a request, retries). `--engine-url` (repeated)
uses engines already running instead of starting `--engines` fresh ones. Figures:
`answered_by_engines`, `resets` (the access log's 503s with flag UC) and `closed_under_request`
(`upstream_cx_destroy_remote_with_active_rq`). `--tiny`: 24 requests, 2 at a time, one engine.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from bench.common import plain_envoy_bootstrap, pool_cluster, print_figure, start_envoy, wait_http_ready, write_json
from irislab.engines import MODEL_NAME, LlamaServer
from irislab.local_gateway import LocalGateway, ProviderSimulation
from irislab.processes import free_port

STATS = ("upstream_cx_total", "upstream_cx_destroy_remote_with_active_rq", "upstream_cx_max_requests", "upstream_rq_retry",
         "upstream_rq_retry_success", "upstream_rq_total")


def drive(url: str, requests: int, clients: int, max_tokens: int) -> Counter:
    """`requests` streamed chats, `clients` at a time; {outcome: count}."""
    outcomes: Counter = Counter()
    lock = threading.Lock()
    numbers = iter(range(requests))

    def client() -> None:
        with httpx.Client(timeout=300) as http:
            for number in numbers:
                body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": f"Say one word about {number}."}],
                        "max_tokens": max_tokens, "stream": True}
                try:
                    with http.stream("POST", f"{url}/v1/chat/completions", json=body, headers={"x-session-id": f"s{number % 16}"}) as r:
                        text = r.read().decode()
                        if r.status_code == 200:
                            outcome = f"200 {r.headers.get('x-iris-provider', 'pool')}"
                        else:
                            outcome = f"{r.status_code} {(json.loads(text).get('error') or {}).get('code')}"
                except httpx.HTTPError as exc:
                    outcome = f"client {type(exc).__name__}"
                with lock:
                    outcomes[outcome] += 1

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes


def access_log(path: Path) -> Counter:
    """The chats of Envoy's JSON access log by (status, flags, details)."""
    found: Counter = Counter()
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            entry = json.loads(line)
            if entry.get("path") == "/v1/chat/completions":
                found[f"{entry['status']} {entry['flags']} {entry['details']}"] += 1
    return found


def cluster_stats(admin_port: int, cluster: str) -> dict[str, int]:
    text = httpx.get(f"http://127.0.0.1:{admin_port}/stats", params={"filter": f"^cluster\\.{cluster}\\."}, timeout=10).text
    values = dict(line.split(": ", 1) for line in text.splitlines() if ": " in line)
    return {name: int(values.get(f"cluster.{cluster}.{name}", "0")) for name in STATS}


def run(args: argparse.Namespace, urls: list[str], work: Path) -> dict[str, Any]:
    if args.front == "envoy":
        admin = free_port()
        ports = [int(url.rsplit(":", 1)[1]) for url in urls]
        bootstrap = plain_envoy_bootstrap(free_port(), admin, {"extproc": free_port()}, "pool",
                                          extra_clusters=[pool_cluster("pool", ports, "ROUND_ROBIN")])
        envoy = start_envoy(bootstrap, work, "envoy")
        try:
            url = f"http://127.0.0.1:{envoy.port}"
            wait_http_ready(f"{url}/health")
            outcomes = drive(url, args.requests, args.clients, args.max_tokens)
            stats = cluster_stats(admin, "pool")
        finally:
            envoy.stop()
        return {"outcomes": outcomes, "access_log": access_log(envoy.log_path), "stats": stats}
    config = {
        "redis": {"key_prefix": "resets"},
        "server": {"expose_routing_headers": True},
        "providers": [{"name": "iris-1", "kind": "managed", "cluster": "iris-1",
                       "models": {MODEL_NAME: {"features": ["chat"], "limits": {"max_global_in_flight_request_slots": 2 * args.clients}}}},
                      {"name": "tensorx", "kind": "unlimited", "cluster": "tensorx", "models": {MODEL_NAME: {"features": ["chat"]}}}],
    }
    with LocalGateway(config_data=config, engines={"iris-1": urls}, default_simulation=ProviderSimulation(ttft_ms=1, per_token_ms=1),
                      work_dir=work / "gateway") as gateway:
        outcomes = drive(gateway.url, args.requests, args.clients, args.max_tokens)
        stats = cluster_stats(gateway.running[0].admin_port, "iris-1")
        log = gateway.running[0].envoy.log_path
        gateway.stop()
        return {"outcomes": outcomes, "access_log": access_log(log), "stats": stats}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--clients", type=int, default=4, help="requests at a time")
    parser.add_argument("--engines", type=int, default=2, help="llama-servers to start (2 slots each, one thread)")
    parser.add_argument("--engine-url", action="append", default=[], help="an engine already running (repeat; replaces --engines)")
    parser.add_argument("--max-tokens", type=int, default=2)
    parser.add_argument("--front", choices=("gateway", "envoy"), default="gateway")
    parser.add_argument("--tiny", action="store_true", help="24 requests, 2 at a time, one engine (for the smoke test)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if args.tiny:
        args.requests, args.clients, args.engines = 24, 2, 1
    with tempfile.TemporaryDirectory(prefix="bench-resets-") as folder:
        work = Path(folder)
        engines = [] if args.engine_url else [LlamaServer(work / "engines", parallel=2, name=f"resets-llama-{i}") for i in range(args.engines)]
        try:
            for engine in engines:
                engine.start()
            result = run(args, args.engine_url or [engine.url for engine in engines], work)
        finally:
            for engine in engines:
                engine.stop()
    print(f"{args.requests} streamed chats, {args.clients} at a time, through {args.front}")
    for title in ("outcomes", "access_log", "stats"):
        print(f"{title}: {json.dumps(dict(result[title]), sort_keys=True)}")
    print_figure("answered_by_engines", sum(n for outcome, n in result["outcomes"].items() if outcome in ("200 iris-1", "200 pool")))
    print_figure("resets", sum(n for entry, n in result["access_log"].items() if entry.startswith("503 UC")))
    print_figure("closed_under_request", result["stats"]["upstream_cx_destroy_remote_with_active_rq"])
    write_json(args.json, {"args": {k: str(v) for k, v in vars(args).items()}, **{k: dict(v) for k, v in result.items()}})
    return result


if __name__ == "__main__":
    main()
