"""Cost per request: Redis round trips and script time, ext_proc CPU, at two sizes of state.

For each `--pins` size (default 1,000 and 100,000 pinned sessions), the routing state is emptied
and pre-loaded through the routing scripts (`RoutingState` calls, many at once): that many
sessions pinned to the first own provider, then `--leases` live request leases (default 10,000)
on those pins. Pin and lease timeouts are long (hours), so everything stays live and no lease is
renewed during a run. Then the load generator (its own process) sends short chat requests at
`--rate` requests/s through the full gateway, in two phases:

* `pinned`: users whose sessions were pre-loaded (the hot path calls get_pin_and_admit, which
  finds the pin and admits on it, then release);
* `new`: a new user, so a new session and pin, every request (get_pin_and_admit, which finds no
  pin and pins the session to the first own provider, then release).

Around each phase it reads `INFO commandstats` (calls and server time of every command, those run
inside scripts included) and /proc/<pid>/stat CPU time of ext_proc, Envoy, Redis and the upstream.
Then `--trace-requests` more requests of the same kind run with the slow log at a 0 us threshold,
which logs every command with its client (a script's own commands carry the client address `?:0`,
a script call names its script by SHA): the client round trips per request, by script name or
command, background ones (instance heartbeat, degraded-flag refresh) included. After the pinned
phase, `--script-calls` calls of each routing-state script (`extproc.state.SCRIPT_NAMES`, the fused
get_pin_and_admit in both its branches) also run alone, one at a time, with `INFO commandstats`
reset before each: the server time per call of that script without CPU contention from the
gateway, and the client's round trip.

Prints per size and phase: client round trips per request (in all, by script and by command),
script calls per request, Redis commands executed per request, EVALSHA server time per call under
load (us), CPU per request (ms) of each process and the requests/s one ext_proc core sustains;
then per script and size the server time per call alone (us).

    python -m bench.cost --pins 1000,100000 --leases 10000 --rate 200 --requests 3000 --json out/cost.json
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import redis

from bench.common import (
    MODEL,
    ZERO_DELAY,
    command_delta,
    command_stats,
    cpu_seconds,
    load_average,
    machine_description,
    percentile,
    print_figure,
    print_table,
    roomy_config,
    run_loadgen,
    write_json,
)
from bench.loadgen import request_body, user_name
from extproc.config import IdentitySource, parse_config
from extproc.openai_api.request import parse_request, session_id
from extproc.routing.state import SCRIPT_NAMES, Lease, RoutingState, connect, new_id, script_source
from irislab.local_gateway import LocalGateway

HOURS = 10 * 3600
PRELOAD_BATCH = 512
ADMIN_COMMANDS = ("info", "slowlog", "config", "flushall", "dbsize", "ping")
PHASES = ("pinned", "new")


def session_ids(secret: str, users: list[str], completions_prefix_chars: int) -> list[str]:
    """The session ids the gateway derives for `users` sending `bench.loadgen.request_body`."""
    parsed = parse_request("chat", request_body(MODEL), completions_prefix_chars)
    return [session_id(secret.encode(), f"{IdentitySource.TRUSTED_HEADER.value}:{user}", parsed) for user in users]


async def preload(redis_url: str, config_data: dict, sessions: list[str], leases: int) -> float:
    """Pin every session to iris-1 (admit then release, refreshing the pin), then hold `leases`
    live leases spread over those pins (never released). Returns the seconds it took."""
    started = time.monotonic()
    client = connect(redis_url, timeout_seconds=30, max_connections=32)
    state = RoutingState(client, parse_config(config_data))
    try:
        await state.load_scripts()
        for at in range(0, len(sessions), PRELOAD_BATCH):
            batch = sessions[at : at + PRELOAD_BATCH]
            admissions = await asyncio.gather(
                *(state.try_admit_unpinned_session_request("iris-1", MODEL, sid) for sid in batch))
            await asyncio.gather(*(state.release_request_lease(a.lease, refresh_pin=True) for a in admissions))
        for at in range(0, leases, PRELOAD_BATCH):
            count = min(PRELOAD_BATCH, leases - at)
            await asyncio.gather(*(state.try_admit_pinned_session_request(MODEL, sessions[(at + i) % len(sessions)])
                                   for i in range(count)))
    finally:
        await client.aclose()
    return time.monotonic() - started


def live_counts(client: redis.Redis) -> dict[str, int]:
    """Live pins and leases of iris-1 (ZCOUNT over deadlines after Redis TIME)."""
    seconds, micros = client.time()
    now = seconds * 1000 + micros // 1000
    tag = "{bench:" + MODEL + "}"
    return {"pins": client.zcount(f"{tag}:pins:iris-1", f"({now}", "+inf"),
            "leases": client.zcount(f"{tag}:leases:iris-1", f"({now}", "+inf")}


def clear_routing_state(client: redis.Redis) -> None:
    """Delete every key but the epoch: an empty routing state that the running instance does not
    take for a Redis that lost its state (a FLUSHALL would start the epoch grace, during which
    managed pairs admit nothing: docs/routing-state.md "When Redis is gone")."""
    doomed = [key for key in client.keys("*") if not key.endswith(b":epoch")]
    if doomed:
        client.delete(*doomed)


def script_names_by_sha() -> dict[str, str]:
    """Script name of each routing-state script's SHA1 (what EVALSHA names it by)."""
    return {hashlib.sha1(script_source(name).encode()).hexdigest(): name for name in SCRIPT_NAMES}


def phase_users(phase: str, pins: int, prefix: str = "new-", offset: int = 0) -> list[str]:
    """Load generator flags: the pre-loaded users (pinned), or a new user per request (new)."""
    if phase == "pinned":
        return ["--users", str(pins)]
    return ["--new-users", "--user-prefix", prefix, "--user-offset", str(pins * 10 + offset)]


def measure_phase(gateway: LocalGateway, client: redis.Redis, args, work: Path, phase: str, pins: int) -> dict:
    """One load phase with every counter read before and after: script calls, Redis commands
    (those scripts run included) and CPU per request."""
    pids = {"extproc": gateway.running[0].extproc.pid, "envoy": gateway.running[0].envoy.pid,
            "redis": gateway.redis.pid, "upstream": gateway.providers["iris-1"].pid}
    stats_before = command_stats(client)
    cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    load = run_loadgen(gateway.url, work / f"cost-{pins}-{phase}.json", "--rate", str(args.rate),
                       "--requests", str(args.requests), "--model", MODEL, *phase_users(phase, pins),
                       max_seconds=args.requests / args.rate + 5)
    time.sleep(0.2)  # releases run after the response: let the last ones land
    cpu_after = {name: cpu_seconds(pid) for name, pid in pids.items()}
    stats_after = command_stats(client)
    requests = load["ok"] or 1
    commands = command_delta(stats_before, stats_after, ignore=ADMIN_COMMANDS)
    script_calls = sum(v["calls"] for k, v in commands.items() if k in ("evalsha", "eval"))
    return {
        "phase": phase,
        "pins": pins,
        "load": {k: v for k, v in load.items() if k != "latencies_ms"},
        "requests": load["ok"],
        "script_calls_per_request": script_calls / requests,
        "redis_commands_per_request": sum(v["calls"] for v in commands.values()) / requests,
        "evalsha_usec_per_call": commands.get("evalsha", {}).get("usec_per_call", float("nan")),
        "commandstats": commands,
        "cpu_ms_per_request": {name: (cpu_after[name] - cpu_before[name]) * 1000 / requests for name in pids},
        "live_after": live_counts(client),
    }


def trace_phase(gateway: LocalGateway, client: redis.Redis, args, work: Path, phase: str, pins: int) -> dict:
    """`--trace-requests` requests of the phase's kind with the slow log at 0 us, which logs every
    command with its client (a script's own commands carry the address `?:0`): the client round
    trips per request, by kind, and the scripts called per request, by name. A round trip is a
    command a client sent, except that a MULTI ... EXEC transaction (the instance heartbeat) is
    one: Redis logs MULTI, then the queued commands together when EXEC runs them, never EXEC
    itself, so the commands of MULTI's client logged right after it (before any other client's,
    a script call or another MULTI) are its queued ones. The ext_proc server pipelines nothing
    else (its degraded-flag refresh is one MGET)."""
    config = client.config_get("slowlog-*")
    client.config_set("slowlog-max-len", 1_000_000)
    client.config_set("slowlog-log-slower-than", 0)
    client.slowlog_reset()
    began = time.monotonic()
    try:
        load = run_loadgen(gateway.url, work / f"trace-{pins}-{phase}.json", "--rate", str(args.rate),
                           "--requests", str(args.trace_requests), "--model", MODEL,
                           *phase_users(phase, pins, prefix="trace-", offset=args.requests),
                           max_seconds=args.trace_requests / args.rate + 5)
        time.sleep(0.2)  # the last releases
    finally:
        client.config_set("slowlog-log-slower-than", config["slowlog-log-slower-than"])
    seconds = time.monotonic() - began
    entries = client.slowlog_get(client.slowlog_len())
    client.slowlog_reset()
    client.config_set("slowlog-max-len", config["slowlog-max-len"])
    by_sha = script_names_by_sha()
    trips: Counter[str] = Counter()
    transaction: bytes | None = None  # the client whose MULTI block is being logged
    for entry in reversed(entries):  # oldest first
        address = entry["client_address"]
        words = entry["command"].split()
        name = words[0].decode().lower()
        if address == transaction and name not in ("multi", "evalsha", "eval"):
            continue  # queued in the transaction: run by its EXEC, the same round trip
        transaction = None
        if address == b"?:0" or name in ADMIN_COMMANDS:
            continue  # a script's own command, or this benchmark's
        if name == "multi":
            transaction = address
            trips["multi/exec"] += 1
        elif name == "evalsha" and len(words) > 1:
            trips[by_sha.get(words[1].decode(), "other script")] += 1
        else:
            trips[name] += 1
    requests = load["ok"] or 1
    scripts = {k: v / requests for k, v in sorted(trips.items()) if k in SCRIPT_NAMES or k == "other script"}
    background = sum(v for k, v in trips.items() if k not in scripts)
    return {"requests": load["ok"], "seconds": seconds, "background_round_trips_per_second": background / seconds,
            "round_trips_per_request": sum(trips.values()) / requests,
            "round_trips_by_kind": {k: v / requests for k, v in sorted(trips.items())},
            "scripts_per_request": scripts}


async def _time_scripts(
    redis_url: str, config_data: dict, sessions: list[str], fresh: list[str], client: redis.Redis
) -> dict:
    """Every routing-state script `len(sessions)` times in a row, one call at a time: server time
    per call (us, INFO commandstats of EVALSHA, reset before each) and the client's round trip
    (us). The fused get_pin_and_admit runs in both branches: on the pre-loaded pins (`sessions`)
    and pinning `fresh` sessions; `release` releases the first, `release_new_pin` the second.
    Leases the timed calls leave are released (untimed), so the state grows only by the pins of
    `fresh` and of as many more new sessions."""
    aclient = connect(redis_url, timeout_seconds=30, max_connections=4)
    state = RoutingState(aclient, parse_config(config_data))
    out: dict[str, dict] = {}
    eligible = ["iris-1", "iris-2", "tensorx"]

    async def timed(name: str, calls) -> list:
        client.config_resetstat()
        rtts, results = [], []
        for call in calls:
            began = time.perf_counter()
            results.append(await call())
            rtts.append((time.perf_counter() - began) * 1e6)
        stat = client.info("commandstats").get("cmdstat_evalsha", {})
        rtts.sort()
        out[name] = {"calls": len(rtts), "server_us_per_call": float(stat.get("usec_per_call", "nan")),
                     "rtt_p50_us": percentile(rtts, 50), "rtt_p99_us": percentile(rtts, 99)}
        return results

    async def release(leases: list[Lease], name: str | None = None) -> None:
        calls = [lambda lease=lease: state.release_request_lease(lease, refresh_pin=lease.pin_id is not None)
                 for lease in leases]
        if name:
            await timed(name, calls)
        else:
            for call in calls:
                await call()

    try:
        await state.load_scripts()
        await timed("get_pin", [lambda sid=sid: state.get_pin(MODEL, sid) for sid in sessions])
        fused = await timed("get_pin_and_admit/pinned", [
            lambda sid=sid: state.get_pin_and_try_admit(MODEL, sid, eligible) for sid in sessions])
        leases = [admission.lease for _, admission in fused]
        await timed("renew", [lambda lease=lease: state.renew_request_lease(lease) for lease in leases])
        await release(leases, "release")
        admissions = await timed("admit_pinned", [lambda sid=sid: state.try_admit_pinned_session_request(MODEL, sid)
                                                  for sid in sessions])
        await release([a.lease for a in admissions])
        fused = await timed("get_pin_and_admit/new_pin", [
            lambda sid=sid: state.get_pin_and_try_admit(MODEL, sid, eligible) for sid in fresh])
        await release([admission.lease for _, admission in fused], "release_new_pin")
        pins = [admission.pin for _, admission in fused]
        repins = await timed("cas_repin", [
            lambda sid=sid, pin=pin: state.try_compare_and_swap_pin_and_admit_request(pin, MODEL, sid, "iris-2")
            for sid, pin in zip(fresh, pins)])
        await release([r.admission.lease for r in repins])
        admissions = await timed("admit_unpinned", [
            lambda sid=sid: state.try_admit_unpinned_session_request("iris-1", MODEL, sid + "-u") for sid in fresh])
        await release([a.lease for a in admissions])
        admissions = await timed("admit_without_pin", [
            lambda: state.try_admit_request_without_pin("iris-1", MODEL) for _ in sessions])
        await release([a.lease for a in admissions])
        adopted = [Lease(MODEL, "iris-1", new_id(), None, None, 0) for _ in sessions]
        await timed("adopt", [lambda lease=lease: state.adopt_request_lease(lease) for lease in adopted])
        await release(adopted)
    finally:
        await aclient.aclose()
    return out


def measure_scripts_alone(
    client: redis.Redis, redis_url: str, config_data: dict, sessions: list[str], calls: int
) -> dict:
    """Server time per script call with no other load on Redis, per script (see `_time_scripts`)."""
    picked = [sessions[(i * 7919) % len(sessions)] for i in range(calls)]
    fresh = [f"alone-{len(sessions)}-{i}" for i in range(calls)]
    return asyncio.run(_time_scripts(redis_url, config_data, picked, fresh, client))


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    config_data = roomy_config(pin_timeout_seconds=HOURS, lease_timeout_seconds=HOURS, grace_seconds=HOURS)
    sims = {name: ZERO_DELAY for name in ("iris-1", "iris-2", "tensorx")}
    runs = []
    alone: dict[int, dict] = {}
    with LocalGateway(config_data=config_data, simulations=sims, work_dir=work / "gateway") as gateway:
        client = redis.Redis.from_url(gateway.redis_url)
        prefix_chars = gateway.config.session.completions_prefix_chars
        for pins in args.pins:
            clear_routing_state(client)
            users = [user_name("user-", i) for i in range(pins)]
            sessions = session_ids(gateway.secret, users, prefix_chars)
            seconds = asyncio.run(preload(gateway.redis_url, config_data, sessions, args.leases))
            loaded = live_counts(client)
            print(f"pre-loaded {loaded['pins']} pins and {loaded['leases']} live leases in {seconds:.1f} s", flush=True)
            # warm-up: connections and code paths, from the pre-loaded users
            run_loadgen(gateway.url, work / "warmup.json", "--rate", "100", "--requests", str(args.warmup_requests),
                        "--users", str(pins), "--model", MODEL, max_seconds=10)
            for phase in PHASES:  # pinned first: the new phase and the script timing add pins
                run = measure_phase(gateway, client, args, work, phase, pins)
                run["trace"] = trace_phase(gateway, client, args, work, phase, pins)
                run["preloaded"] = loaded
                run["preload_seconds"] = seconds
                runs.append(run)
                if phase == "pinned":
                    alone[pins] = measure_scripts_alone(client, gateway.redis_url, config_data, sessions,
                                                        args.script_calls)
        client.close()
    return {"machine": machine_description(), "args": vars(args) | {"json": str(args.json)}, "runs": runs,
            "scripts_alone": alone}


def figures(result: dict[str, Any]) -> dict[str, float]:
    """Headline figures per size and phase: round trips, script calls (in all and by script) and
    CPU per request; per size and script, its server time alone."""
    out: dict[str, float] = {}
    for run in result["runs"]:
        key = f"{run['phase']}@{run['pins']}"
        out[f"round_trips_per_request@{key}"] = run["trace"]["round_trips_per_request"]
        out[f"script_calls_per_request@{key}"] = run["script_calls_per_request"]
        for script, calls in run["trace"]["scripts_per_request"].items():
            out[f"script_calls_per_request@{key}:{script}"] = calls
        out[f"redis_commands_per_request@{key}"] = run["redis_commands_per_request"]
        out[f"evalsha_usec_per_call@{key}"] = run["evalsha_usec_per_call"]
        cpu = run["cpu_ms_per_request"]["extproc"]
        out[f"extproc_cpu_ms_per_request@{key}"] = cpu
        out[f"requests_per_extproc_core_s@{key}"] = 1000 / cpu if cpu > 0 else float("nan")
    for pins, scripts in result["scripts_alone"].items():
        for script, s in scripts.items():
            out[f"script_server_us_per_call@{pins}:{script}"] = s["server_us_per_call"]
    return out


def report(result: dict[str, Any]) -> None:
    rows = []
    for run in result["runs"]:
        cpu = run["cpu_ms_per_request"]
        rows.append([run["pins"], run["phase"], run["live_after"]["pins"], run["requests"],
                     run["trace"]["round_trips_per_request"],
                     run["script_calls_per_request"], run["redis_commands_per_request"], run["evalsha_usec_per_call"],
                     cpu["extproc"], 1000 / cpu["extproc"] if cpu["extproc"] > 0 else float("nan"),
                     cpu["envoy"], cpu["redis"], cpu["upstream"]])
    print_table("Cost per request (CPU in ms per request)",
                ["pins pre-loaded", "phase", "live pins after", "requests", "round trips/req (traced)", "script calls/req",
                 "redis cmds/req",
                 "evalsha us/call", "ext_proc CPU", "req/s per ext_proc core", "Envoy CPU", "Redis CPU",
                 "upstream CPU"], rows)
    rows = [[run["pins"], run["phase"], run["trace"]["requests"], run["trace"]["round_trips_per_request"],
             ", ".join(f"{k} {v:.3f}" for k, v in run["trace"]["round_trips_by_kind"].items()),
             run["trace"]["background_round_trips_per_second"]]
            for run in result["runs"]]
    print_table("Client round trips per request, by script or command (slow-log trace of the phase's requests)",
                ["pins", "phase", "traced requests", "round trips/req", "by kind", "non-script round trips/s"], rows)
    rows = [[pins, script, s["calls"], s["server_us_per_call"], s["rtt_p50_us"], s["rtt_p99_us"]]
            for pins, scripts in result["scripts_alone"].items() for script, s in scripts.items()]
    print_table("Script server time, scripts alone, one call at a time (us)",
                ["pins", "script", "calls", "server us/call", "client RTT p50", "client RTT p99"], rows)
    print()
    for name, value in figures(result).items():
        print_figure(name, value)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pins", default="1000,100000", help="comma-separated numbers of pinned sessions")
    parser.add_argument("--leases", type=int, default=10_000, help="live leases pre-loaded")
    parser.add_argument("--rate", type=float, default=200.0, help="requests/s of each phase")
    parser.add_argument("--requests", type=int, default=3000, help="requests per phase")
    parser.add_argument("--warmup-requests", type=int, default=200)
    parser.add_argument("--script-calls", type=int, default=2000,
                        help="requests' worth of script calls timed with no other load, per kind")
    parser.add_argument("--trace-requests", type=int, default=400,
                        help="requests per phase traced in the slow log (round trips by script and command)")
    parser.add_argument("--tiny", action="store_true", help="a few seconds in all (for the smoke test)")
    parser.add_argument("--json", type=Path, help="write the full result here")
    args = parser.parse_args(argv)
    args.pins = [int(p) for p in args.pins.split(",") if p]
    if args.tiny:
        args.pins, args.leases, args.rate, args.requests, args.warmup_requests = [50, 500], 100, 50.0, 50, 10
        args.script_calls, args.trace_requests = 50, 20
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="iris-bench-cost-") as tmp:
        result = measure(args, Path(tmp))
    result["load_average_before"] = load_before
    print(f"machine: {result['machine']}; 1-min load average before {load_before}, after "
          f"{result['machine']['load_average_1min']}")
    result["figures"] = figures(result)
    report(result)
    write_json(args.json, result)


if __name__ == "__main__":
    main()
