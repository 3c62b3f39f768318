"""Affinity pick in the configuration: validation, the rendered Envoy cluster (override_host, run
through `envoy --mode validate`) and `check` of a cluster that cannot take the pick."""

from __future__ import annotations

import copy
import subprocess

import pytest
import yaml

from extproc.config import ConfigError, envoy_check, parse_config
from extproc.config.envoy_render import render
from extproc.config.examples import envoy_yaml
from irislab.processes import envoy_binary

HEADER = "x-gateway-destination-endpoint"


def fleet(**pool) -> dict:
    provider = {"name": "pool", "kind": "managed", "cluster": "pool", "affinity": "pick",
                "endpoints": ["http://127.0.0.11:8080", "http://127.0.0.12:8080", "http://localhost:8081"],
                "models": {"m": {"features": ["chat"], "limits": {"max_global_in_flight_request_slots": 8},
                                 "max_in_flight_per_endpoint": 2}}}
    provider.update(pool)
    return {
        "redis": {"url": "redis://127.0.0.1:6379/0"},
        "server": {"listen": "0.0.0.0:50099"},
        "providers": [provider, {"name": "tensorx", "kind": "unlimited", "cluster": "tensorx", "models": {"m": {"features": ["chat"]}}}],
    }


def problems(data: dict) -> list[str]:
    with pytest.raises(ConfigError) as raised:
        parse_config(data)
    return raised.value.problems


def test_pick_needs_endpoints_that_name_distinct_replicas():
    assert any("affinity pick needs the provider's endpoints" in p for p in problems(fleet(endpoints=[])))
    doubled = problems(fleet(endpoints=["http://127.0.0.11:8080", "http://127.0.0.11:8080/"]))
    assert any("127.0.0.11:8080 listed more than once" in p for p in doubled)
    assert any("does not resolve" in p for p in problems(fleet(endpoints=["http://127.0.0.11:8080", "http://no-such-host.invalid:8080"])))
    # One DNS name is a headless Service, resolved while serving: it may have no ready replica yet.
    assert parse_config(fleet(endpoints=["http://no-such-host.invalid:8080"])).providers[0].endpoints == ["http://no-such-host.invalid:8080"]


def test_pick_needs_limits_so_that_every_request_takes_a_lease():
    data = fleet()
    del data["providers"][0]["models"]["m"]["limits"]
    assert any("models.m.limits: affinity pick counts each endpoint's requests" in p for p in problems(data))
    data["providers"][0]["models"]["m"]["limits"] = {}
    assert parse_config(data).providers[0].limits("m") is not None


def test_pick_is_the_default_for_a_managed_provider_with_endpoints():
    """Since it beat the hash on both of bench.real_engines's workloads (docs/benchmarks.md):
    `endpoints` without `affinity` pick; a `sessionless_cluster` (a hashed pool's) or no
    `endpoints` keeps the hash; a third party gets no session key."""
    data = fleet()
    del data["providers"][0]["affinity"]
    config = parse_config(data)
    assert [(p.session_affinity.value, p.picks) for p in config.providers] == [("pick", True), ("none", False)]
    hashed = copy.deepcopy(data)
    del hashed["providers"][0]["models"]["m"]["max_in_flight_per_endpoint"]
    hashed["providers"][0]["sessionless_cluster"] = "pool-spread"
    assert not parse_config(hashed).providers[0].picks
    hashed["providers"][0].pop("sessionless_cluster")
    hashed["providers"][0]["endpoints"] = []
    assert parse_config(hashed).providers[0].session_affinity.value == "session_hash"
    del data["providers"][0]["models"]["m"]["limits"]
    assert any("or affinity session_hash" in p for p in problems(data)), "the error says how to keep the hash"


def test_the_cap_per_endpoint_is_for_pick_only():
    data = fleet(affinity="session_hash")
    assert any("max_in_flight_per_endpoint: only with affinity pick" in p for p in problems(data))
    third_party = fleet()
    third_party["providers"][1].update(affinity="pick", endpoints=["http://127.0.0.20:80"])
    assert any("never receives a session key" in p for p in problems(third_party))


def test_the_placement_weights_are_config_with_defaults():
    config = parse_config(fleet())
    placement = config.routing.placement
    assert (placement.prefix_weight, placement.load_weight, placement.block_chars) == (4.0, 1.0, 256)
    assert any("load_weight" in p for p in problems({**fleet(), "routing": {"placement": {"load_weight": 0}}}))


def test_the_rendered_pick_cluster_takes_the_pick_and_envoy_accepts_it(tmp_path):
    config = parse_config(fleet())
    bootstrap = render(config, envoy_check.load_bootstrap(envoy_yaml()))
    assert envoy_check.check(config, bootstrap) == []
    pool = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}["pool"]
    assert pool["type"] == "STATIC" and "lb_policy" not in pool
    hosts = [e["endpoint"]["address"]["socket_address"] for e in pool["load_assignment"]["endpoints"][0]["lb_endpoints"]]
    assert hosts[2] == {"address": "127.0.0.1", "port_value": 8081}, "a host name is resolved once, to the ip:port the router names"
    policy = pool["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    assert policy["name"] == "envoy.load_balancing_policies.override_host"
    assert policy["typed_config"]["override_host_sources"][0] == {"header": HEADER}
    manager = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert {"remove": HEADER} in manager["early_header_mutation_extensions"][0]["typed_config"]["mutations"]
    ext_proc = next(f for f in manager["http_filters"] if f["name"] == envoy_check.EXT_PROC_FILTER)
    assert "envoy.lb" in ext_proc["typed_config"]["metadata_options"]["receiving_namespaces"]["untyped"]
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(bootstrap))
    result = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


def test_check_refuses_a_pool_cluster_that_cannot_take_the_pick():
    config = parse_config(fleet())
    good = render(config, envoy_check.load_bootstrap(envoy_yaml()))
    hashed = copy.deepcopy(good)
    pool = {c["name"]: c for c in hashed["static_resources"]["clusters"]}["pool"]
    del pool["load_balancing_policy"]
    pool["lb_policy"] = "MAGLEV"
    assert any("cannot take the router's pick" in p for p in envoy_check.check(config, hashed))
    short = copy.deepcopy(good)
    pool = {c["name"]: c for c in short["static_resources"]["clusters"]}["pool"]
    pool["load_assignment"]["endpoints"][0]["lb_endpoints"].pop()
    assert any("missing: 127.0.0.1:8081" in p for p in envoy_check.check(config, short))
    open_header = copy.deepcopy(good)
    manager = open_header["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    manager["early_header_mutation_extensions"][0]["typed_config"]["mutations"].remove({"remove": HEADER})
    assert any(f"no early header mutation removes {HEADER!r}" in p for p in envoy_check.check(config, open_header))


def test_one_dns_name_renders_a_strict_dns_cluster_that_check_accepts_and_envoy_runs(tmp_path):
    """Endpoints as one DNS name (a headless Service): the pool's cluster is STRICT_DNS over the
    name, refreshed on `routing.placement.dns_refresh_seconds`, so Envoy's hosts follow the
    name's addresses as the router's endpoints do; `check` accepts it and refuses a STATIC or
    LOGICAL_DNS cluster in its place (neither follows every address)."""
    data = fleet(endpoints=["http://localhost:8081"])
    data["routing"] = {"placement": {"dns_refresh_seconds": 2.5}}
    config = parse_config(data)
    bootstrap = render(config, envoy_check.load_bootstrap(envoy_yaml()))
    assert envoy_check.check(config, bootstrap) == []
    pool = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}["pool"]
    assert (pool["type"], pool["dns_lookup_family"], pool["dns_refresh_rate"]) == ("STRICT_DNS", "V4_PREFERRED", "2.5s")
    hosts = [e["endpoint"]["address"]["socket_address"] for e in pool["load_assignment"]["endpoints"][0]["lb_endpoints"]]
    assert hosts == [{"address": "localhost", "port_value": 8081}]
    assert pool["load_balancing_policy"]["policies"][0]["typed_extension_config"]["name"] == "envoy.load_balancing_policies.override_host"
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(bootstrap))
    result = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    for kind in ("STATIC", "LOGICAL_DNS"):
        wrong = copy.deepcopy(bootstrap)
        {c["name"]: c for c in wrong["static_resources"]["clusters"]}["pool"]["type"] = kind
        assert any("is not STRICT_DNS over localhost:8081" in p for p in envoy_check.check(config, wrong)), kind
    other_name = copy.deepcopy(bootstrap)
    {c["name"]: c for c in other_name["static_resources"]["clusters"]}["pool"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0][
        "endpoint"]["address"]["socket_address"]["address"] = "pool.other.svc"
    assert any("is not STRICT_DNS over localhost:8081" in p for p in envoy_check.check(config, other_name))


def test_a_pick_pool_over_https_verifies_each_replica_by_its_own_name(tmp_path):
    """Issue 29 item 14 for affinity pick: the pick cluster's STATIC endpoints keep the metadata
    that gives each its own host's transport socket (the host name as the URL writes it, when the
    identity is the address it resolved to); without it Envoy verified every replica against the
    first host's name, and `check` saw nothing. Real Envoy accepts it."""
    config = parse_config(fleet(endpoints=["https://127.0.0.11:8443", "https://127.0.0.12:8443", "https://localhost:8444"]))
    bootstrap = render(config, envoy_check.load_bootstrap(envoy_yaml()))
    assert envoy_check.check(config, bootstrap) == []
    pool = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}["pool"]
    endpoints = pool["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert [e["endpoint"]["address"]["socket_address"]["address"] for e in endpoints] == ["127.0.0.11", "127.0.0.12", "127.0.0.1"]
    assert [e["metadata"]["filter_metadata"]["envoy.transport_socket_match"] for e in endpoints] == \
        [{"host": "127.0.0.11"}, {"host": "127.0.0.12"}, {"host": "localhost"}]
    assert [m["match"] for m in pool["transport_socket_matches"]] == [{"host": "127.0.0.11"}, {"host": "127.0.0.12"}, {"host": "localhost"}]
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(bootstrap))
    result = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    one_host = render(parse_config(fleet(endpoints=["https://localhost:8443", "https://localhost:8444"])), envoy_check.load_bootstrap(envoy_yaml()))
    pool = {c["name"]: c for c in one_host["static_resources"]["clusters"]}["pool"]
    assert "transport_socket_matches" not in pool and "metadata" not in pool["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
