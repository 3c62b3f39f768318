"""The metric names the docs give are the ones the code exports (issue 20).

Exported: every `iris_*` family in prometheus-client's REGISTRY once extproc.metrics is imported
(this process's counters, gauges and histogram), plus the fleet-state gauges the exporter's
FleetCollector yields at scrape time. Names are compared as a scrape shows them: a counter with
its `_total`, a histogram as itself or its `_bucket`, `_sum` and `_count` series.

- every `iris_*` name in README.md and docs/**/*.md (prose, tables and code alike) is exported;
- the table of docs/operations.md "Metrics" lists exactly the exported metrics, each once, with
  its type and labels.
"""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import REGISTRY
from prometheus_client.metrics import MetricWrapperBase

from extproc import metrics
from extproc.operations.exporter import FleetCollector
from extproc.operations.fleet_state import CachedFleetState, FleetState, PairState
from extproc.routing.degraded import HEALTH, Flag

ROOT = Path(__file__).resolve().parents[2]
OPERATIONS = ROOT / "docs" / "operations.md"

# `iris_` names in the docs that are not metrics, and what they are.
NOT_METRICS = {
    "iris_code": "a field of Envoy's access log (docs/operations.md, Access log)",
    **{front: "a front end of bench.real_engines (docs/benchmarks.md, Real engines)"
       for front in ("iris_hash", "iris_hash_operator", "iris_pick", "iris_pick_operator")},
}

_NAME = re.compile(r"(?<![A-Za-z0-9_])iris_[a-z0-9_]*[a-z0-9]")
_ROW = re.compile(r"^\|\s*`(iris_[a-z0-9_]+)`\s*\|\s*([a-z]+)\s*\|([^|]*)\|")
_HEADING = re.compile(r"^#{1,6} ")


def exposition_name(family: str, kind: str) -> str:
    """The name a scrape shows for a family of this type (a counter's samples end in `_total`)."""
    return f"{family}_total" if kind == "counter" else family


def process_metrics() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Name (as scraped) -> (type, labels) of every metric extproc.metrics defines; the labels of
    a labelled family with no child yet are in no sample, so they are read off the metric."""
    found = {}
    for metric in vars(metrics).values():
        if isinstance(metric, MetricWrapperBase):
            found[exposition_name(metric._name, metric._type)] = (metric._type, tuple(metric._labelnames))
    return found


def registered_names() -> set[str]:
    """The `iris_*` families prometheus-client's default registry exports, as scraped."""
    return {exposition_name(family.name, family.type) for family in REGISTRY.collect() if family.name.startswith("iris_")}


def fleet_metrics() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Name -> (type, labels) of every family FleetCollector yields, from a scrape of a fleet
    with one managed pair with limits, a flag and a waiting ticket, so that every family has a sample."""
    pair = PairState("iris-1", "managed", "m", in_flight=1, in_flight_limit=4, reserved_for_pinned=1, pins=1, pin_limit=2,
                     flags=[Flag(HEALTH, "health: down", 30.0)], queued={"interactive": 1})
    fleet = CachedFleetState(lambda: FleetState(now_ms=0, live_instances=1, pairs=[pair]))
    found = {}
    for family in FleetCollector(fleet).collect():
        labels = {tuple(sample.labels) for sample in family.samples}
        assert len(labels) == 1, (family.name, labels)
        found[exposition_name(family.name, family.type)] = (family.type, labels.pop())
    return found


def exported() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Every metric this server exports: name (as scraped) -> (type, labels)."""
    own, fleet = process_metrics(), fleet_metrics()
    assert not set(own) & set(fleet)
    return {**own, **fleet}


def scraped_names(name: str, kind: str) -> set[str]:
    """The names under which a scrape shows the metric `name` of type `kind`."""
    if kind == "histogram":
        return {name, f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return {name}


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def metrics_table() -> list[tuple[str, str, tuple[str, ...]]]:
    """(name, type, labels) of each row of the table in docs/operations.md's Metrics section."""
    lines = OPERATIONS.read_text().splitlines()
    start = lines.index("### Metrics") + 1
    end = next((i for i in range(start, len(lines)) if _HEADING.match(lines[i])), len(lines))
    rows = []
    for line in lines[start:end]:
        row = _ROW.match(line)
        if row:
            labels = tuple(label.strip() for label in row.group(3).split(",") if label.strip())
            rows.append((row.group(1), row.group(2), labels))
    return rows


def test_every_iris_metric_is_defined_in_extproc_metrics():
    """The default registry holds no `iris_*` metric that extproc.metrics does not define."""
    assert registered_names() == set(process_metrics())


def test_every_metric_name_in_the_docs_is_exported():
    known = {scraped for name, (kind, _) in exported().items() for scraped in scraped_names(name, kind)}
    unknown = []
    for path in markdown_files():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for name in _NAME.findall(line):
                if name not in known and name not in NOT_METRICS:
                    unknown.append(f"{path.relative_to(ROOT)}:{number}: {name}")
    assert unknown == [], "named in the docs but not exported:\n" + "\n".join(unknown)


def test_the_metrics_table_lists_exactly_the_exported_metrics():
    rows = metrics_table()
    names = [name for name, _, _ in rows]
    assert len(names) == len(set(names)), sorted(name for name in names if names.count(name) > 1)
    documented = {name: (kind, labels) for name, kind, labels in rows}
    code = exported()
    undocumented, unknown = sorted(set(code) - set(documented)), sorted(set(documented) - set(code))
    assert not undocumented, f"exported but not in the docs/operations.md Metrics table: {undocumented}"
    assert not unknown, f"in the docs/operations.md Metrics table but not exported: {unknown}"
    wrong = {name: {"docs": documented[name], "code": code[name]} for name in code if documented[name] != code[name]}
    assert not wrong, f"type or labels differ: {wrong}"


def test_the_table_is_parsed():
    """The table parser sees the table (a reformatted table must not pass by matching nothing)."""
    assert len(metrics_table()) >= 30
