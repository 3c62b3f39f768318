"""Metrics of several processes (issue 22): the files of PROMETHEUS_MULTIPROC_DIR that an earlier
run left are removed (a server's own kept), a dead worker's `live*` gauges leave the merge, and
the gauges a single process reads from functions at scrape time reach the files in multiprocess
mode. prometheus-client picks its mode when first imported, so those run in a new interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from extproc.operations import workers

ROOT = Path(__file__).resolve().parents[3]


def run_python(code: str, metrics_dir: Path) -> str:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir), "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_an_earlier_runs_files_are_removed_and_the_servers_own_kept(tmp_path):
    for name in ("counter_101.db", "gauge_livesum_101.db", "histogram_202.db", f"counter_{os.getpid()}.db", "notes.txt"):
        (tmp_path / name).write_bytes(b"")
    assert workers.clear_metrics_dir(tmp_path, keep_pid=os.getpid()) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"counter_{os.getpid()}.db", "notes.txt"]
    assert workers.clear_metrics_dir(tmp_path) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_the_merge_sums_workers_and_forgets_a_dead_workers_live_gauges(tmp_path):
    """Two processes write; the merge sums their decisions and local leases; once the second is
    marked dead (as the supervisor does when a worker exits) its local leases leave the sum, its
    decisions stay counted."""
    write = """
        from extproc import metrics
        metrics.DECISIONS.labels("iris-1", "managed", "m", "new_pin").inc({n})
        metrics.LOCAL_LEASES.set({n})
        import os; print(os.getpid())
    """
    first, second = (int(run_python(write.format(n=n), tmp_path)) for n in (2, 3))
    serve = """
        from prometheus_client import generate_latest
        from extproc.operations import exporter
        print(generate_latest(exporter.metrics_registry()).decode())
    """
    merged = samples(run_python(serve, tmp_path))
    decisions = ("iris_routing_decisions_total", (("gen_ai_request_model", "m"), ("kind", "managed"), ("provider", "iris-1"), ("reason", "new_pin")))
    assert merged[decisions] == 5 and merged[("iris_local_leases", ())] == 5
    workers._mark_dead(second, str(tmp_path))
    merged = samples(run_python(serve, tmp_path))
    assert merged[decisions] == 5 and merged[("iris_local_leases", ())] == 2
    assert first != second


def test_function_read_gauges_reach_the_files_in_multiprocess_mode(tmp_path):
    code = """
        import asyncio
        from prometheus_client import generate_latest
        from extproc.operations import exporter
        sample = exporter.track_process_gauges(lambda: True, lambda: 4)
        assert sample is not None
        asyncio.run(sample())
        print(generate_latest(exporter.metrics_registry()).decode())
    """
    merged = samples(run_python(code, tmp_path))
    assert merged[("iris_redis_breaker_open", ())] == 1 and merged[("iris_local_leases", ())] == 4
    assert merged[("iris_build_info", tuple(sorted(merged_build_labels(merged).items())))] == 1


def merged_build_labels(merged: dict) -> dict:
    (labels,) = [dict(labels) for name, labels in merged if name == "iris_build_info"]
    assert set(labels) == {"version", "python", "grpcio", "redis_py"} and all(labels.values())
    return labels
