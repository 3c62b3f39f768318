"""The routers a user would pick instead of this gateway, run as the benchmarks' peers.

Both install from PyPI with the bench extra (`pip install -e '.[bench]'`) as Rust binaries in
wheels, and accept the simulated provider as a worker as it is (they proxy the OpenAI body and
the response unchanged, the simulator's ``x-simulator-name`` header included):

* the SGLang Model Gateway (``sglang-router``, command ``smg launch``): policies round_robin and
  cache_aware (a radix tree over the request text, with its default thresholds);
* ``vllm-router`` (a fork of the former): round_robin, sticky_least_loaded (a session, from the
  ``X-Session-ID`` header, stays on the worker it was first sent to, new sessions go to the
  least loaded one) and cache_aware.

Neither knows capacity limits per provider, shares state across replicas, or offloads to a third
party. Each runs as its own process on free 127.0.0.1 ports (its Prometheus exporter too: each
instance needs its own port) and is stopped by its pid. A peer whose program is not installed is
reported by `unavailable` and skipped by the benchmarks (CI installs only the test extra).
"""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from irislab.processes import ManagedProcess, ProcessError, free_port, spawn, wait_for_port

SESSION_HEADER = "X-Session-ID"  # vllm-router's sticky_least_loaded reads the session from it


@dataclass(frozen=True)
class Peer:
    """One peer configuration: `name` as the benchmarks report it, the `program` that runs it
    and its routing `policy`; `log_level` is the program's own spelling of "warnings only"."""

    name: str
    program: str
    policy: str
    log_level: str

    def argv(self, program_path: str, port: int, prometheus_port: int, worker_urls: list[str]) -> list[str]:
        """The command line serving 127.0.0.1:`port` over `worker_urls`."""
        head = [program_path, "launch"] if self.program == "smg" else [program_path]
        return [*head, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *worker_urls,
                "--policy", self.policy, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port),
                "--log-level", self.log_level]


PEERS = (
    Peer("smg_round_robin", "smg", "round_robin", "warn"),
    Peer("smg_cache_aware", "smg", "cache_aware", "warn"),
    Peer("vllm_round_robin", "vllm-router", "round_robin", "warning"),
    Peer("vllm_sticky_least_loaded", "vllm-router", "sticky_least_loaded", "warning"),
    Peer("vllm_cache_aware", "vllm-router", "cache_aware", "warning"),
)
BY_NAME = {peer.name: peer for peer in PEERS}


def program_path(program: str) -> str | None:
    """Where `program` is installed: beside this interpreter (the virtualenv), else on PATH."""
    beside = Path(sys.executable).parent / program
    if beside.exists():
        return str(beside)
    return shutil.which(program)


def unavailable(peer: Peer) -> str | None:
    """Why `peer` cannot run here (None: it can)."""
    if program_path(peer.program) is None:
        package = "sglang-router" if peer.program == "smg" else "vllm-router"
        return f"`{peer.program}` not found: install the bench extra (PyPI package {package})"
    return None


def start_peer(peer: Peer, worker_urls: list[str], work_dir: Path, timeout_seconds: float = 30.0) -> ManagedProcess:
    """Run `peer` over `worker_urls` (http://127.0.0.1:port each); returns once it answers
    ``GET /health`` with 200 (it has found its workers healthy). `.port` is its listening port.

    Raises ProcessError when it is not installed, exits, or is not ready in time."""
    path = program_path(peer.program)
    if path is None:
        raise ProcessError(unavailable(peer))
    port = free_port()
    process = spawn(f"peer-{peer.name}", peer.argv(path, port, free_port(), worker_urls), work_dir)
    process.port = port
    try:
        wait_for_port(port, timeout_seconds, process=process.popen)
        deadline = time.monotonic() + timeout_seconds
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0).status_code == 200:
                    return process
            except httpx.HTTPError:
                pass
            if process.popen.poll() is not None or time.monotonic() > deadline:
                raise ProcessError(f"{peer.name} not healthy: {process.log_tail(1500)}")
            time.sleep(0.1)
    except BaseException:
        process.stop()
        raise
