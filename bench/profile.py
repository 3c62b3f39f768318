"""Where the ext_proc server's time goes under load: a py-spy profile, summarized.

Starts the gateway of the overhead benchmark (zero-delay upstream, limits that never bind), warms
it up, then samples the ext_proc process with `py-spy record` (Python frames, idle threads left
out) while `bench.loadgen` sends `--rate` requests/s for `--seconds`. Prints the functions with
the most samples on their own (self) and with them anywhere on the stack (inclusive), as shares
of all active samples, and the share per area (gRPC, protobuf, Redis client, asyncio, routing,
parsing, ...). It also reads each ext_proc thread's CPU time from /proc before and after the load
(not sampled): CPU per request by thread and in all, and the requests/s one core would sustain at
that rate. py-spy counts a thread blocked in native code as active, so sample shares across
threads are not CPU shares (gRPC's poller thread gets many more samples than CPU); the main
thread's areas are therefore also given alone, and in ms of its measured CPU per request.
`--collapsed PATH` keeps py-spy's raw collapsed stacks (for flame graphs).

    python -m bench.profile --rate 300 --seconds 20 --json out/profile.json
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from bench.common import (
    MODEL,
    ZERO_DELAY,
    load_average,
    machine_description,
    print_figure,
    print_table,
    roomy_config,
    run_loadgen,
    stat_cpu_seconds,
    write_json,
)
from irislab.local_gateway import LocalGateway

# First matching rule names the area of a sample's leaf frame (`function (path:line)`). py-spy
# sees Python frames only: time in C code is charged to the Python frame that called it, so the
# first rules name the frames that mostly stand for native code.
# The server runs on uvloop (`serve --event-loop uvloop`, the default): its loop is native code
# below `Runner.run`, so a sample whose leaf is `Runner.run` is in uvloop itself (polling, timers,
# callbacks, C task steps, gRPC aio completions). The pure-asyncio loop (`--event-loop asyncio`)
# shows as `EpollSelector.select` and `Handle._run` instead.
AREAS = (
    ("gRPC poller thread (native)", re.compile(r"^Thread\.run \(.*threading\.py")),
    ("event loop in native code (uvloop: polling, callbacks, C task steps, gRPC aio)",
     re.compile(r"^(Runner\.run \(.*asyncio/runners\.py|run_until_complete )")),
    ("asyncio: epoll wait and wakeups", re.compile(r"^EpollSelector\.select ")),
    ("event-loop callbacks in native code (C task steps, gRPC aio)", re.compile(r"^Handle\._run ")),
    ("socket writes through asyncio streams (Redis client; native send)",
     re.compile(r"^StreamWriter\.(write|writelines) \(.*asyncio/streams\.py")),
    ("gRPC: stream read/write awaited in Process (native)",
     re.compile(r"^ExternalProcessor\.(Process|_next_message) ")),
    ("protobuf", re.compile(r"google/protobuf|_pb2|envoy/service|envoy/config")),
    ("grpc", re.compile(r"grpc/")),
    ("redis client", re.compile(r"redis/")),
    ("asyncio", re.compile(r"asyncio/|uvloop")),
    ("ext_proc: routing + state", re.compile(r"extproc/(routing|state|leases|degraded)\.py")),
    ("ext_proc: request parsing + session id", re.compile(r"extproc/openai_request\.py|hmac|hashlib|orjson")),
    ("ext_proc: server + messages", re.compile(r"extproc/(server|envoy_messages|metrics)\.py")),
    ("prometheus client", re.compile(r"prometheus_client/")),
    ("logging", re.compile(r"logging/")),
)
FRAME = re.compile(r"^(?P<func>.*?) \((?P<path>.*):(?P<line>\d+)\)$")


def py_spy() -> str:
    """The py-spy command (beside this Python, else on PATH). Raises SystemExit if missing."""
    beside = Path(sys.executable).parent / "py-spy"
    found = str(beside) if beside.exists() else shutil.which("py-spy")
    if not found:
        raise SystemExit("py-spy is not installed: pip install -e '.[bench]'")
    return found


def parse_collapsed(text: str) -> list[tuple[list[str], int]]:
    """py-spy's raw output: one `frame;frame;...;leaf count` line per distinct stack."""
    stacks = []
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            stacks.append((stack.split(";"), int(count)))
    return stacks


def short(frame: str) -> str:
    """`function (file.py:line)` with the path shortened to its package-relative tail."""
    match = FRAME.match(frame)
    if not match:
        return frame
    path = match["path"]
    for marker in ("site-packages/", "lib/python3", "/work/"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{match['func']} ({path})"


def area(frame: str) -> str:
    for name, pattern in AREAS:
        if pattern.search(frame):
            return name
    return "other"


def summarize(stacks: list[tuple[list[str], int]], top: int) -> dict[str, Any]:
    """Self and inclusive shares per function (line numbers dropped) and self share per area, of
    all samples; and the share per area of the main thread's samples alone (stacks not rooted in
    `Thread._bootstrap`: the event loop, where the routing runs)."""
    total = sum(count for _, count in stacks) or 1
    self_counts: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    areas: Counter[str] = Counter()
    main_areas: Counter[str] = Counter()
    for frames, count in stacks:
        frames = [f for f in frames if not f.startswith("process ") and not f.startswith("thread ")]
        if not frames:
            continue
        leaf = frames[-1]
        self_counts[short(leaf)] += count
        areas[area(leaf)] += count
        if not frames[0].startswith("Thread._bootstrap "):
            main_areas[area(leaf)] += count
        for name in {short(f) for f in frames}:
            inclusive[name] += count
    main_total = sum(main_areas.values()) or 1
    return {
        "samples": total,
        "self": [(name, n / total) for name, n in self_counts.most_common(top)],
        "inclusive": [(name, n / total) for name, n in inclusive.most_common(top)],
        "areas": [(name, n / total) for name, n in areas.most_common()],
        "main_thread_samples": sum(main_areas.values()),
        "main_thread_areas": [(name, n / main_total) for name, n in main_areas.most_common()],
    }


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """User + system CPU time (s) of each thread of `pid` by thread name (/proc/<pid>/task; the
    main thread is `main`, threads of one name summed)."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = "main" if task.name == str(pid) else (task / "comm").read_text().strip()
            seconds = stat_cpu_seconds(task / "stat")
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended meanwhile
        out[name] = out.get(name, 0.0) + seconds
    return out


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    sims = {name: ZERO_DELAY for name in ("iris-1", "iris-2", "tensorx")}
    raw = work / "profile.txt"
    with LocalGateway(config_data=roomy_config(), simulations=sims, work_dir=work / "gateway") as gateway:
        common = ["--users", "100", "--model", MODEL]
        run_loadgen(gateway.url, work / "warmup.json", "--rate", "100", "--requests", "200", *common, max_seconds=10)
        argv = [py_spy(), "record", "--pid", str(gateway.running[0].extproc.pid), "--format", "raw",
                "--output", str(raw), "--duration", str(int(args.seconds) + 1), "--rate", str(args.sample_rate),
                *(["--native"] if args.native else ["--nonblocking"])]
        pid = gateway.running[0].extproc.pid
        spy = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            before = thread_cpu_seconds(pid)
            load = run_loadgen(gateway.url, work / "load.json", "--rate", str(args.rate),
                               "--requests", str(int(args.rate * args.seconds)), *common, max_seconds=args.seconds)
            after = thread_cpu_seconds(pid)
        finally:
            _, err = spy.communicate(timeout=args.seconds + 60)
        if spy.returncode != 0 or not raw.exists():
            raise SystemExit(f"py-spy failed ({spy.returncode}): {err.decode(errors='replace')[-2000:]}")
    text = raw.read_text()
    if args.collapsed:
        args.collapsed.parent.mkdir(parents=True, exist_ok=True)
        args.collapsed.write_text(text)
    summary = summarize(parse_collapsed(text), args.top)
    load.pop("latencies_ms", None)
    requests = load["ok"] or 1
    threads = {name: (after[name] - before.get(name, 0.0)) * 1000 / requests for name in after}
    return {"machine": machine_description(), "args": {k: str(v) for k, v in vars(args).items()},
            "load": load, "thread_cpu_ms_per_request": dict(sorted(threads.items(), key=lambda kv: -kv[1])),
            **summary}


def report(result: dict[str, Any]) -> None:
    load = result["load"]
    print(f"load: {load['ok']} OK requests at {load['achieved_rps']:.1f} req/s; {result['samples']} samples")
    threads = result["thread_cpu_ms_per_request"]
    total = sum(threads.values())
    print_table("ext_proc CPU during the load, by thread (/proc, not sampled)", ["thread", "CPU ms/request"],
                [*threads.items(), ("all", total)])
    print_table("Areas (self time, share of active samples)", ["area", "share"], result["areas"])
    main_ms = threads.get("main", float("nan"))
    print_table(f"Main thread (event loop) areas: share of its {result['main_thread_samples']} samples, and CPU ms/request "
                "(share x the main thread's CPU)", ["area", "share", "CPU ms/request"],
                [(name, share, share * main_ms) for name, share in result["main_thread_areas"]])
    print_table("Top functions by self time", ["function", "share"], result["self"])
    print_table("Top functions by inclusive time", ["function", "share"], result["inclusive"])
    print()
    print_figure("profile_samples", result["samples"])
    print_figure("extproc_cpu_ms_per_request", total)
    print_figure("requests_per_extproc_core_s", 1000 / total if total > 0 else float("nan"))
    for name, share in result["areas"]:
        print_figure(f"area_share:{name.replace(' ', '_')}", share)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=300.0, help="requests/s during the profile")
    parser.add_argument("--seconds", type=float, default=20.0, help="profile duration (s)")
    parser.add_argument("--sample-rate", type=int, default=200, help="py-spy samples per second")
    parser.add_argument("--native", action="store_true", help="also sample native (C/Cython) frames")
    parser.add_argument("--top", type=int, default=25, help="functions listed")
    parser.add_argument("--collapsed", type=Path, help="keep py-spy's collapsed stacks here")
    parser.add_argument("--tiny", action="store_true", help="a few seconds (for the smoke test)")
    parser.add_argument("--json", type=Path, help="write the summary here")
    args = parser.parse_args(argv)
    if args.tiny:
        args.rate, args.seconds, args.top = 50.0, 2.0, 10
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="iris-bench-profile-") as tmp:
        result = measure(args, Path(tmp))
    result["load_average_before"] = load_before
    print(f"machine: {result['machine']}; 1-min load average before {load_before}, after "
          f"{result['machine']['load_average_1min']}")
    report(result)
    write_json(args.json, result)


if __name__ == "__main__":
    main()
