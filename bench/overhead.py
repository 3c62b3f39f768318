"""Overhead: what the router adds to every request, and what it costs in throughput.

One simulated upstream with zero delay is reached several ways: `direct` (no proxy at all);
`plain`, an Envoy rendered from envoy/envoy.yaml without the ext_proc filter whose catch-all route
goes straight to the upstream's cluster; `gateway`, the full gateway (Envoy + ext_proc + Redis
admission + release); `floor`, the same Envoy file in front of `bench.floor_extproc`, an ext_proc
server on the gateway's stack that routes every request to the upstream and does nothing else
(what the three ext_proc message exchanges cost alone: `--no-floor` leaves it out); and each
peer of `bench.peers` that is installed (SGLang Model Gateway and vllm-router with their
policies, each its own process over the same upstream; `--peers none` leaves them out, a peer
that is not installed is reported as skipped). The same load generator (`bench.loadgen`, its own process) sends short non-streamed chat requests from
`--users` users (sessions, so nearly every request is a pinned-session admission; the user id
goes in `x-user-id` and in `X-Session-ID`, which vllm-router's sticky policy reads) to each path,
one path after the other: open loop at each fixed rate, then closed loop at saturation.

Prints, per rate, latency p50/p90/p99 (ms) of every path and the latency each adds over plain
Envoy and over the direct path (per percentile), then the saturation throughput (requests/s) of both, their ratio, and the
ext_proc CPU per request (ms) at each rate and at saturation, with the requests/s one ext_proc core
sustains at saturation. The ext_proc server's own decision histogram (`iris_decision_duration_seconds`:
parsed body to decision, its Redis round trip included) gives the mean decision time per rate, the
part of the added latency that the routing itself (rather than the ext_proc messages) costs.

    python -m bench.overhead --rates 50,200,500 --seconds 20 --json out/overhead.json --plot-dir docs

`--hot-path-client redis-py` runs the gateway with `redis.hot_path_client: redis-py` (the routing
scripts over redis-py's pool instead of the pipelined client, the default `pipelined`), to compare
the two.

`--workers 2` runs `serve` with `server.workers` 2 (each worker on its own port, an endpoint of
Envoy's `extproc` cluster, which balances streams over them); the ext_proc CPU then sums the
supervisor and its workers. `python -m bench.workers` reports requests/s per worker for 1 and 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import (
    MODEL,
    ZERO_DELAY,
    cpu_seconds,
    decision_totals,
    load_average,
    machine_description,
    plain_envoy_bootstrap,
    print_figure,
    print_table,
    roomy_config,
    run_loadgen,
    start_envoy,
    write_json,
)
from bench.floor_extproc import ROUTING_HEADER
from bench.peers import BY_NAME, PEERS, start_peer, unavailable
from irislab import envoy_config
from irislab.local_gateway import LocalGateway
from irislab.processes import ManagedProcess, free_port, spawn, wait_for_port

PATHS = ("direct", "plain", "gateway")  # then the floor and the peers that run here
EXT_PROC_PATHS = ("gateway", "floor")  # paths with an ext_proc server, whose CPU is measured apart


def selected_peers(spec: str) -> tuple[list[str], dict[str, str]]:
    """The peers named by `--peers` ("all", "none" or a comma-separated list of bench.peers
    names) that can run here, and {name: why not} of those that cannot."""
    names = [p.name for p in PEERS] if spec == "all" else [] if spec == "none" else [n for n in spec.split(",") if n]
    runnable, skipped = [], {}
    for name in names:
        reason = unavailable(BY_NAME[name])
        if reason is None:
            runnable.append(name)
        else:
            skipped[name] = reason
    return runnable, skipped


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Start every path over one upstream and run every load; returns the result document."""
    sims = {name: ZERO_DELAY for name in ("iris-1", "iris-2", "tensorx")}
    config = roomy_config()
    config["redis"]["hot_path_client"] = args.hot_path_client
    peers, skipped = selected_peers(args.peers)
    for name, reason in skipped.items():
        print(f"skipping peer {name}: {reason}", flush=True)
    with LocalGateway(config_data=config, simulations=sims, work_dir=work / "gateway", workers=args.workers,
                      envoy_concurrency=args.envoy_concurrency) as gateway:
        metrics_url = gateway.running[0].metrics_url  # every worker's, merged, with --workers
        upstream = gateway.providers["iris-1"].port
        bootstrap = plain_envoy_bootstrap(free_port(), free_port(), {"iris-1": upstream}, target_cluster="iris-1")
        started: list[ManagedProcess] = [start_envoy(bootstrap, work, "envoy-plain")]
        try:
            urls = {"direct": f"http://127.0.0.1:{upstream}", "plain": f"http://127.0.0.1:{started[0].port}",
                    "gateway": gateway.url}
            proxy_pids = {"plain": [started[0].pid], "gateway": [gateway.running[0].envoy.pid]}
            extproc_pids = {"gateway": gateway.running[0].extproc.pid}
            if args.floor:
                floor_envoy, floor_extproc = start_floor(gateway.config.server.routing_header, upstream, work)
                started += [floor_envoy, floor_extproc]
                urls["floor"] = f"http://127.0.0.1:{floor_envoy.port}"
                proxy_pids["floor"] = [floor_envoy.pid]
                extproc_pids["floor"] = floor_extproc.pid
            for name in peers:
                started.append(start_peer(BY_NAME[name], [f"http://127.0.0.1:{upstream}"], work))
                urls[name] = f"http://127.0.0.1:{started[-1].port}"
                proxy_pids[name] = [started[-1].pid]
            paths = [*PATHS, *(["floor"] if args.floor else []), *peers]
            common = ["--users", str(args.users), "--model", MODEL, "--session-header"]
            for path in paths:  # warm-up: connections, pins of every user, code paths
                run_loadgen(urls[path], work / f"warmup-{path}.json", "--rate", "100",
                            "--requests", str(args.warmup_requests), *common, max_seconds=args.seconds)
            rates = []
            for rate in args.rates:
                entry: dict[str, Any] = {"rate": rate}
                for path in paths:
                    decided_before = decision_totals(metrics_url)
                    cpu_before = tree_cpu_seconds(extproc_pids[path]) if path in extproc_pids else 0.0
                    proxy_before = sum(cpu_seconds(pid) for pid in proxy_pids.get(path, []))
                    entry[path] = run_loadgen(
                        urls[path], work / f"rate-{rate:g}-{path}.json", "--rate", str(rate),
                        "--requests", str(int(rate * args.seconds)), *common, max_seconds=args.seconds,
                    )
                    if path in proxy_pids:  # the proxy's own CPU (Envoy's for the gateway; ext_proc apart)
                        entry[path]["proxy_cpu_s"] = sum(cpu_seconds(pid) for pid in proxy_pids[path]) - proxy_before
                    if path in extproc_pids:
                        entry[path]["extproc_cpu_s"] = tree_cpu_seconds(extproc_pids[path]) - cpu_before
                    if path == "gateway":
                        seconds, count = (a - b for a, b in zip(decision_totals(metrics_url), decided_before))
                        entry["decision_mean_ms"] = seconds * 1000 / count if count else float("nan")
                rates.append(entry)
            saturation: dict[str, Any] = {}
            for path in paths:
                cpu_before = tree_cpu_seconds(extproc_pids[path]) if path in extproc_pids else 0.0
                saturation[path] = run_loadgen(
                    urls[path], work / f"saturation-{path}.json", "--concurrency", str(args.concurrency),
                    "--requests", str(args.saturation_max_requests), *common, max_seconds=args.saturation_seconds,
                )
                if path in extproc_pids:
                    saturation[path]["extproc_cpu_s"] = tree_cpu_seconds(extproc_pids[path]) - cpu_before
        finally:
            for process in started:
                process.stop()
    arguments = vars(args) | {"plot_dir": str(args.plot_dir), "json": str(args.json), "from_json": None}
    return {"machine": machine_description(), "args": arguments, "paths": paths, "skipped_peers": skipped,
            "rates": rates, "saturation": saturation}


def start_floor(routing_header: str, upstream: int, work: Path) -> tuple[ManagedProcess, ManagedProcess]:
    """The `floor` path: bench.floor_extproc on a free port and an Envoy rendered from
    envoy/envoy.yaml in front of it, every provider cluster sent to the `upstream` port.
    Returns (envoy, ext_proc server)."""
    port = free_port()
    extproc = spawn("floor-extproc", [sys.executable, "-m", "bench.floor_extproc", "--port", str(port),
                                      "--cluster", "iris-1"], work)
    extproc.port = port
    wait_for_port(port, process=extproc.popen)
    if routing_header != ROUTING_HEADER:
        raise ValueError(f"the floor routes with {ROUTING_HEADER}, the gateway's config uses {routing_header}")
    clusters = {"extproc": port, **{name: upstream for name in ("iris-1", "iris-2", "tensorx")}}
    bootstrap = envoy_config.render(free_port(), free_port(), clusters)
    return start_envoy(bootstrap, work, "envoy-floor"), extproc


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of the ext_proc server: the process and, with --workers, its worker children."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return cpu_seconds(pid) + sum(cpu_seconds(int(child)) for child in children)


def result_paths(result: dict[str, Any]) -> list[str]:
    """The paths measured (older results had plain and gateway only)."""
    return result.get("paths", ["plain", "gateway"])


def figures(result: dict[str, Any]) -> dict[str, float]:
    """The headline figures: added latency per rate and percentile (ms), saturation throughput
    of both paths (requests/s), their ratio, ext_proc CPU per request (ms) and per-core rate."""
    out: dict[str, float] = {}
    paths = result_paths(result)
    for entry in result["rates"]:
        rate = f"{entry['rate']:g}"
        for p in ("p50", "p90", "p99"):
            out[f"added_{p}_ms@{rate}"] = entry["gateway"][f"{p}_ms"] - entry["plain"][f"{p}_ms"]
        for path in paths:
            if path in ("plain", "direct"):
                continue
            for p in ("p50", "p99"):
                if "direct" in paths:
                    out[f"added_over_direct_{p}_ms@{rate}:{path}"] = entry[path][f"{p}_ms"] - entry["direct"][f"{p}_ms"]
                if path != "gateway":
                    out[f"added_over_plain_{p}_ms@{rate}:{path}"] = entry[path][f"{p}_ms"] - entry["plain"][f"{p}_ms"]
        out[f"decision_mean_ms@{rate}"] = entry["decision_mean_ms"]
        out[f"extproc_cpu_ms_per_request@{rate}"] = _cpu_ms_per_request(entry["gateway"])
    sat = result["saturation"]
    out["saturation_plain_rps"] = sat["plain"]["achieved_rps"]
    out["saturation_gateway_rps"] = sat["gateway"]["achieved_rps"]
    for path in paths:
        if path not in ("plain", "gateway"):
            out[f"saturation_rps:{path}"] = sat[path]["achieved_rps"]
    out["throughput_ratio"] = sat["gateway"]["achieved_rps"] / sat["plain"]["achieved_rps"]
    cpu_ms = _cpu_ms_per_request(sat["gateway"])
    out["extproc_cpu_ms_per_request"] = cpu_ms
    out["requests_per_extproc_core_s"] = 1000 / cpu_ms if cpu_ms else float("nan")
    if "floor" in paths:
        floor_ms = _cpu_ms_per_request(sat["floor"])
        out["extproc_cpu_ms_per_request:floor"] = floor_ms
        out["requests_per_extproc_core_s:floor"] = 1000 / floor_ms if floor_ms else float("nan")
    return out


def _cpu_ms_per_request(load: dict[str, Any]) -> float:
    """ext_proc CPU (ms) per OK request of a gateway load; NaN if not measured."""
    seconds = load.get("extproc_cpu_s")
    return seconds * 1000 / load["ok"] if seconds is not None and load["ok"] else float("nan")


def _added(entry: dict[str, Any], path: str, base: str, p: str) -> Any:
    if base not in entry or path == base:
        return ""
    return entry[path][f"{p}_ms"] - entry[base][f"{p}_ms"]


def report(result: dict[str, Any]) -> None:
    paths = result_paths(result)
    for name, reason in result.get("skipped_peers", {}).items():
        print(f"peer {name} skipped: {reason}")
    rows = []
    for entry in result["rates"]:
        for path in paths:
            r = entry[path]
            proxy_cpu = r.get("proxy_cpu_s")
            rows.append([f"{entry['rate']:g}", path, r["achieved_rps"], r["p50_ms"], r["p90_ms"], r["p99_ms"],
                         _added(entry, path, "plain", "p50"), _added(entry, path, "plain", "p99"),
                         _added(entry, path, "direct", "p50"), _added(entry, path, "direct", "p99"),
                         proxy_cpu * 1000 / r["ok"] if proxy_cpu is not None and r["ok"] else "",
                         _cpu_ms_per_request(r) if path in EXT_PROC_PATHS else "", r["errors"], r["send_lag_p99_ms"]])
        rows.append([f"{entry['rate']:g}", "gateway: routing decision (mean)", "", entry["decision_mean_ms"]]
                    + [""] * 10)
    print_table("Latency at fixed rates (ms)",
                ["rate req/s", "path", "achieved req/s", "p50", "p90", "p99", "added p50 over plain",
                 "added p99 over plain", "added p50 over direct", "added p99 over direct", "proxy CPU ms/req",
                 "ext_proc CPU ms/req", "errors", "send lag p99"], rows)
    sat = result["saturation"]
    print_table("Saturation (closed loop)", ["path", "req/s", "p50 ms", "p99 ms", "errors"],
                [[path, sat[path]["achieved_rps"], sat[path]["p50_ms"], sat[path]["p99_ms"], sat[path]["errors"]]
                 for path in paths])
    print()
    for name, value in figures(result).items():
        print_figure(name, value)


def plot(result: dict[str, Any], plot_dir: Path) -> Path:
    """docs/overhead_latency_cdf.png: the latency CDF of both paths, one panel per rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    entries = result["rates"]
    fig, axes = plt.subplots(1, len(entries), figsize=(4.2 * len(entries), 3.6), squeeze=False, sharey=True)
    styles = {"direct": ":", "plain": "-", "gateway": "--"}
    for ax, entry in zip(axes[0], entries):
        for path in result_paths(result):
            style = styles.get(path, "-.")
            values = sorted(entry[path]["latencies_ms"])
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], style, label=path, linewidth=1)
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))  # labels within one decade too
        ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_title(f"{entry['rate']:g} req/s")
        ax.set_xlabel("latency (ms, log)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("share of requests")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Request latency over one zero-delay upstream: direct, plain Envoy, the gateway and its peers")
    fig.tight_layout()
    plot_dir.mkdir(parents=True, exist_ok=True)
    out = plot_dir / "overhead_latency_cdf.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="50,200,500", help="comma-separated fixed rates, requests/s")
    parser.add_argument("--seconds", type=float, default=20.0, help="duration of each fixed-rate run (s)")
    parser.add_argument("--saturation-seconds", type=float, default=15.0, help="duration of each saturation run (s)")
    parser.add_argument("--saturation-max-requests", type=int, default=100_000)
    parser.add_argument("--concurrency", type=int, default=32, help="closed-loop workers at saturation")
    parser.add_argument("--users", type=int, default=100, help="users (sessions) the requests come from")
    parser.add_argument("--warmup-requests", type=int, default=300)
    parser.add_argument("--workers", type=int, default=1, help="ext_proc worker processes (server.workers)")
    parser.add_argument("--hot-path-client", choices=["pipelined", "redis-py"], default="pipelined",
                        help="the gateway's redis.hot_path_client (the client of the routing scripts)")
    parser.add_argument("--envoy-concurrency", type=int, default=1, help="Envoy worker threads")
    parser.add_argument("--peers", default="all",
                        help=f"peers to measure too: all, none, or some of {','.join(p.name for p in PEERS)}")
    parser.add_argument("--floor", action=argparse.BooleanOptionalAction, default=True,
                        help="measure the floor path too (bench.floor_extproc behind the same Envoy file)")
    parser.add_argument("--tiny", action="store_true", help="a few seconds in all (for the smoke test)")
    parser.add_argument("--json", type=Path, help="write the full result here")
    parser.add_argument("--plot-dir", type=Path, help="write overhead_latency_cdf.png here (needs matplotlib)")
    parser.add_argument("--from-json", type=Path, help="report (and plot) a result saved with --json; no run")
    args = parser.parse_args(argv)
    args.rates = [float(r) for r in args.rates.split(",") if r]
    unknown = {n for n in args.peers.split(",") if n} - set(BY_NAME) - {"all", "none"}
    if unknown:
        parser.error(f"unknown peers {sorted(unknown)}; choose from {sorted(BY_NAME)}")
    if args.tiny:
        args.rates, args.seconds, args.saturation_seconds = [20.0, 50.0], 1.0, 1.0
        args.users, args.warmup_requests, args.concurrency = 10, 10, 4
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.from_json:
        result = json.loads(args.from_json.read_text())
    else:
        load_before = load_average()
        with tempfile.TemporaryDirectory(prefix="iris-bench-overhead-") as tmp:
            result = measure(args, Path(tmp))
        result["load_average_before"] = load_before
        result["figures"] = figures(result)
        write_json(args.json, result)
    print(f"machine: {result['machine']}; 1-min load average before {result.get('load_average_before')}, after "
          f"{result['machine']['load_average_1min']}")
    report(result)
    if args.plot_dir:
        print(f"plot: {plot(result, args.plot_dir)}")


if __name__ == "__main__":
    main()
