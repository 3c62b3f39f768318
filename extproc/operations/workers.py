"""`iris-extproc serve` with `server.workers` (or `--workers`) N > 1: N ext_proc worker processes,
each on its own port.

Each worker is a full `iris-extproc serve` process: its own event loop, Redis connection pool,
lease table and instance id in the instance registry (so the outage policy's N counts workers).
Worker i listens on `server.listen`'s port + i (ServerSettings.worker_listen), and the Envoy
file lists every one of those ports as an endpoint of its ext_proc cluster, so Envoy balances
streams over the workers (extproc.config.envoy_check says when it lists fewer). One shared port
(SO_REUSEPORT) would leave the split to the kernel, per connection, and Envoy holds one HTTP/2
connection per worker thread for hours: 2 workers behind 2 Envoy threads split 99/1, 40/60 and
99/1 over three starts (issue 24). A port already taken stops the start before any worker runs
(extproc.operations.ports). This supervisor only starts them, forwards SIGTERM
or SIGINT to every worker (each drains as a single server does) and exits 0 once all exited 0;
it forwards SIGHUP (each worker reloads the routing config: extproc.operations.reload). A SIGTERM
or SIGINT that arrives while the workers are being started starts no more of them: the ones
already started get SIGTERM, and the supervisor exits once they have.
A worker that exits on its own stops the others: the supervisor then exits with its code (or 1),
so the process manager (Kubernetes, systemd) restarts the whole set.

Metrics: one endpoint for the whole set. The workers write their metrics to prometheus-client's
multiprocess files in PROMETHEUS_MULTIPROC_DIR (the operator's directory, emptied at start, else
a temporary one removed at exit), and worker 0 alone serves `server.metrics_listen`, merging
every worker's files (extproc.operations.exporter); a worker that exits is marked dead there, so
its `live*` gauges leave the merge. `worker_config` gives worker i > 0 no metrics listener (a reload
applies the same adjustment to the file's config before comparing it with the running one).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from extproc.operations.ports import ListenError, unavailable

if TYPE_CHECKING:
    from extproc.config import Config

log = logging.getLogger(__name__)

POLL_SECONDS = 0.1
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus-client's name for it


def worker_config(config: Config, index: int, workers: int | None = None) -> Config:
    """`config` as worker `index` runs it: worker 0 serves the metrics of every worker on
    `server.metrics_listen`, the others serve none (their `metrics_listen` is None). `workers`: the
    count `serve --workers` gave, which replaces `server.workers` (None: the file's). Each worker
    keeps the file's `server.listen` (the check of the Envoy file needs the first port) and binds
    `server.worker_listen(index)`."""
    update = {}
    if index and config.server.metrics_listen:
        update["metrics_listen"] = None
    if workers is not None and workers != config.server.workers:
        update["workers"] = workers
    if not update:
        return config
    return config.model_copy(update={"server": config.server.model_copy(update=update)})


def clear_metrics_dir(directory: str | Path, keep_pid: int | None = None) -> int:
    """Remove the multiprocess metric files (`*.db`) in `directory` but those of process
    `keep_pid` (its own, already open): left by an earlier run, they would be merged into this
    one's (prometheus-client: the directory must be emptied between runs). Returns how many."""
    removed = 0
    for path in Path(directory).glob("*.db"):
        if keep_pid is not None and path.stem.rsplit("_", 1)[-1] == str(keep_pid):
            continue
        path.unlink(missing_ok=True)
        removed += 1
    return removed


def clear_stale_metrics() -> None:
    """For a server running alone with PROMETHEUS_MULTIPROC_DIR set: remove the files there of
    every other process (an earlier run's)."""
    given = os.environ.get(MULTIPROC_DIR_ENV)
    if given and Path(given).is_dir():
        clear_metrics_dir(given, keep_pid=os.getpid())


def _metrics_dir() -> tuple[str, bool]:
    """(the workers' multiprocess directory, whether this supervisor made it): the operator's
    PROMETHEUS_MULTIPROC_DIR emptied, else a new temporary directory."""
    given = os.environ.get(MULTIPROC_DIR_ENV)
    if given:
        Path(given).mkdir(parents=True, exist_ok=True)
        clear_metrics_dir(given)
        return given, False
    return tempfile.mkdtemp(prefix="iris-extproc-metrics-"), True


def _mark_dead(pid: int, directory: str) -> None:
    """Drop worker `pid`'s `live*` gauge files from the merge (prometheus-client)."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid, directory)


def supervise(worker_argv: list[str], addresses: list[str]) -> int:
    """Start one process per address of `addresses` (worker i listens on `addresses[i]`) running
    `worker_argv` plus `--worker-index i`, wait for them. Returns 0 when a SIGTERM/SIGINT drained
    every worker to exit 0, else the first nonzero code. Raises ports.ListenError, before
    starting any, when an address cannot be bound.

    A SIGTERM or SIGINT at any moment, start-up included, stops the starting of workers: every
    worker started so far gets SIGTERM (one being started when the signal came gets it as soon as
    its Popen returns), and the supervisor returns once all of them have exited."""
    taken = unavailable(addresses)
    if taken:
        raise ListenError(f"cannot listen on {', '.join(taken)}: {len(addresses)} workers listen on "
                          f"{addresses[0]} to {addresses[-1]}, one port each")
    workers = len(addresses)
    stopping = False
    children: list[subprocess.Popen] = []
    metrics_dir, made = _metrics_dir()
    env = {**os.environ, MULTIPROC_DIR_ENV: metrics_dir}
    marked: set[int] = set()

    def mark_ended() -> None:
        for child in children:
            if child.returncode is not None and child.pid not in marked:
                marked.add(child.pid)
                _mark_dead(child.pid, metrics_dir)

    def stop(signum, _frame) -> None:
        nonlocal stopping
        stopping = True
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)

    def reload(signum, _frame) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGHUP)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, reload)
    try:
        for index in range(workers):
            if stopping:
                break
            child = subprocess.Popen([*worker_argv, "--worker-index", str(index)], env=env)
            children.append(child)
            # A signal handled while Popen was starting this child found it not yet in `children`
            # and did not signal it: do it now. (Handled between the append and this line, it did,
            # and the worker gets SIGTERM twice: harmless, its handler only sets an event.)
            if stopping and child.poll() is None:
                child.send_signal(signal.SIGTERM)
        if stopping:
            log.info("stopping during start-up: %d of %d ext_proc workers started, pids %s", len(children), workers, [c.pid for c in children])
        else:
            log.info("supervising %d ext_proc workers: %s", workers,
                     ", ".join(f"worker {i} pid {c.pid} on {address}" for i, (c, address) in enumerate(zip(children, addresses))))
        failed: int | None = None
        while any(c.poll() is None for c in children):
            mark_ended()
            if not stopping:
                ended = [c for c in children if c.returncode is not None]
                if ended:
                    failed = ended[0].returncode or 1
                    log.error("worker pid %d exited with %s: stopping the others", ended[0].pid, ended[0].returncode)
                    stop(signal.SIGTERM, None)
            time.sleep(POLL_SECONDS)
        codes = [c.returncode for c in children]
        if failed is not None:
            return failed
        return 0 if all(code == 0 for code in codes) else next(code for code in codes if code != 0)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if made:
            shutil.rmtree(metrics_dir, ignore_errors=True)


def worker_command(config_path: str, event_loop: str, log_level: str, workers: int, envoy_path: str | None = None,
                   log_format: str = "text") -> list[str]:
    """The command line of one worker of `workers` (without its index); `envoy_path`: its `--envoy`."""
    return [sys.executable, "-m", "extproc.cli", "--log-level", log_level, "--log-format", log_format, "serve", "--config", config_path,
            "--event-loop", event_loop, "--workers", str(workers), *(["--envoy", envoy_path] if envoy_path else [])]
