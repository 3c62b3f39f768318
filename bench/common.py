"""What the benchmarks share: load loops, percentiles, process CPU time, Redis command counts,
Envoy configurations without ext_proc, simulated providers, and printing.

Units: times in seconds unless a name ends in `_ms` (milliseconds) or `_us` (microseconds); rates
in requests per second. Every load loop is bounded by a request count and a time limit, and only
ever targets 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from irislab import envoy_config
from irislab.local_gateway import ProviderSimulation, simulator_argv
from irislab.processes import ManagedProcess, envoy_binary, free_port, spawn, wait_for_port

REPO_ROOT = Path(__file__).resolve().parent.parent
LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
PERCENTILES = (50, 90, 99)


def default_trace_path() -> Path:
    """The Mooncake conversation trace beside the repository (`<repo>/../shared/data/...`)."""
    return REPO_ROOT.parent / "shared" / "data" / "mooncake" / "conversation_trace.jsonl"


def check_local(url: str) -> str:
    """Return `url` if it targets this machine's loopback; raise ValueError otherwise."""
    host = urlsplit(url).hostname
    if host not in LOCAL_HOSTS:
        raise ValueError(f"benchmarks only send load to 127.0.0.1, not to {host!r}")
    return url


# ---------------------------------------------------------------------------------------------
# Percentiles
# ---------------------------------------------------------------------------------------------


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """The p-th percentile (0..100) of already sorted values, linearly interpolated; NaN if empty."""
    if not sorted_values:
        return math.nan
    rank = (len(sorted_values) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low)


def summarize_ms(values_ms: Sequence[float]) -> dict[str, float]:
    """p50/p90/p99, mean and max of latencies given in milliseconds (keys `p50_ms`, ...)."""
    ordered = sorted(values_ms)
    out = {f"p{p}_ms": percentile(ordered, p) for p in PERCENTILES}
    out["mean_ms"] = sum(ordered) / len(ordered) if ordered else math.nan
    out["max_ms"] = ordered[-1] if ordered else math.nan
    return out


# ---------------------------------------------------------------------------------------------
# Load loops
# ---------------------------------------------------------------------------------------------


@dataclass
class Sample:
    """One request as the load generator saw it. Times in seconds since the run started:
    `scheduled` (when it was due), `sent`, `headers` (response headers received), `first`
    (first body byte), `done` (body complete or failure). `status` 0 means no HTTP answer."""

    index: int
    scheduled: float
    sent: float = math.nan
    headers: float = math.nan
    first: float = math.nan
    done: float = math.nan
    status: int = 0
    error: str = ""
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def latency_ms(self) -> float:
        return (self.done - self.sent) * 1000

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300 and not self.error


Send = Callable[[Sample, float], Awaitable[None]]
"""Fills a Sample by sending its request; the float is the run's start on the loop clock."""


async def open_loop(offsets: Sequence[float], send: Send, max_seconds: float) -> list[Sample]:
    """Send request i at `offsets[i]` seconds after the start, whatever the answers do (open
    loop). Requests due after `max_seconds` are not sent; requests still running `max_seconds`
    + 30 s after the start are cancelled and count as errors. Returns the samples sent."""
    loop = asyncio.get_running_loop()
    start = loop.time() + 0.05
    tasks: list[asyncio.Task] = []
    samples: list[Sample] = []
    for index, offset in enumerate(offsets):
        if offset > max_seconds:
            break
        delay = start + offset - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        sample = Sample(index, offset)
        samples.append(sample)
        tasks.append(asyncio.create_task(send(sample, start)))
    await _finish(tasks, samples, start + max_seconds + 30 - loop.time())
    return samples


async def closed_loop(concurrency: int, send: Send, max_seconds: float, max_requests: int) -> list[Sample]:
    """`concurrency` workers each send their next request as soon as the previous one answered,
    until `max_seconds` have passed or `max_requests` were sent (saturation)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    samples: list[Sample] = []

    async def worker() -> None:
        while loop.time() - start < max_seconds and len(samples) < max_requests:
            sample = Sample(len(samples), loop.time() - start)
            samples.append(sample)
            await send(sample, start)

    tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
    await _finish(tasks, samples, max_seconds + 30)
    return samples


async def _finish(tasks: list[asyncio.Task], samples: list[Sample], timeout: float) -> None:
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, timeout=max(timeout, 1.0))
    for task in pending:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for sample in samples:
        if math.isnan(sample.done):
            sample.error = sample.error or "cancelled at the time limit"


def fixed_rate_offsets(rate: float, count: int) -> list[float]:
    """Offsets (s) of `count` requests at `rate` requests per second."""
    return [i / rate for i in range(count)]


def load_summary(samples: list[Sample], wall_seconds: float) -> dict[str, Any]:
    """Counts, statuses, achieved rate (completed OK per second of wall time), latency summary
    of the OK requests (ms), and how late the generator sent (ms)."""
    ok = [s for s in samples if s.ok]
    statuses: dict[str, int] = {}
    for s in samples:
        key = str(s.status) if not s.error else f"error:{s.error[:40]}"
        statuses[key] = statuses.get(key, 0) + 1
    lateness = sorted((s.sent - s.scheduled) * 1000 for s in samples if not math.isnan(s.sent))
    return {
        "sent": len(samples),
        "ok": len(ok),
        "errors": len(samples) - len(ok),
        "statuses": statuses,
        "wall_s": wall_seconds,
        "achieved_rps": len(ok) / wall_seconds if wall_seconds > 0 else math.nan,
        **summarize_ms([s.latency_ms for s in ok]),
        "send_lag_p99_ms": percentile(lateness, 99),
    }


# ---------------------------------------------------------------------------------------------
# Process CPU time and Redis command statistics
# ---------------------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU time (s) of process `pid`, all threads, from /proc/<pid>/stat."""
    return stat_cpu_seconds(Path(f"/proc/{pid}/stat"))


def machine_busy_seconds() -> float:
    """CPU time (s) every core of this machine spent not idle since boot (/proc/stat's `cpu`
    line: all but idle and iowait)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def stat_cpu_seconds(stat: Path) -> float:
    """User + system CPU time (s) in a /proc stat file (a process's, or a thread's
    /proc/<pid>/task/<tid>/stat)."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    # fields[0] is field 3 (state); utime and stime are fields 14 and 15.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def command_stats(client) -> dict[str, dict[str, float]]:
    """`INFO commandstats` of a sync redis client: command -> {calls, usec, usec_per_call}."""
    info = client.info("commandstats")
    out = {}
    for key, value in info.items():
        name = key.removeprefix("cmdstat_")
        out[name] = {"calls": int(value["calls"]), "usec": int(value["usec"]),
                     "usec_per_call": float(value["usec_per_call"])}
    return out


def command_delta(before: dict, after: dict, ignore: Sequence[str] = ("info", "slowlog", "config")) -> dict[str, dict]:
    """Per command: calls and usec between two `command_stats` snapshots, and usec per call."""
    out = {}
    for name, now in after.items():
        if name in ignore or name.startswith(tuple(f"{i}|" for i in ignore)):
            continue
        then = before.get(name, {"calls": 0, "usec": 0})
        calls = now["calls"] - then["calls"]
        if calls > 0:
            usec = now["usec"] - then["usec"]
            out[name] = {"calls": calls, "usec": usec, "usec_per_call": usec / calls}
    return out


# ---------------------------------------------------------------------------------------------
# Processes: simulated providers and Envoy without ext_proc
# ---------------------------------------------------------------------------------------------


def start_simulator(name: str, sim: ProviderSimulation, work_dir: Path) -> ManagedProcess:
    """A simulated provider on a free 127.0.0.1 port (the same command LocalGateway runs)."""
    port = free_port()
    process = spawn(f"provider-{name}", simulator_argv(name, port, sim), work_dir)
    process.port = port
    wait_for_port(port, process=process.popen)
    return process


def plain_envoy_bootstrap(
    listener_port: int,
    admin_port: int,
    cluster_ports: dict[str, int],
    target_cluster: str,
    extra_clusters: list[dict[str, Any]] | None = None,
    hash_header: str | None = None,
) -> dict[str, Any]:
    """envoy/envoy.yaml without the ext_proc filter, its catch-all route sending everything to
    `target_cluster` (a cluster of the file or of `extra_clusters`), optionally hashing on the
    request header `hash_header` (for a ring_hash cluster). Everything else (listener, access
    log, buffer limits, local replies) stays as in the file, so only the router differs."""
    bootstrap = envoy_config.render(listener_port, admin_port, cluster_ports, extra_clusters=extra_clusters)
    manager = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    manager["http_filters"] = [f for f in manager["http_filters"] if f["name"] != "envoy.filters.http.ext_proc"]
    routes = manager["route_config"]["virtual_hosts"][0]["routes"]
    catch_all = routes[-1]
    catch_all.pop("direct_response", None)
    catch_all.pop("response_headers_to_add", None)
    catch_all["route"] = {"cluster": target_cluster, "timeout": "0s"}
    if hash_header:
        catch_all["route"]["hash_policy"] = [{"header": {"header_name": hash_header}}]
    return bootstrap


def pool_cluster(name: str, ports: Sequence[int], lb_policy: str) -> dict[str, Any]:
    """A static cluster over 127.0.0.1:`ports` with Envoy's `lb_policy` (ROUND_ROBIN,
    LEAST_REQUEST, RING_HASH, ...), shaped like the provider clusters of envoy/envoy.yaml."""
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "2s",
        "lb_policy": lb_policy,
        "per_connection_buffer_limit_bytes": 33554432,
        # As envoy/envoy.yaml's own providers' clusters: one request per connection (llama.cpp's
        # server closes a connection after a streamed answer: docs/operations.md "Upstream connections").
        "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "common_http_protocol_options": {"idle_timeout": "4s", "max_requests_per_connection": 1},
            "explicit_http_config": {"http_protocol_options": {}}}},
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}
                for port in ports
            ]}],
        },
    }


def start_envoy(bootstrap: dict[str, Any], work_dir: Path, name: str) -> ManagedProcess:
    """Envoy (one worker thread, as LocalGateway runs it) with `bootstrap`; returns when its
    listener accepts connections. `.port` is the listener port."""
    path = envoy_config.write(bootstrap, work_dir / f"{name}.yaml")
    process = spawn(
        name,
        [envoy_binary(), "-c", str(path), "-l", "warning", "--concurrency", "1", "--disable-hot-restart"],
        work_dir,
    )
    process.port = bootstrap["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"]
    wait_for_port(process.port, process=process.popen)
    return process


def wait_http_ready(url: str, timeout_seconds: float = 20.0) -> None:
    """Poll `url` (GET) until it answers at all, for Envoy's first route to its upstream."""
    import httpx

    deadline = time.monotonic() + timeout_seconds
    while True:
        try:
            httpx.get(check_local(url), timeout=1.0)
            return
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------


def fmt(value: Any) -> str:
    """A table cell: floats with 2 decimals (3 below 1), NaN as '-'."""
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.3f}" if abs(value) < 1 else f"{value:.2f}"
    return str(value)


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Print a Markdown table with a title line."""
    print(f"\n### {title}\n")
    print("| " + " | ".join(headers) + " |")
    print("|" + "|".join("---" for _ in headers) + "|")
    for row in rows:
        print("| " + " | ".join(fmt(v) for v in row) + " |")
    sys.stdout.flush()


def print_figure(name: str, value: Any) -> None:
    """One figure on its own line, `FIGURE name value`, for people and for the smoke test."""
    print(f"FIGURE {name} {fmt(value)}")
    sys.stdout.flush()


def write_json(path: Path | None, data: Any) -> None:
    """Write `data` as JSON to `path` (NaN written as null), creating folders; no-op if None."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_clean(data), indent=1, sort_keys=True))


def _clean(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if hasattr(value, "__dataclass_fields__"):
        return _clean(asdict(value))
    return value


def load_average() -> float:
    """The machine's 1-minute load average (runnable processes; 2 cores here)."""
    return float(Path("/proc/loadavg").read_text().split()[0])


def machine_description() -> dict[str, Any]:
    """nproc, memory (GiB), CPU model of this machine, and its 1-minute load average now."""
    model = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    mem_kib = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            mem_kib = int(line.split()[1])
    return {"nproc": os.cpu_count(), "memory_gib": round(mem_kib / 1024 / 1024, 1), "cpu_model": model,
            "load_average_1min": load_average()}


# ---------------------------------------------------------------------------------------------
# The gateway configuration of the overhead, cost and profile runs, and running the load generator
# ---------------------------------------------------------------------------------------------

MODEL = "llama-3.1-70b"


USER_IDENTITY_HEADER = "x-user-id"


def roomy_config(
    pin_timeout_seconds: float = 3600,
    lease_timeout_seconds: float = 30,
    grace_seconds: float = 60,
    expose_routing_headers: bool = False,
    metrics_listen: str | None = None,
) -> dict[str, Any]:
    """The example's three providers (two own, one third party) for MODEL, with limits so high
    they never bind: every request takes the full admission path (pin, lease, release) on the
    first own provider, so the figures are the router's cost, not a capacity effect."""
    limits = {
        "max_pinned_sessions": 10_000_000,
        "max_global_in_flight_request_slots": 1_000_000,
        "global_in_flight_request_slots_reserved_for_pinned_sessions": 10,
        "max_per_session_in_flight_request_slots": 1_000_000,
    }
    return {
        "pin_inactivity_timeout_seconds": pin_timeout_seconds,
        "lease_timeout_seconds": lease_timeout_seconds,
        "redis": {"key_prefix": "bench", "housekeeping_grace_seconds": grace_seconds},
        # The load generators stand in for an authenticating filter: x-user-id is the identity.
        "session": {"trusted_identity_headers": [USER_IDENTITY_HEADER]},
        "server": {"expose_routing_headers": expose_routing_headers, "metrics_listen": metrics_listen},
        "providers": [
            {"name": "iris-1", "kind": "managed", "cluster": "iris-1",
             "models": {MODEL: {"features": ["chat", "completions"], "limits": limits}}},
            {"name": "iris-2", "kind": "managed", "cluster": "iris-2",
             "models": {MODEL: {"features": ["chat", "completions"], "limits": limits}}},
            {"name": "tensorx", "kind": "unlimited", "cluster": "tensorx",
             "models": {MODEL: {"features": ["chat", "completions"]}}},
        ],
    }


ZERO_DELAY = ProviderSimulation(ttft_ms=0, per_token_ms=0, block_tokens=512, cache_blocks=4096)


def decision_totals(metrics_url: str) -> tuple[float, int]:
    """(sum of seconds, count) of the ext_proc server's `iris_decision_duration_seconds` histogram: the
    time from a parsed request body to its routing decision, Redis round trips included."""
    import httpx

    total, count = 0.0, 0
    for line in httpx.get(check_local(metrics_url), timeout=5).text.splitlines():
        if line.startswith("iris_decision_duration_seconds_sum"):
            total = float(line.split()[-1])
        elif line.startswith("iris_decision_duration_seconds_count"):
            count = int(float(line.split()[-1]))
    return total, count


def run_loadgen(url: str, out: Path, *args: str, max_seconds: float) -> dict[str, Any]:
    """Run `python -m bench.loadgen` in its own process against `url` (127.0.0.1 only) and return
    its JSON result. `args` are further loadgen flags; `max_seconds` bounds its sending."""
    import subprocess

    argv = [sys.executable, "-m", "bench.loadgen", "--url", check_local(url), "--out", str(out),
            "--max-seconds", str(max_seconds), *args]
    subprocess.run(argv, check=True, timeout=max_seconds + 90)
    return json.loads(out.read_text())
