"""What an operator sees: the fleet-state gauges against Redis and the providers' own in-flight
counts during a load, the routing metadata in Envoy's access log, `iris-extproc status` (and its
failures, without a traceback), and every query of the Grafana dashboard against a real
Prometheus scraping the gateway under load. Two proxy instances share one Redis."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import uuid
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from extproc import cli
from tests.support.gateway import LIMITS, MODEL, chat_body, clear_routing_state, post, provider_stats, redis_client, start_gateway, wait_until
from tests.support.prometheus import Prometheus, prometheus_binary

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docs" / "grafana" / "iris-extproc.json"
INSTANCES = 2
BOUND = 20.0  # seconds: a generous bound for a condition that normally holds within a second or two
LONG_TOKENS = 2000  # 20 ms a token: a stream lasts 40 s unless the client leaves first


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    gw = start_gateway(tmp_path_factory.mktemp("observability"), instances=INSTANCES)
    yield gw
    gw.stop()


@pytest.fixture
def gw(gateway):
    """The shared gateway with empty routing state (the instances heartbeat back in) and reset
    provider counters."""
    clear_routing_state(redis_client(gateway))
    for name in gateway.providers:
        httpx.post(f"{gateway.provider_url(name)}/stats/reset", timeout=5)
    assert wait_until(lambda: fleet_gauges(gateway, 0).get(("iris_live_instances", ())) == INSTANCES, BOUND)
    return gateway


def scrape(gw, instance: int) -> dict[tuple[str, tuple], float]:
    """One instance's /metrics as {(sample name, sorted label items): value}."""
    text = httpx.get(gw.running[instance].metrics_url, timeout=10).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


FLEET_GAUGES = ("iris_in_flight_", "iris_pinned_", "iris_degraded", "iris_live_instances", "iris_fleet_state_up")


def fleet_gauges(gw, instance: int) -> dict[tuple[str, tuple], float]:
    """The fleet-state gauges (read from Redis) of one instance."""
    return {key: value for key, value in scrape(gw, instance).items() if key[0].startswith(FLEET_GAUGES)}


KINDS = {"iris-1": "managed", "iris-2": "managed", "tensorx": "unlimited"}


def pair_value(gauges: dict, name: str, provider: str, model: str = MODEL) -> float | None:
    return gauges.get((name, (("gen_ai_request_model", model), ("kind", KINDS[provider]), ("provider", provider))))


def redis_counts(gw, provider: str, model: str = MODEL) -> tuple[int, int]:
    """(live leases, live pins) of the pair, straight from Redis."""
    client = redis_client(gw)
    seconds, micros = client.time()
    live = f"({seconds * 1000 + micros // 1000}"
    tag = "{e2e:" + model + "}"
    return client.zcount(f"{tag}:leases:{provider}", live, "+inf"), client.zcount(f"{tag}:pins:{provider}", live, "+inf")


@contextmanager
def long_streams(gw, users: list[str]):
    """Streamed requests of `users` (new sessions), alternating over the instances, held open
    until the block ends (then the client leaves: Envoy resets, the leases are released).
    Yields the provider that serves each."""
    with ExitStack() as stack:
        http = stack.enter_context(httpx.Client(timeout=30))
        providers = []
        for i, user in enumerate(users):
            url = f"{gw.running[i % INSTANCES].url}/v1/chat/completions"
            response = stack.enter_context(
                http.stream("POST", url, json=chat_body("tell me more", max_tokens=LONG_TOKENS, stream=True), headers={"x-user-id": user})
            )
            assert response.status_code == 200
            lines = response.iter_lines()
            next(lines)  # the first chunk: the provider runs the request
            stack.callback(lambda lines=lines: lines)  # kept: a dropped iterator closes the response
            providers.append(response.headers["x-iris-provider"])
        yield providers


def test_gauges_agree_with_redis_and_the_providers_during_a_load(gw, capsys):
    users = [f"load-{i}" for i in range(7)]
    with long_streams(gw, users) as served:
        providers = sorted(gw.providers)
        expected = {name: served.count(name) for name in providers}
        # New sessions use unreserved slots only: two per own provider, the rest on the third party.
        assert expected == {"iris-1": 2, "iris-2": 2, "tensorx": 3}

        def agreeing():
            views = [fleet_gauges(gw, i) for i in range(INSTANCES)]
            stats = {name: provider_stats(gw, name)["in_flight_by_model"].get(MODEL, 0) for name in providers}
            for name in providers:
                leases, _ = redis_counts(gw, name)
                if not all(pair_value(v, "iris_in_flight_requests", name) == leases == stats[name] == expected[name] for v in views):
                    return None
            return views

        views = wait_until(agreeing, BOUND)
        assert views, (fleet_gauges(gw, 0), [provider_stats(gw, n) for n in providers])
        assert views[0] == views[1]  # every instance reports the same fleet-wide state
        gauges = views[0]
        for name in providers:
            leases, pins = redis_counts(gw, name)
            assert pair_value(gauges, "iris_pinned_sessions", name) == pins == expected[name]
        for name in ("iris-1", "iris-2"):
            assert pair_value(gauges, "iris_in_flight_request_limit", name) == LIMITS["max_global_in_flight_request_slots"]
            assert pair_value(gauges, "iris_pinned_session_limit", name) == LIMITS["max_pinned_sessions"]
            assert pair_value(gauges, "iris_in_flight_request_reserved_slots", name) == 1
            assert provider_stats(gw, name)["max_in_flight_by_model"][MODEL] <= LIMITS["max_global_in_flight_request_slots"]
            assert gauges[("iris_degraded", (("gen_ai_request_model", MODEL), ("kind", "managed"), ("provider", name), ("source", "health")))] == 0
        assert pair_value(gauges, "iris_in_flight_request_limit", "tensorx") is None  # unlimited
        assert gauges[("iris_live_instances", ())] == INSTANCES and gauges[("iris_fleet_state_up", ())] == 1

        # `status` reads the same state.
        config = str(gw.running[0].config_path)
        capsys.readouterr()
        assert cli.main(["status", "--config", config, "--json"]) == 0
        document = json.loads(capsys.readouterr().out)
        assert document["live_instances"] == INSTANCES
        by_pair = {(p["provider"], p["model"]): p for p in document["pairs"]}
        for name in providers:
            pair = by_pair[(name, MODEL)]
            assert (pair["in_flight"], pair["pins"]) == (expected[name], expected[name])
        assert by_pair[("iris-1", MODEL)]["in_flight_limit"] == LIMITS["max_global_in_flight_request_slots"]
        assert by_pair[("tensorx", MODEL)]["in_flight_limit"] is None
        assert cli.main(["status", "--config", config]) == 0
        lines = {tuple(line.split()[:3]): line for line in capsys.readouterr().out.splitlines()}
        assert lines[("iris-1", "managed", MODEL)].split()[3:6] == ["2/3", "2/2", "healthy"]
        assert lines[("tensorx", "unlimited", MODEL)].split()[3:5] == ["3/-", "3/100000"]  # max_pinned_sessions_unlimited
        assert lines[("live", "proxy", "instances:")].endswith(f" {INSTANCES}")

    # The clients left: the leases are released, the pins stay.
    def released():
        gauges = fleet_gauges(gw, 1)
        return all(pair_value(gauges, "iris_in_flight_requests", n) == 0 == redis_counts(gw, n)[0] for n in gw.providers)

    assert wait_until(released, BOUND)
    assert pair_value(fleet_gauges(gw, 0), "iris_pinned_sessions", "iris-1") == 2
    decisions = [scrape(gw, i) for i in range(INSTANCES)]
    routed = sum(v for d in decisions for (name, _), v in d.items() if name == "iris_routing_decisions_total")
    assert routed >= len(users)


def test_a_drained_pair_shows_in_the_gauges_and_in_status(gw, capsys):
    config = str(gw.running[0].config_path)
    assert cli.main(["drain", "iris-2", "--config", config, "--reason", "kernel upgrade", "--ttl-seconds", "600"]) == 0
    key = ("iris_degraded", (("gen_ai_request_model", MODEL), ("kind", "managed"), ("provider", "iris-2"), ("source", "manual")))
    assert wait_until(lambda: fleet_gauges(gw, 0)[key] == 1, BOUND)
    capsys.readouterr()
    assert cli.main(["status", "--config", config, "--json"]) == 0
    pair = next(p for p in json.loads(capsys.readouterr().out)["pairs"] if (p["provider"], p["model"]) == ("iris-2", MODEL))
    assert pair["state"] == "drained"
    (flag,) = pair["flags"]
    assert flag["source"] == "manual" and flag["reason"] == "manual: kernel upgrade" and 0 < flag["ttl_seconds"] <= 600
    assert cli.main(["undrain", "iris-2", "--config", config]) == 0
    assert wait_until(lambda: fleet_gauges(gw, 0)[key] == 0, BOUND)


def access_log_entry(gw, probe: str) -> dict | None:
    """The access-log entry (JSON) of instance 0's Envoy whose path carries `probe`."""
    for line in gw.running[0].envoy.log_path.read_text(errors="replace").splitlines():
        if probe in line and line.startswith("{"):
            return json.loads(line)
    return None


def test_the_access_log_carries_the_provider_the_reason_and_the_decision_time(gw):
    probe = uuid.uuid4().hex
    # The query string never reaches the log (issue 15): the entry is found by its user agent.
    response = post(gw, f"/v1/chat/completions?secret={probe}", user="logged", json=chat_body("hi"),
                    headers={"user-agent": f"probe-{probe}"})
    assert response.status_code == 200
    entry = wait_until(lambda: access_log_entry(gw, probe), BOUND)
    assert entry, gw.running[0].envoy.log_tail()
    assert entry["path"] == "/v1/chat/completions" and entry["user_agent"] == f"probe-{probe}"
    assert (entry["provider"], entry["reason"]) == (response.headers["x-iris-provider"], response.headers["x-iris-route-reason"])
    assert entry["cluster"] == entry["provider"] == "iris-1" and entry["reason"] == "new_pin"
    assert isinstance(entry["decision_ms"], (int, float)) and entry["decision_ms"] >= 0

    rejected = uuid.uuid4().hex
    response = post(gw, "/v1/chat/completions", user="logged", json={**chat_body("hi"), "model": "no-such-model"},
                    headers={"user-agent": f"probe-{rejected}"})
    assert response.status_code == 404
    entry = wait_until(lambda: access_log_entry(gw, rejected), BOUND)
    assert entry and entry["iris_code"] == response.json()["error"]["code"] and entry["provider"] is None


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "extproc.cli", *args], capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_status_without_a_reachable_redis_is_one_line_without_a_traceback(tmp_path, gateway):
    data = yaml.safe_load(gateway.running[0].config_path.read_text())
    refused = socket.socket()
    refused.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)  # accepts into the backlog, never answers: commands time out
    try:
        for sock, words in ((refused, "connect"), (silent, "timeout")):
            port = sock.getsockname()[1]
            data["redis"] = {**data["redis"], "url": f"redis://user:secret-password@127.0.0.1:{port}/0", "socket_timeout_seconds": 0.3}
            config = tmp_path / f"routing-{port}.yaml"
            config.write_text(yaml.safe_dump(data))
            for extra in ((), ("--json",)):
                result = run_cli("status", "--config", str(config), *extra)
                assert result.returncode == 1, result
                assert result.stdout == "" and "Traceback" not in result.stderr
                (line,) = result.stderr.strip().splitlines()
                assert line.startswith(f"iris-extproc: cannot read the routing state from Redis at 127.0.0.1:{port}: ")
                assert words in line.lower() and "secret-password" not in line
    finally:
        refused.close()
        silent.close()


def dashboard_variables() -> dict[str, dict]:
    """The dashboard's variables other than the data source, by name."""
    return {v["name"]: v for v in json.loads(DASHBOARD.read_text())["templating"]["list"] if v["type"] != "datasource"}


def test_dashboard_variables_are_label_values_of_exported_metrics():
    """No text box to fill in by hand (issue 22): each variable lists a label's values from
    Prometheus, with "All" sent as `.*`."""
    variables = dashboard_variables()
    assert set(variables) == {"provider", "model"}
    for variable in variables.values():
        assert variable["type"] == "query" and variable["includeAll"] and variable["allValue"] == ".*"
        assert re.fullmatch(r"label_values\(iris_[a-z_]+(\{[^}]*\})?, [a-z_]+\)", variable["query"]["query"]), variable
        assert variable["definition"] == variable["query"]["query"]


def label_values_query(query: str) -> tuple[str, str]:
    """`label_values(selector, label)` -> (selector, label)."""
    selector, label = re.fullmatch(r"label_values\((.+), ([a-z_]+)\)", query).groups()
    return selector, label


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of the dashboard, with Grafana's variables replaced
    by what Grafana would send (each variable's "All", a 1 m rate interval)."""
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {name: v["allValue"] for name, v in dashboard_variables().items()}
    queries = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$__rate_interval", "1m")
            for name, value in variables.items():
                expr = expr.replace(f"${name}", value)
            assert "$" not in expr, (panel["title"], expr)
            queries.append((panel["title"], expr))
    return queries


@pytest.mark.slow
def test_every_dashboard_query_returns_data_from_a_real_prometheus(gw, tmp_path):
    binary = prometheus_binary()
    prometheus = Prometheus(binary, tmp_path / "prometheus", [f"127.0.0.1:{i.metrics_port}" for i in gw.running])
    try:
        with long_streams(gw, [f"dash-{i}" for i in range(4)]):
            # Traffic of every kind meanwhile: pinned turns, an offload (the pin's per-session slot
            # is held by its stream), a capacity rejection ("solo" allows one pin) and a 404.
            queries = dashboard_queries()

            def traffic_round(i: int) -> None:
                post(gw, "/v1/chat/completions", user="dash-0", instance=i % INSTANCES, json=chat_body("again"))
                post(gw, "/v1/chat/completions", user=f"turns-{i % 3}", json=chat_body("again"))
                post(gw, "/v1/chat/completions", user=f"solo-{i % 2}", json={**chat_body("x"), "model": "solo"})
                post(gw, "/v1/chat/completions", user="nobody", json={**chat_body("x"), "model": "absent"})

            rounds = iter(range(10_000))

            def every_query_has_data():
                traffic_round(next(rounds))
                empty = [(title, expr) for title, expr in queries if not prometheus.query(expr)]
                return empty == [] or None

            assert wait_until(every_query_has_data, 45, 0.2), [
                (title, expr) for title, expr in queries if not prometheus.query(expr)
            ]
            # Each variable's list, as Grafana asks Prometheus for it, names what the gateway serves.
            for name, variable in dashboard_variables().items():
                selector, label = label_values_query(variable["query"]["query"].replace("$provider", ".*"))
                answer = httpx.get(f"{prometheus.url}/api/v1/label/{label}/values", params={"match[]": selector}, timeout=10).json()
                expected = {"provider": set(gw.providers), "model": {MODEL, "solo"}}[name]
                assert expected <= set(answer["data"]), (name, answer)
            in_flight = prometheus.query('max by (provider) (iris_in_flight_requests{gen_ai_request_model="%s"})' % MODEL)
            assert {r["metric"]["provider"]: float(r["value"][1]) for r in in_flight}["iris-1"] <= LIMITS["max_global_in_flight_request_slots"]
    finally:
        prometheus.stop()
