"""The lab's commands as a new user meets them (issue 22): `./dev --help` lists the commands,
`iris-lab up` prints where its metrics and Envoy's admin are (both answer), and removes its work
directory when it stops unless `--keep-work-dir`."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.support.configs import ROOT
from tests.support.gateway import PrintedLines


def test_dev_help_lists_the_commands():
    result = subprocess.run(["bash", str(ROOT / "dev"), "--help"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout.startswith("usage: ./dev COMMAND [ARGS]\n")
    commands = [line.split()[0] for line in result.stdout.splitlines() if re.match(r"^  [a-z]", line)]
    assert commands == ["demo", "up", "test", "help"]
    unknown = subprocess.run(["bash", str(ROOT / "dev"), "nonsense"], capture_output=True, text=True, timeout=30)
    assert unknown.returncode == 2 and unknown.stdout == "" and "unknown command 'nonsense'" in unknown.stderr


@pytest.mark.parametrize("keep", [False, True], ids=["removed", "kept"])
def test_up_prints_metrics_and_admin_and_cleans_up_its_work_dir(keep):
    argv = [sys.executable, "-m", "irislab.cli", "--log-level", "warning", "up", *(["--keep-work-dir"] if keep else [])]
    env = {k: v for k, v in os.environ.items() if k not in ("IRIS_CONFIG", "IRIS_REDIS_URL", "IRIS_LOG_LEVEL")}
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    work_dir = None
    try:
        printed = "".join(PrintedLines(process.stdout).until("press Ctrl-C"))
        work_dir = Path(re.search(r"logs in (\S+), ", printed).group(1))
        assert ("kept on exit" if keep else "removed on exit: --keep-work-dir keeps it") in printed
        metrics, admin = re.search(r"^metrics: (http://\S+/metrics)  Envoy admin: (http://127\.0\.0\.1:\d+) ", printed, re.M).groups()
        assert "iris_config_reloads_total" in httpx.get(metrics, timeout=10).text
        assert httpx.get(f"{admin}/server_info", timeout=10).json()["state"] == "LIVE"
        assert (work_dir / "envoy-0.log").exists()
        routing = re.search(r"^routing config: (\S+) ", printed, re.M).group(1)
        envoy = re.search(r"^Envoy file: (\S+) ", printed, re.M).group(1)
        checked = subprocess.run([sys.executable, "-m", "extproc.cli", "check", "--config", routing, "--envoy", envoy],
                                 capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
        assert checked.returncode == 0 and checked.stdout.startswith("ok"), checked.stdout + checked.stderr
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0
        assert work_dir.exists() is keep
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if work_dir is not None:
            shutil.rmtree(work_dir, ignore_errors=True)
