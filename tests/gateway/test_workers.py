"""`iris-extproc serve --workers 2` (issue 13): two worker processes share the gRPC port
(SO_REUSEPORT), each with its own instance id; SIGTERM to the supervisor drains both: the
streams running at that moment finish (0 failures), every lease is released, and it exits 0."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path

import redis

from irislab.local_gateway import LocalGateway, ProviderSimulation
from tests.support.fleet import LoadPlan, run_load
from tests.support.gateway import gateway_config, live_leases, provider_stats, wait_until


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


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
