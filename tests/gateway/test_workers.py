"""`iris-extproc serve --workers 2` (issue 13): two worker processes, each with its own instance
id; SIGTERM to the supervisor drains both: the streams running at that moment finish (0
failures), every lease is released, and it exits 0. A SIGTERM or SIGINT while the workers are
still being started (issue 20) stops all of them too. Each worker has its own port, every one an
endpoint of Envoy's `extproc` cluster, so Envoy splits the streams between them on every start
(issue 24; one shared SO_REUSEPORT port split them 99/1, 40/60 and 99/1 over three starts), and a
port already taken stops the start with one line naming it."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import redis
import yaml
from grpc_health.v1 import health_pb2
from prometheus_client.multiprocess import MultiProcessCollector

from extproc.operations.gateway import HEALTH_SERVICES
from irislab.local_gateway import LocalGateway, ProviderSimulation
from irislab.processes import free_port_range, spawn, start_redis
from tests.gateway.test_drain import extproc_hosts, health
from tests.support.fleet import LoadPlan, run_load
from tests.support.gateway import chat_body, gateway_config, live_leases, provider_stats, wait_until


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def decisions_in(path: Path) -> float:
    """The sum of iris_routing_decisions_total in one worker's multiprocess counter file."""
    return sum(
        sample.value
        for metric in MultiProcessCollector.merge([str(path)])
        if metric.name == "iris_routing_decisions"
        for sample in metric.samples
    )


def workers_running(config_path: Path) -> list[int]:
    """The pids of the live (not zombie) worker processes serving `config_path`, whoever their
    parent is now (a worker its supervisor left behind is reparented)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # gone meanwhile
            continue
        if str(config_path).encode() in argv and b"--worker-index" in argv and state != "Z":
            found.append(int(entry.name))
    return found


def test_two_workers_serve_and_drain_on_sigterm(tmp_path):
    sims = {name: ProviderSimulation(ttft_ms=5, per_token_ms=20, block_tokens=8) for name in ("iris-1", "iris-2", "tensorx")}
    gateway = LocalGateway(config_data=gateway_config(), simulations=sims, work_dir=tmp_path, workers=2)
    with gateway:
        client = redis.Redis.from_url(gateway.redis_url)
        supervisor = gateway.running[0].extproc
        workers = children(supervisor.pid)
        assert len(workers) == 2
        # Both bound the one port and registered, each with its own instance id.
        assert wait_until(lambda: client.zcard("{e2e}:instances") == 2, within_seconds=15)
        plan = LoadPlan(requests=12, sessions=12, concurrency=12, stream_share=1.0, abort_share=0.0, max_tokens=150)
        box: dict = {}
        thread = threading.Thread(target=lambda: box.setdefault("result", asyncio.run(run_load([gateway.url], plan))))
        thread.start()
        in_flight = lambda: sum(provider_stats(gateway, n)["in_flight"] for n in ("iris-1", "iris-2", "tensorx"))  # noqa: E731
        assert wait_until(lambda: in_flight() == 12, within_seconds=20)
        os.kill(supervisor.pid, signal.SIGTERM)
        thread.join(timeout=60)
        assert supervisor.popen.wait(timeout=60) == 0
        records = box["result"].records
        assert len(records) == 12
        assert [r for r in records if r.transport_error or r.status != 200] == []
        assert all(not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z" for pid in workers)
        assert live_leases(client) == 0
        assert client.zcard("{e2e}:instances") == 0


def test_a_worker_that_dies_stops_the_set(tmp_path):
    gateway = LocalGateway(config_data=gateway_config(), work_dir=tmp_path, workers=2)
    with gateway:
        supervisor = gateway.running[0].extproc
        workers = children(supervisor.pid)
        assert len(workers) == 2
        os.kill(workers[0], signal.SIGKILL)
        assert supervisor.popen.wait(timeout=60) != 0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and Path(f"/proc/{workers[1]}").exists():
            time.sleep(0.1)
        assert not Path(f"/proc/{workers[1]}").exists()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_during_start_up_stops_every_worker(tmp_path, signum):
    """The signal lands while the supervisor is still starting its 8 workers (as soon as the
    first one is its child): it starts no more, every worker started gets SIGTERM, and the
    supervisor exits once they all have, leaving no worker behind."""
    workers = 8
    redis_server = start_redis(tmp_path / "redis")
    config = gateway_config(
        redis={"url": f"redis://127.0.0.1:{redis_server.port}/0", "key_prefix": "startup"},
        server={"listen": f"127.0.0.1:{free_port_range(workers)}", "drain_delay_seconds": 0, "drain_grace_seconds": 1},
    )
    config_path = tmp_path / "routing.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    argv = [sys.executable, "-m", "extproc.cli", "serve", "--config", str(config_path), "--workers", str(workers)]
    supervisor = spawn("supervisor", argv, tmp_path, env={**os.environ, "IRIS_SESSION_SECRET": secrets.token_hex(32)})
    try:

        def first_children() -> list[int]:
            try:
                return children(supervisor.pid)
            except OSError:  # the supervisor is gone: the assertion below says so
                return [-1]

        started = wait_until(first_children, within_seconds=60, interval_seconds=0.001)
        assert started and started != [-1] and supervisor.alive(), supervisor.log_tail()
        os.kill(supervisor.pid, signum)
        try:
            supervisor.popen.wait(timeout=60)
        except subprocess.TimeoutExpired:
            left = workers_running(config_path)
            pytest.fail(f"the supervisor still runs 60 s after the signal (sent with {len(started)} of {workers} workers started), "
                        f"with {len(left)} workers alive: {left}\n{supervisor.log_tail()}")
        # It exited only once every worker it started had exited: none is left, reparented or not.
        assert workers_running(config_path) == [], supervisor.log_tail()
        assert "Traceback" not in supervisor.log_tail(1_000_000)
    finally:
        for pid in workers_running(config_path):
            os.kill(pid, signal.SIGKILL)
        supervisor.stop(sig=signal.SIGKILL)
        redis_server.stop()


STARTS = 3
REQUESTS = 200
CLIENTS = 8  # client connections at once, spread over Envoy's threads


@pytest.mark.slow
def test_envoy_splits_the_streams_between_the_workers_on_every_start(tmp_path):
    """Behind one Envoy with 2 threads, `serve --workers 2` (`server.workers`) over 3 starts: the
    supervisor logs each worker's port, each worker answers gRPC health on its own port, Envoy
    holds both as healthy endpoints of `extproc`, and on every start each worker decides at
    least a quarter of 200 requests (counted in each worker's own metrics file, summing to
    200). With one shared port, a start gave one worker 99 % (issue 24)."""
    sims = {name: ProviderSimulation(ttft_ms=1, per_token_ms=1) for name in ("iris-1", "iris-2", "tensorx")}
    splits = []
    for start in range(STARTS):
        metrics_dir = tmp_path / f"multiproc-{start}"
        gateway = LocalGateway(config_data=gateway_config(), simulations=sims, work_dir=tmp_path / f"start-{start}", workers=2,
                               envoy_concurrency=2, env={"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)})
        with gateway:
            instance = gateway.running[0]
            supervisor = instance.extproc
            ports = supervisor.extra["ports"]
            assert ports == [ports[0], ports[0] + 1]
            pids = children(supervisor.pid)
            assert len(pids) == 2
            log = supervisor.log_tail(100_000)
            for index, (pid, port) in enumerate(zip(pids, ports)):
                assert f"worker {index} pid {pid} on 127.0.0.1:{port}" in log, log
                for service in HEALTH_SERVICES:
                    assert health(port, service) == health_pb2.HealthCheckResponse.SERVING, (port, service)
            assert wait_until(lambda: sorted(extproc_hosts(gateway)) == ports and all(
                h["health_flags"] == "healthy" for h in extproc_hosts(gateway).values()), within_seconds=30), extproc_hosts(gateway)

            def send(client: int) -> list[int]:
                with httpx.Client(base_url=instance.url, timeout=30) as http:  # one connection per client
                    return [http.post("/v1/chat/completions", json=chat_body(f"hi {i}", max_tokens=1),
                                      headers={"x-user-id": f"user-{client}-{i}"}).status_code
                            for i in range(client, REQUESTS, CLIENTS)]

            statuses: list[int] = []
            threads = [threading.Thread(target=lambda c=c: statuses.extend(send(c))) for c in range(CLIENTS)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=120)
            assert statuses == [200] * REQUESTS
            # Each worker writes its counters to its own file (counter_<pid>.db), once per decision.
            assert wait_until(lambda: sum(decisions_in(metrics_dir / f"counter_{pid}.db") for pid in pids) == REQUESTS, 10)
            split = [decisions_in(metrics_dir / f"counter_{pid}.db") for pid in pids]
            splits.append(split)
    assert all(min(split) >= REQUESTS / 4 for split in splits), splits


def serve_with_a_port_taken(tmp_path: Path, server: dict, taken: int) -> subprocess.CompletedProcess:
    """`iris-extproc serve` with gateway_config(server=`server`) while another socket listens on
    127.0.0.1:`taken`; the finished process, its stderr as text."""
    config_path = tmp_path / "routing.yaml"
    config_path.write_text(yaml.safe_dump(gateway_config(server=server), sort_keys=False))
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", taken))
        holder.listen()
        return subprocess.run([sys.executable, "-m", "extproc.cli", "serve", "--config", str(config_path)], capture_output=True,
                              text=True, timeout=60, env={**os.environ, "IRIS_SESSION_SECRET": secrets.token_hex(32)})


def test_a_taken_port_stops_the_start_naming_it(tmp_path):
    """The second worker's port is taken: `serve --workers 2` exits 2 before starting any
    worker, with one line naming the port; no traceback."""
    first = free_port_range(2)
    result = serve_with_a_port_taken(tmp_path, {"listen": f"127.0.0.1:{first}", "workers": 2}, first + 1)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1] == (f"iris-extproc: cannot listen on 127.0.0.1:{first + 1} (Address already in use): 2 workers listen on "
                         f"127.0.0.1:{first} to 127.0.0.1:{first + 1}, one port each"), result.stderr
    assert "Traceback" not in result.stderr and "supervising" not in result.stderr


def test_a_taken_metrics_port_stops_the_server_naming_it(tmp_path):
    """`server.metrics_listen` is taken: `serve` exits 2 with one line naming the address, no
    traceback (the gRPC server it had started is drained first, or the process would not exit)."""
    first = free_port_range(2)
    result = serve_with_a_port_taken(tmp_path, {"listen": f"127.0.0.1:{first}", "metrics_listen": f"127.0.0.1:{first + 1}"}, first + 1)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1] == f"iris-extproc: cannot serve metrics on 127.0.0.1:{first + 1} (Address already in use)", result.stderr
    assert "Traceback" not in result.stderr
