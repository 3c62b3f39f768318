"""bench.release_batch (docs/results/issue24/README.md "Batched renewals and releases") runs end to end on a
tiny input and prints a single -> batched figure for every operation and client (its own checks
fail the run when a renewal answers anything but RENEWED, a single release anything but RELEASED,
or a batched release leaves its lease in Redis; no timing is asserted)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_release_batch_bench_prints_every_figure():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "bench.release_batch", "--leases", "64", "--rounds", "1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = re.findall(r"^\| (renewal|release) \| (redis-py|pipelined) \| \d+ -> \d+ ", done.stdout, re.MULTILINE)
    assert sorted(rows) == sorted((op, client) for op in ("renewal", "release") for client in ("redis-py", "pipelined")), done.stdout
