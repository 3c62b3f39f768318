"""`iris-extproc serve --workers N`: N ext_proc worker processes on one listening port.

Each worker is a full `iris-extproc serve` process: its own event loop, Redis connection pool,
lease table and instance id in the instance registry (so the outage policy's N counts workers).
They share `server.listen` through SO_REUSEPORT (the kernel spreads new connections over them;
one Envoy connection stays on one worker). This supervisor only starts them, forwards SIGTERM
or SIGINT to every worker (each drains as a single server does) and exits 0 once all exited 0;
it forwards SIGHUP (each worker reloads the routing config: extproc.operations.reload). A SIGTERM
or SIGINT that arrives while the workers are being started starts no more of them: the ones
already started get SIGTERM, and the supervisor exits once they have.
A worker that exits on its own stops the others: the supervisor then exits with its code (or 1),
so the process manager (Kubernetes, systemd) restarts the whole set.

With `server.metrics_listen` at host:P, worker i serves its metrics on host:P+i (`worker_config`;
a reload applies the same adjustment to the file's config before comparing it with the running one).
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from extproc.config import Config

log = logging.getLogger(__name__)

POLL_SECONDS = 0.1


def worker_metrics_listen(listen: str, index: int) -> str:
    """host:port of worker `index`'s metrics: `listen`'s port plus the index."""
    host, port = listen.rsplit(":", 1)
    return f"{host}:{int(port) + index}"


def worker_config(config: Config, index: int) -> Config:
    """`config` as worker `index` runs it: its `server.metrics_listen` moved to that port plus the
    index (worker_metrics_listen); the same config for worker 0 or without metrics."""
    if not index or not config.server.metrics_listen:
        return config
    server = config.server.model_copy(update={"metrics_listen": worker_metrics_listen(config.server.metrics_listen, index)})
    return config.model_copy(update={"server": server})


def supervise(worker_argv: list[str], workers: int) -> int:
    """Start `workers` processes running `worker_argv` plus `--worker-index i`, wait for them.
    Returns 0 when a SIGTERM/SIGINT drained every worker to exit 0, else the first nonzero code.

    A SIGTERM or SIGINT at any moment, start-up included, stops the starting of workers: every
    worker started so far gets SIGTERM (one being started when the signal came gets it as soon as
    its Popen returns), and the supervisor returns once all of them have exited."""
    stopping = False
    children: list[subprocess.Popen] = []

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
            child = subprocess.Popen([*worker_argv, "--worker-index", str(index)])
            children.append(child)
            # A signal handled while Popen was starting this child found it not yet in `children`
            # and did not signal it: do it now. (Handled between the append and this line, it did,
            # and the worker gets SIGTERM twice: harmless, its handler only sets an event.)
            if stopping and child.poll() is None:
                child.send_signal(signal.SIGTERM)
        if stopping:
            log.info("stopping during start-up: %d of %d ext_proc workers started, pids %s", len(children), workers, [c.pid for c in children])
        else:
            log.info("supervising %d ext_proc workers: pids %s", workers, [c.pid for c in children])
        failed: int | None = None
        while any(c.poll() is None for c in children):
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


def worker_command(config_path: str, event_loop: str, log_level: str, envoy_path: str | None = None) -> list[str]:
    """The command line of one worker (without its index); `envoy_path`: its `--envoy`."""
    return [sys.executable, "-m", "extproc.cli", "--log-level", log_level, "serve", "--config", config_path,
            "--event-loop", event_loop, *(["--envoy", envoy_path] if envoy_path else [])]
