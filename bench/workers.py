"""Workers: requests/s per ext_proc worker at saturation, for 1 and 2 workers (issue 24).

For each count N of `--workers` (default 1,2), the full gateway of `bench.overhead` (LocalGateway:
Redis, zero-delay simulated providers, Envoy with `--envoy-concurrency` threads, default 2, and
`serve` with `server.workers` N, each worker on its own port, every port an endpoint of Envoy's
`extproc` cluster), the same pinned-session requests (`--users` users, so nearly every request is
a pinned-session admission and its release), a warm-up, then a **closed loop** at saturation:
`--concurrency` senders each send their next request as soon as the previous one answered, for
`--seconds`. Prints per N: requests/s in all and per worker (all / N), the smallest worker's share
of the decisions (counted in each worker's own multiprocess metrics file), each worker's CPU ms
per request and the requests/s one worker core sustains (requests / worker CPU seconds), Envoy's
CPU ms per request, and the 1-minute load average before and after. Then the scaling: requests/s
with N workers over requests/s with the first N.

The machine the figures come from matters more here than anywhere: every process (Envoy, the
load generator, Redis, the simulator, the workers) shares its cores, so on 2 cores a second
worker takes CPU from Envoy and the generator and requests/s per worker falls; the worker CPU ms
per request, which does not depend on who else runs, is the figure to carry to a machine with
cores to spare (docs/capacity.md "ext_proc workers").

    python -m bench.workers --workers 1,2 --seconds 20 --json out/workers.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from prometheus_client.multiprocess import MultiProcessCollector

from bench.common import (
    MODEL,
    ZERO_DELAY,
    cpu_seconds,
    load_average,
    machine_description,
    print_figure,
    print_table,
    roomy_config,
    run_loadgen,
    write_json,
)
from irislab.local_gateway import LocalGateway


def worker_pids(supervisor: int, workers: int) -> list[int]:
    """The pids of the processes that serve: the supervisor's children by worker index order
    (their start order), or the server itself when it runs alone."""
    if workers == 1:
        return [supervisor]
    return [int(pid) for pid in Path(f"/proc/{supervisor}/task/{supervisor}/children").read_text().split()]


def decisions_of(metrics_dir: Path, pid: int) -> float:
    """iris_routing_decisions_total in worker `pid`'s own multiprocess counter file (0 if none yet)."""
    path = metrics_dir / f"counter_{pid}.db"
    if not path.exists():
        return 0.0
    return sum(sample.value for metric in MultiProcessCollector.merge([str(path)]) if metric.name == "iris_routing_decisions"
               for sample in metric.samples)


def measure_workers(args: argparse.Namespace, workers: int, work: Path) -> dict[str, Any]:
    """One gateway with `workers` workers: warm-up, then the closed loop at saturation. Returns
    the load generator's result with each worker's decisions and CPU seconds, Envoy's CPU seconds
    and the load average before and after."""
    metrics_dir = work / "multiproc"
    sims = {name: ZERO_DELAY for name in ("iris-1", "iris-2", "tensorx")}
    gateway = LocalGateway(config_data=roomy_config(), simulations=sims, work_dir=work / "gateway", workers=workers,
                           envoy_concurrency=args.envoy_concurrency, env={"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)})
    with gateway:
        instance = gateway.running[0]
        pids = worker_pids(instance.extproc.pid, workers)
        common = ["--users", str(args.users), "--model", MODEL, "--session-header"]
        run_loadgen(instance.url, work / "warmup.json", "--rate", "100", "--requests", str(args.warmup_requests), *common,
                    max_seconds=args.seconds)
        decided = [decisions_of(metrics_dir, pid) for pid in pids]
        cpu = [cpu_seconds(pid) for pid in pids]
        envoy_cpu = cpu_seconds(instance.envoy.pid)
        load_before = load_average()
        result = run_loadgen(instance.url, work / "saturation.json", "--concurrency", str(args.concurrency),
                             "--requests", str(args.max_requests), *common, max_seconds=args.seconds)
        result["load_average_after"] = load_average()
        result["load_average_before"] = load_before
        result["worker_decisions"] = [decisions_of(metrics_dir, pid) - before for pid, before in zip(pids, decided)]
        result["worker_cpu_s"] = [cpu_seconds(pid) - before for pid, before in zip(pids, cpu)]
        result["envoy_cpu_s"] = cpu_seconds(instance.envoy.pid) - envoy_cpu
        result["workers"] = workers
    result.pop("latencies_ms", None)
    return result


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    runs = {}
    for workers in args.workers:
        print(f"measuring {workers} worker(s), load average {load_average()}", flush=True)
        runs[str(workers)] = measure_workers(args, workers, work / f"workers-{workers}")
    arguments = vars(args) | {"json": str(args.json), "from_json": None}
    return {"machine": machine_description(), "args": arguments, "runs": runs}


def figures(result: dict[str, Any]) -> dict[str, float]:
    """Per worker count N: requests/s in all and per worker, the smallest worker's share of the
    decisions, worker and Envoy CPU ms per request, requests/s per worker core; the scaling of
    requests/s against the first count measured."""
    out: dict[str, float] = {}
    runs = result["runs"]
    for n, run in runs.items():
        ok, workers = run["ok"], run["workers"]
        decided = sum(run["worker_decisions"])
        worker_cpu = sum(run["worker_cpu_s"])
        out[f"saturation_rps@{n}"] = run["achieved_rps"]
        out[f"rps_per_worker@{n}"] = run["achieved_rps"] / workers
        out[f"smallest_worker_share@{n}"] = min(run["worker_decisions"]) / decided if decided else float("nan")
        out[f"worker_cpu_ms_per_request@{n}"] = worker_cpu * 1000 / ok if ok else float("nan")
        out[f"requests_per_worker_core_s@{n}"] = ok / worker_cpu if worker_cpu else float("nan")
        out[f"envoy_cpu_ms_per_request@{n}"] = run["envoy_cpu_s"] * 1000 / ok if ok else float("nan")
        out[f"load_average@{n}"] = run["load_average_after"]
    first = next(iter(runs))
    for n in list(runs)[1:]:
        out[f"scaling_rps@{n}_over_{first}"] = runs[n]["achieved_rps"] / runs[first]["achieved_rps"]
    return out


def report(result: dict[str, Any]) -> None:
    rows = []
    for n, run in result["runs"].items():
        ok = run["ok"]
        for index, (decided, cpu) in enumerate(zip(run["worker_decisions"], run["worker_cpu_s"])):
            rows.append([n, index, decided, decided / run["wall_s"], cpu * 1000 / decided if decided else "", cpu / run["wall_s"]])
        rows.append([n, "all", ok, run["achieved_rps"], sum(run["worker_cpu_s"]) * 1000 / ok if ok else "",
                     sum(run["worker_cpu_s"]) / run["wall_s"]])
    print_table("Saturation (closed loop), per worker",
                ["workers", "worker", "requests", "req/s", "worker CPU ms/req", "worker cores busy"], rows)
    print_table("Saturation (closed loop), in all",
                ["workers", "req/s", "req/s per worker", "p50 ms", "p99 ms", "errors", "Envoy CPU ms/req", "load avg before", "after"],
                [[n, run["achieved_rps"], run["achieved_rps"] / run["workers"], run["p50_ms"], run["p99_ms"], run["errors"],
                  run["envoy_cpu_s"] * 1000 / run["ok"] if run["ok"] else "", run["load_average_before"], run["load_average_after"]]
                 for n, run in result["runs"].items()])
    print()
    for name, value in figures(result).items():
        print_figure(name, value)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.workers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="1,2", help="comma-separated worker counts (server.workers) to measure")
    parser.add_argument("--seconds", type=float, default=20.0, help="duration of each saturation run (s)")
    parser.add_argument("--max-requests", type=int, default=200_000)
    parser.add_argument("--concurrency", type=int, default=32, help="closed-loop senders at saturation")
    parser.add_argument("--users", type=int, default=100, help="users (sessions) the requests come from")
    parser.add_argument("--warmup-requests", type=int, default=300)
    parser.add_argument("--envoy-concurrency", type=int, default=2, help="Envoy worker threads")
    parser.add_argument("--tiny", action="store_true", help="a few seconds in all (for the smoke test)")
    parser.add_argument("--json", type=Path, help="write the full result here")
    parser.add_argument("--from-json", type=Path, help="report a result saved with --json; no run")
    args = parser.parse_args(argv)
    args.workers = [int(n) for n in args.workers.split(",") if n]
    if args.tiny:
        args.seconds, args.warmup_requests, args.concurrency, args.users = 2.0, 20, 4, 10
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.from_json:
        result = json.loads(args.from_json.read_text())
    else:
        with tempfile.TemporaryDirectory(prefix="iris-bench-workers-") as tmp:
            result = measure(args, Path(tmp))
        result["figures"] = figures(result)
        write_json(args.json, result)
    machine = result["machine"]
    print(f"machine: {machine['nproc']} cores, {machine['cpu_model']}; closed loop, {result['args']['concurrency']} senders, "
          f"{result['args']['envoy_concurrency']} Envoy threads")
    report(result)


if __name__ == "__main__":
    main()
