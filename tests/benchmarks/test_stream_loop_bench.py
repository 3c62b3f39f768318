"""bench.stream_loop (docs/results/issue24/README.md "Where the rest goes") runs end to end on a tiny input
and prints every figure: its own check fails the run when a request is not routed; no timing is
asserted."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_stream_loop_bench_prints_every_figure():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "bench.stream_loop", "--requests", "200", "--users", "20", "--rounds", "1",
                           "--concurrency", "8"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = set(re.findall(r"^FIGURE (\S+) [\d.]+$", done.stdout, re.MULTILINE))
    assert figures == {"stream_loop_cpu_us:redis@1", "stream_loop_cpu_us:redis@8", "stream_loop_cpu_us:outage_policy@1",
                       "stream_loop_cpu_us:outage_policy@8", "full_collection_ms:not_frozen", "full_collection_ms:frozen"}, done.stdout
