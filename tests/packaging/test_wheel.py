"""The built wheel carries everything the CLI needs (issue 12): build it, install it into a fresh
virtualenv, and run `iris-lab up --demo --exit-after-demo` from a directory outside the
repository.

To stay fast and offline, the fresh venv gets the test venv's dependencies through a .pth file
pointing at the test venv's site-packages, the wheel is installed with --no-deps, and it is built
without build isolation (hatchling comes with the test extra). The repository is never on the
fresh venv's path: the command runs from a temporary directory, and the test checks that the
package it imported lives in the fresh venv."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

from tests.support.configs import ROOT

pytestmark = pytest.mark.slow


def run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{argv}: {result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def test_the_wheel_runs_the_demo_outside_the_repository(tmp_path):
    wheels = tmp_path / "wheels"
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w", str(wheels), str(ROOT)], timeout=300)
    (wheel,) = wheels.glob("iris_extproc-*.whl")

    fresh = tmp_path / "venv"
    venv.create(fresh, with_pip=False, symlinks=True)
    python = fresh / "bin" / "python"
    fresh_site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    test_site = Path(sysconfig.get_paths()["purelib"])
    # Dependencies only: the test venv's editable install of this package (a .pth or finder
    # pointing at the repository) must not leak in, so only that site-packages folder is added.
    (fresh_site / "test-venv-dependencies.pth").write_text(f"{test_site}\n")
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--quiet", str(wheel)], timeout=300)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{fresh / 'bin'}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # envoy from the test venv
    where = run([str(python), "-c", "import extproc, irislab; print(extproc.__file__); print(irislab.__file__)"], cwd=elsewhere, env=env)
    assert all(line.startswith(str(fresh_site)) for line in where.stdout.split()), where.stdout

    result = run([str(fresh / "bin" / "iris-lab"), "--log-level", "warning", "up", "--demo", "--exit-after-demo"],
                 cwd=elsewhere, env=env, timeout=300)
    assert "gateway up: http://127.0.0.1:" in result.stdout
    turns = [line for line in result.stdout.splitlines() if " turn " in line and "->" in line]
    assert len(turns) >= 2, result.stdout
    assert "Traceback" not in result.stderr
