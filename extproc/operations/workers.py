"""`iris-extproc serve --workers N`: N ext_proc worker processes on one listening port.

Each worker is a full `iris-extproc serve` process: its own event loop, Redis connection pool,
lease table and instance id in the instance registry (so the outage policy's N counts workers).
They share `server.listen` through SO_REUSEPORT (the kernel spreads new connections over them;
one Envoy connection stays on one worker). This supervisor only starts them, forwards SIGTERM
or SIGINT to every worker (each drains as a single server does) and exits 0 once all exited 0;
it forwards SIGHUP (each worker reloads the routing config: extproc.operations.reload).
A worker that exits on its own stops the others: the supervisor then exits with its code (or 1),
so the process manager (Kubernetes, systemd) restarts the whole set.

With `server.metrics_listen` at host:P, worker i serves its metrics on host:P+i.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time

log = logging.getLogger(__name__)

POLL_SECONDS = 0.1


def worker_metrics_listen(listen: str, index: int) -> str:
    """host:port of worker `index`'s metrics: `listen`'s port plus the index."""
    host, port = listen.rsplit(":", 1)
    return f"{host}:{int(port) + index}"


def supervise(worker_argv: list[str], workers: int) -> int:
    """Start `workers` processes running `worker_argv` plus `--worker-index i`, wait for them.
    Returns 0 when a SIGTERM/SIGINT drained every worker to exit 0, else the first nonzero code."""
    stopping = False

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

    children: list[subprocess.Popen] = []
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, reload)
    try:
        for index in range(workers):
            children.append(subprocess.Popen([*worker_argv, "--worker-index", str(index)]))
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
