"""`iris-extproc serve --workers 2` (issue 13): two worker processes share the gRPC port
(SO_REUSEPORT), each with its own instance id; SIGTERM to the supervisor drains both: the
streams running at that moment finish (0 failures), every lease is released, and it exits 0.
A SIGTERM or SIGINT while the workers are still being started (issue 20) stops all of them too."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis
import yaml

from irislab.local_gateway import LocalGateway, ProviderSimulation
from irislab.processes import free_port, spawn, start_redis
from tests.support.fleet import LoadPlan, run_load
from tests.support.gateway import gateway_config, live_leases, provider_stats, wait_until


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


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
    gateway = LocalGateway(config_data=gateway_config(), simulations=sims, work_dir=tmp_path, extproc_args=["--workers", "2"])
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
    gateway = LocalGateway(config_data=gateway_config(), work_dir=tmp_path, extproc_args=["--workers", "2"])
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
        server={"listen": f"127.0.0.1:{free_port()}", "drain_delay_seconds": 0, "drain_grace_seconds": 1},
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
