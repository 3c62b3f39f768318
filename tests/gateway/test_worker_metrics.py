"""`serve --workers 2` behind one metrics port (issue 22): a real Prometheus scraping only
`server.metrics_listen` sees every decision of both workers counted once, the fleet gauges once,
the build info once, and evaluates every shipped alert rule (deploy/prometheus/alerts.yaml)
without error; both workers' log lines are JSON (IRIS_LOG_FORMAT=json) naming the worker."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
import redis
import yaml

from irislab.local_gateway import LocalGateway, ProviderSimulation
from tests.gateway.test_workers import children, decisions_in
from tests.support.gateway import chat_body, gateway_config, wait_until
from tests.support.prometheus import Prometheus, prometheus_binary

ALERTS = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "alerts.yaml"
BOUND = 30.0  # seconds: a generous bound for conditions that normally hold within a few seconds
ENVOY_THREADS = 8  # Envoy threads: each balances its streams over both workers' ports


@pytest.mark.slow
def test_prometheus_counts_each_decision_of_two_workers_once_through_one_port(tmp_path):
    binary = prometheus_binary()
    metrics_dir = tmp_path / "multiproc"
    sims = {name: ProviderSimulation(ttft_ms=1, per_token_ms=1) for name in ("iris-1", "iris-2", "tensorx")}
    gateway = LocalGateway(config_data=gateway_config(), simulations=sims, work_dir=tmp_path / "gateway", workers=2,
                           envoy_concurrency=ENVOY_THREADS, env={"IRIS_LOG_FORMAT": "json", "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)})
    with gateway:
        instance = gateway.running[0]
        client = redis.Redis.from_url(gateway.redis_url)
        assert wait_until(lambda: client.zcard("{e2e}:instances") == 2, within_seconds=BOUND)
        workers = children(instance.extproc.pid)
        assert len(workers) == 2
        prometheus = Prometheus(binary, tmp_path / "prometheus", [f"127.0.0.1:{instance.metrics_port}"], interval_seconds=0.5,
                                rule_files=[ALERTS])
        try:
            sent = 0

            def each_worker_decided() -> bool:
                """Send 10 more requests, each on a new connection (so on any Envoy thread);
                True once both workers' files count decisions."""
                nonlocal sent
                for _ in range(10):
                    response = httpx.post(f"{instance.url}/v1/chat/completions", json=chat_body("hi", max_tokens=2),
                                          headers={"x-user-id": f"user-{sent}"}, timeout=30)
                    assert response.status_code == 200, response.text
                    sent += 1
                counts = [decisions_in(metrics_dir / f"counter_{pid}.db") for pid in workers]
                return all(counts) and sum(counts) == sent

            assert wait_until(each_worker_decided, within_seconds=120, interval_seconds=0), sent

            def scraped(expr: str) -> float | None:
                result = prometheus.query(expr)
                return float(result[0]["value"][1]) if result else None

            assert wait_until(lambda: scraped("sum(iris_routing_decisions_total)") == sent, BOUND), (
                scraped("sum(iris_routing_decisions_total)"), sent)
            assert scraped("count(up)") == 1
            # Each worker's decisions count once: the series are not split or doubled by worker.
            by_kind = {r["metric"]["kind"]: float(r["value"][1]) for r in prometheus.query("sum by (kind) (iris_routing_decisions_total)")}
            assert sum(by_kind.values()) == sent and set(by_kind) <= {"managed", "unlimited"}
            assert scraped("count(iris_build_info)") == 1 and scraped("max(iris_live_instances)") == 2
            pairs = sum(len(gateway.config.providers_for(model)) for model in gateway.config.models())
            assert scraped("count(iris_in_flight_requests)") == pairs  # each pair once, not once per worker
            assert scraped("sum(iris_lease_renewals_total)") is not None

            # Every alert rule evaluates against the live series without error; nothing critical
            # holds, and the third-party share (decisions with kind="unlimited": past the own
            # providers' pin limits every new session goes there) is on its way to firing.
            def evaluated() -> list[dict] | None:
                rules = prometheus.rules()
                return rules if rules and all(r["health"] == "ok" and r["evaluationTime"] > 0 for r in rules) else None

            rules = wait_until(evaluated, BOUND)
            assert rules, prometheus.rules()
            assert {r["name"] for r in rules} == {r["alert"] for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]}
            # An evaluation made before the first scrape holds `absent(...)` pending until the next one.
            def critical_states() -> tuple[str, str]:
                state = {r["name"]: r["state"] for r in prometheus.rules()}
                return state["IrisExtprocMetricsAbsent"], state["IrisRedisBreakerOpen"]

            wait_until(lambda: critical_states() == ("inactive", "inactive"), BOUND, 0.2)
            assert critical_states() == ("inactive", "inactive")

            def unlimited_share_pending() -> bool:
                response = httpx.post(f"{instance.url}/v1/chat/completions", json=chat_body("hi", max_tokens=2),
                                      headers={"x-user-id": f"later-{time.monotonic()}"}, timeout=30)
                assert response.headers["x-iris-provider"] == "tensorx"
                return {r["name"]: r for r in prometheus.rules()}["IrisUnlimitedShareHigh"]["state"] == "pending"

            assert wait_until(unlimited_share_pending, BOUND, 0.2), prometheus.query("sum by (kind) (rate(iris_routing_decisions_total[15m]))")
        finally:
            prometheus.stop()
        # Worker 0 alone serves metrics: the port after it is not a second endpoint.
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{instance.metrics_port + 1}/metrics", timeout=2)

        lines = [line for line in instance.extproc.log_path.read_text(errors="replace").splitlines() if line.strip()]
        records = [json.loads(line) for line in lines if line.startswith("{")]
        assert len(records) >= 4 and all({"time", "level", "logger", "message", "pid"} <= set(r) for r in records)
        by_worker = {r["worker"]: r["pid"] for r in records if "worker" in r}
        assert sorted(by_worker) == [0, 1] and sorted(by_worker.values()) == sorted(workers)
        assert any(r["message"].startswith("supervising 2 ext_proc workers") and "worker" not in r for r in records)
