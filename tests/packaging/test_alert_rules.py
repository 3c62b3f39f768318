"""The shipped alert rules (issue 22): deploy/prometheus/alerts.yaml passes `promtool check rules`
(Debian's prometheus package has it), the PrometheusRule of deploy/kubernetes/monitoring carries
the same groups and passes too, every metric an expression names is one the server exports, and
every alert says how bad it is and what it means. (tests/gateway/test_worker_metrics.py loads
them into a Prometheus scraping a gateway: every rule evaluates without error.)"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

from tests.docs.test_metric_names import exported, scraped_names
from tests.support.prometheus import promtool_binary

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yaml"
PROMETHEUS_RULE = ROOT / "deploy" / "kubernetes" / "monitoring" / "prometheus-rule.yaml"
SEVERITIES = {"critical", "warning", "info"}

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENTIFIER = re.compile(r"(?<![0-9.])[a-zA-Z_:][a-zA-Z0-9_:]*")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan", "by", "without", "on", "ignoring", "group_left", "group_right"}


def rules(groups: dict) -> list[dict]:
    return [rule for group in groups["groups"] for rule in group["rules"]]


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: its identifiers once strings, label
    matchers, ranges and grouping clauses are removed, less functions (followed by a
    parenthesis) and keywords."""
    text = _GROUPING.sub(" ", _RANGE.sub(" ", _MATCHERS.sub(" ", _STRING.sub(" ", expr))))
    names = set()
    for match in _IDENTIFIER.finditer(text):
        if text[match.end():].lstrip().startswith("(") or match.group().lower() in _KEYWORDS:
            continue
        names.add(match.group())
    return names


def promtool_check(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([promtool_binary(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)


def test_promtool_accepts_the_rule_file():
    result = promtool_check(ALERTS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules(yaml.safe_load(ALERTS.read_text())))} rules found" in result.stdout


def test_the_prometheus_rule_carries_the_same_groups_and_promtool_accepts_them(tmp_path):
    resource = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert resource["spec"] == yaml.safe_load(ALERTS.read_text())
    extracted = tmp_path / "from-prometheus-rule.yaml"
    extracted.write_text(yaml.safe_dump(resource["spec"]))
    result = promtool_check(extracted)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_rejects_a_broken_rule(tmp_path):
    """The check can fail: an expression that does not parse is refused."""
    broken = yaml.safe_load(ALERTS.read_text())
    broken["groups"][0]["rules"][0]["expr"] = "sum by (provider (iris_in_flight_requests)"
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(broken))
    assert promtool_check(path).returncode != 0


def test_the_expressions_name_only_metrics_the_server_exports():
    known = {scraped for name, (kind, _) in exported().items() for scraped in scraped_names(name, kind)}
    named = {rule["alert"]: metric_names(rule["expr"]) for rule in rules(yaml.safe_load(ALERTS.read_text()))}
    assert all(named.values()), named
    unknown = {alert: sorted(names - known) for alert, names in named.items() if names - known}
    assert unknown == {}, f"alert expressions name metrics that are not exported: {unknown}"


def test_the_name_reader_sees_every_selected_metric():
    expr = ('sum by (gen_ai_request_model) (rate(iris_rejections_total{code=~"a|b"}[5m]) or rate(made_up_total[5m]))'
            ' / on (x) group_left max(iris_in_flight_requests offset 5m) > bool 0.9')
    assert metric_names(expr) == {"iris_rejections_total", "made_up_total", "iris_in_flight_requests"}


def test_every_alert_has_a_severity_a_summary_and_a_description():
    for rule in rules(yaml.safe_load(ALERTS.read_text())):
        assert re.fullmatch(r"Iris[A-Za-z]+", rule["alert"]), rule["alert"]
        assert rule["labels"]["severity"] in SEVERITIES, rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
