"""A real Prometheus for the dashboard test: Debian's `prometheus` package, run on a free loopback
port and stopped by its pid.

Found on PATH, else unpacked from the Debian package into the virtualenv (`apt-get download` and
`dpkg-deb -x`: no maintainer script runs, so no system service is started and nothing listens
beyond this test's own process; `apt-get update` first when the package lists lack it, as root).
Where none of that is possible the test is skipped with the reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import httpx
import pytest

from irislab.processes import ManagedProcess, free_port, spawn, wait_for_port
from tests.support.gateway import wait_until

UNPACKED = Path(sys.prefix) / "prometheus-deb"


def prometheus_binary() -> str:
    """The path of a `prometheus` binary; skips the calling test when none can be had."""
    found = shutil.which("prometheus")
    if found:
        return found
    binary = UNPACKED / "usr" / "bin" / "prometheus"
    if binary.exists():
        return str(binary)
    if not shutil.which("apt-get") or not shutil.which("dpkg-deb"):
        pytest.skip("no prometheus on PATH and no apt-get/dpkg-deb to fetch Debian's package")
    problem = _unpack_debian_package()
    if problem is not None:
        pytest.skip(f"no prometheus on PATH and Debian's package could not be fetched: {problem}")
    return str(binary)


def promtool_binary() -> str:
    """The path of the `promtool` that comes with the `prometheus` binary (Debian's package has
    both); skips the calling test when there is none."""
    beside = Path(prometheus_binary()).with_name("promtool")
    if beside.exists():
        return str(beside)
    found = shutil.which("promtool")
    if found:
        return found
    pytest.skip(f"no promtool beside {prometheus_binary()} nor on PATH")


def _unpack_debian_package() -> str | None:
    """Download and unpack Debian's prometheus package into UNPACKED; the problem, or None."""
    with tempfile.TemporaryDirectory() as download:
        result = _apt(["download", "prometheus"], download)
        if result.returncode != 0 and os.geteuid() == 0:
            _apt(["update"], download)
            result = _apt(["download", "prometheus"], download)
        if result.returncode != 0:
            lines = (result.stderr or result.stdout).strip().splitlines()
            return lines[-1] if lines else f"apt-get exited with code {result.returncode}"
        (deb,) = Path(download).glob("prometheus_*.deb")
        staging = UNPACKED.with_name(UNPACKED.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        subprocess.run(["dpkg-deb", "-x", str(deb), str(staging)], check=True, capture_output=True, timeout=120)
        staging.rename(UNPACKED)
    return None


def _apt(args: list[str], cwd: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    return subprocess.run(
        ["apt-get", "-q", "-o", "DPkg::Lock::Timeout=120", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


class Prometheus:
    """A running Prometheus scraping `targets` ("host:port") every `interval_seconds`, evaluating
    the rules of `rule_files` as often."""

    def __init__(self, binary: str, work_dir: Path, targets: list[str], interval_seconds: float = 1.0, rule_files: Sequence[Path] = ()):
        work_dir.mkdir(parents=True, exist_ok=True)
        config = work_dir / "prometheus.yml"
        rules = "".join(f"- {path}\n" for path in rule_files)
        config.write_text(
            "global:\n"
            f"  scrape_interval: {round(interval_seconds * 1000)}ms\n"
            f"  evaluation_interval: {round(interval_seconds * 1000)}ms\n"
            + (f"rule_files:\n{rules}" if rules else "")
            + "scrape_configs:\n"
            "- job_name: iris-extproc\n"
            "  static_configs:\n"
            f"  - targets: [{', '.join(targets)}]\n"
        )
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: ManagedProcess = spawn(
            "prometheus",
            [binary, f"--config.file={config}", f"--storage.tsdb.path={work_dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            work_dir,
        )
        wait_for_port(self.port, process=self.process.popen)
        if not wait_until(lambda: self._ready(), 30, 0.1):
            self.stop()
            raise RuntimeError(f"prometheus not ready: {self.process.log_tail()}")

    def _ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def query(self, expr: str) -> list[dict]:
        """The result of an instant query (a vector's samples). Raises AssertionError on an
        error answer (a PromQL the server rejects)."""
        answer = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10).json()
        assert answer["status"] == "success", (expr, answer)
        return answer["data"]["result"]

    def rules(self) -> list[dict]:
        """Every rule loaded (/api/v1/rules), each with its group's name under `group`."""
        answer = httpx.get(f"{self.url}/api/v1/rules", timeout=10).json()
        assert answer["status"] == "success", answer
        return [{**rule, "group": group["name"]} for group in answer["data"]["groups"] for rule in group["rules"]]

    def stop(self) -> None:
        self.process.stop()
