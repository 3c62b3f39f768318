"""bench.redis_client (docs/results/issue24/README.md "The hot-path Redis client") runs end to end on a tiny
input and prints a figure for every client at both concurrencies, calling the scripts directly and
through RoutingState (no timing is asserted)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_redis_client_bench_prints_every_figure():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for loop, path in (("uvloop", "scripts"), ("asyncio", "scripts"), ("uvloop", "state")):
        done = subprocess.run([sys.executable, "-m", "bench.redis_client", "--pairs", "64", "--rounds", "1", "--loop", loop,
                               "--path", path],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        rows = dict(re.findall(r"^\| (redis-py|pipelined|pipelined\+packed) \| (\d+ \| \d+) \|$", done.stdout, re.MULTILINE))
        assert set(rows) == {"redis-py", "pipelined", "pipelined+packed"}, done.stdout
