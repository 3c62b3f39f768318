"""The Envoy bootstrap rendered from the routing config (extproc.config.envoy_render and
`iris-extproc envoy-config`): it agrees with the config by envoy_check, and real Envoy accepts it."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from extproc.config import envoy_check, parse_config
from extproc.config.envoy_render import RenderError, render
from extproc.config.examples import envoy_yaml
from irislab.processes import envoy_binary


def fleet() -> dict:
    return {
        "redis": {"url": "redis://127.0.0.1:6379/0"},
        "server": {"listen": "0.0.0.0:50099", "workers": 2, "routing_header": "x-route-to", "affinity_header": "x-replica-key"},
        "session": {"trusted_identity_headers": ["x-auth-user"]},
        "providers": [
            {"name": "pool", "kind": "managed", "cluster": "pool", "sessionless_cluster": "pool-spread",
             "endpoints": ["http://127.0.0.11:8080", "http://127.0.0.12:8080"],
             "models": {"m": {"features": ["chat", "embeddings"], "limits": {"max_global_in_flight_request_slots": 8}}}},
            {"name": "dyn", "kind": "managed", "cluster": "dyn", "affinity": "own_router", "router_session_header": "dynamo",
             "endpoints": ["http://dynamo-frontend.inference.svc:8000"], "health_check": {"url": "http://dynamo-frontend.inference.svc:8000/healthz"},
             "models": {"m": {"features": ["chat"]}}},
            {"name": "tensorx", "kind": "unlimited", "cluster": "tensorx", "models": {"m": {"features": ["chat"]}}},
        ],
    }


def template() -> dict:
    return envoy_check.load_bootstrap(envoy_yaml())


def test_the_rendered_bootstrap_agrees_with_its_config_and_envoy_accepts_it(tmp_path):
    config = parse_config(fleet())
    bootstrap = render(config, template())
    assert envoy_check.check(config, bootstrap) == []
    clusters = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}
    assert list(clusters) == ["extproc", "pool", "pool-spread", "dyn", "tensorx"]  # iris-1, iris-2 of the template dropped
    # One endpoint per worker (server.workers 2: ports 50099 and 50100), balanced per stream.
    assert [e["endpoint"]["address"]["socket_address"] for e in clusters["extproc"]["load_assignment"]["endpoints"][0]["lb_endpoints"]] == \
        [{"address": "127.0.0.1", "port_value": 50099}, {"address": "127.0.0.1", "port_value": 50100}]
    assert clusters["extproc"]["lb_policy"] == "LEAST_REQUEST"
    pool, spread, dyn = clusters["pool"], clusters["pool-spread"], clusters["dyn"]
    assert (pool["type"], pool["lb_policy"], spread["lb_policy"], dyn["type"], dyn["lb_policy"]) == \
        ("STATIC", "MAGLEV", "LEAST_REQUEST", "STRICT_DNS", "LEAST_REQUEST")
    assert len(pool["load_assignment"]["endpoints"][0]["lb_endpoints"]) == 2
    assert pool["health_checks"][0]["http_health_check"]["path"] == "/health"
    assert dyn["health_checks"][0]["http_health_check"]["path"] == "/healthz"
    assert pool["circuit_breakers"] == template()["static_resources"]["clusters"][1]["circuit_breakers"]  # the template's settings
    assert clusters["tensorx"] == {c["name"]: c for c in template()["static_resources"]["clusters"]}["tensorx"]  # no endpoints: kept
    manager = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    route = manager["route_config"]["virtual_hosts"][0]["routes"][0]
    assert route["route"]["cluster_header"] == "x-route-to" and route["match"]["headers"][0]["name"] == "x-route-to"
    assert route["route"]["hash_policy"] == [{"header": {"header_name": "x-replica-key"}}]
    removed = [m["remove"] for m in manager["early_header_mutation_extensions"][0]["typed_config"]["mutations"]]
    assert removed == ["x-route-to", "x-replica-key", "x-auth-user"]
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(bootstrap))
    result = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


def test_https_endpoints_get_tls_with_sni():
    data = fleet()
    data["providers"][2].update(endpoints=["https://api.tensorx.example"])
    bootstrap = render(parse_config(data), template())
    tensorx = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}["tensorx"]
    address = tensorx["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    assert address == {"address": "api.tensorx.example", "port_value": 443}
    assert tensorx["transport_socket"]["typed_config"]["sni"] == "api.tensorx.example"
    assert "health_checks" not in tensorx  # a third party is never checked


def test_a_provider_without_endpoints_needs_its_cluster_in_the_template():
    data = fleet()
    data["providers"][2]["cluster"] = "nowhere"
    with pytest.raises(RenderError, match="tensorx has no endpoints and the template has no cluster 'nowhere'"):
        render(parse_config(data), template())


def test_the_command_writes_a_file_that_check_accepts(tmp_path):
    config_path = tmp_path / "routing.yaml"
    config_path.write_text(yaml.safe_dump(fleet()))
    out = tmp_path / "envoy.yaml"
    rendered = subprocess.run([sys.executable, "-m", "extproc.cli", "envoy-config", "--config", str(config_path), "--output", str(out)],
                              capture_output=True, text=True, timeout=60)
    assert rendered.returncode == 0, rendered.stderr
    assert out.read_text().startswith("# Rendered by `iris-extproc envoy-config")
    checked = subprocess.run([sys.executable, "-m", "extproc.cli", "check", "--config", str(config_path), "--envoy", str(out)],
                             capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0 and checked.stdout.startswith("ok:"), checked.stdout + checked.stderr
