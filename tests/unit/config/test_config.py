"""Configuration validation: one message per problem, each naming its field path."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from extproc.config import ConfigError, load_config, parse_config
from tests.support.configs import small_config_data


def problems(data) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    return info.value.problems


def test_small_config_is_valid():
    config = parse_config(small_config_data())
    assert [p.name for p in config.providers_in_priority_order()] == ["iris-1", "iris-2", "tensorx"]
    assert [p.name for p in config.providers_for("e")] == ["iris-1", "tensorx"]
    assert config.pin_inactivity_timeout_seconds == 300
    assert config.lease_timeout_seconds == 30
    assert config.max_routing_attempts == 10


def test_unlimited_providers_come_after_managed_ones():
    data = small_config_data()
    data["providers"].insert(0, data["providers"].pop())
    assert [p.name for p in parse_config(data).providers_in_priority_order()] == ["iris-1", "iris-2", "tensorx"]


def test_negative_limit_names_the_field_path():
    data = small_config_data()
    data["providers"][1]["models"]["m"]["limits"] = {"max_pinned_sessions": -1}
    assert problems(data) == ["providers[1].models.m.limits.max_pinned_sessions: must be >= 0"]


def test_every_problem_is_reported():
    data = small_config_data()
    data["providers"][0]["models"]["m"]["limits"] = {
        "max_global_in_flight_request_slots": 2,
        "global_in_flight_request_slots_reserved_for_pinned_sessions": 3,
    }
    data["providers"][1]["name"] = "iris-1"
    data["providers"][2]["cluster"] = "iris-2"
    found = problems(data)
    assert "providers: duplicate provider name 'iris-1'" in found
    assert "providers: duplicate provider cluster 'iris-2'" in found
    assert (
        "providers[0].models.m.limits.global_in_flight_request_slots_reserved_for_pinned_sessions: "
        "must be <= max_global_in_flight_request_slots (2)"
    ) in found
    assert len(found) == 3


def test_schema_problems_are_all_listed():
    data = small_config_data(lease_timeout_seconds=0, surprise=1)
    del data["providers"][0]["kind"]
    found = problems(data)
    assert "lease_timeout_seconds: must be > 0" in found
    assert "surprise: unknown field" in found
    assert "providers[0].kind: is required" in found


def test_unlimited_provider_with_limits_is_rejected():
    data = small_config_data()
    data["providers"][2]["models"]["m"]["limits"] = {"max_pinned_sessions": 1}
    assert problems(data) == ["providers[2].models.m.limits: an unlimited provider has no limits (the spec)"]


def test_unknown_feature_and_brace_in_model_name():
    data = small_config_data()
    data["providers"][2]["models"]["b{x}"] = {"features": ["chat", "telepathy"]}
    found = problems(data)
    assert "providers[2].models.b{x}: a model name must be non-blank and hold no braces" in found
    assert "providers[2].models.b{x}.features: unknown feature(s) ['telepathy']" in found


def test_bad_yaml_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("providers: [\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.problems[0].startswith("<file>: not valid YAML")


def test_serve_refuses_a_bad_file_with_exit_code_2(tmp_path):
    data = small_config_data()
    data["providers"][1]["models"]["m"]["limits"] = {"max_pinned_sessions": -1}
    path = tmp_path / "routing.yaml"
    path.write_text(yaml.safe_dump(data))
    result = subprocess.run([sys.executable, "-m", "extproc.cli", "serve", "--config", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "providers[1].models.m.limits.max_pinned_sessions: must be >= 0" in result.stderr


def test_redis_topologies_are_validated_with_field_paths():
    cluster = parse_config(small_config_data(redis={"cluster": {"nodes": ["10.0.0.1:6379", "[::1]:7000"]}})).redis
    assert cluster.cluster.nodes == ["10.0.0.1:6379", "[::1]:7000"] and cluster.sentinel is None
    sentinel = parse_config(small_config_data(redis={"sentinel": {"sentinels": ["s1:26379"], "service_name": "primary"}})).redis
    assert sentinel.sentinel.service_name == "primary"
    assert problems(small_config_data(redis={"cluster": {"nodes": ["a:1"]}, "sentinel": {"sentinels": ["b:2"], "service_name": "x"}})) == [
        "redis: set only one of cluster or sentinel"]
    assert problems(small_config_data(redis={"url": "redis://h:1/0", "cluster": {"nodes": ["a:1"]}})) == [
        "redis.url: a standalone URL cannot be combined with redis.cluster or redis.sentinel"]
    assert problems(small_config_data(redis={"cluster": {"nodes": ["no-port", "h:99999"]}})) == [
        "redis.cluster.nodes[0]: 'no-port' is not host:port", "redis.cluster.nodes[1]: 'h:99999' is not host:port"]
    assert problems(small_config_data(redis={"cluster": {"nodes": []}})) == ["redis.cluster.nodes: must not be empty"]
    assert problems(small_config_data(redis={"sentinel": {"sentinels": ["h:1"]}})) == ["redis.sentinel.service_name: is required"]
    assert problems(small_config_data(redis={"url": "http://h:1"})) == ["redis.url: must match ^rediss?://"]


def test_the_epoch_grace_outlasts_what_every_instance_takes_to_see_a_new_epoch():
    assert parse_config(small_config_data()).redis.epoch_grace == 3.0  # 2 x max(0.5, 1.0) + 1
    assert parse_config(small_config_data(redis={"instance_heartbeat_seconds": 2.0})).redis.epoch_grace == 5.0
    assert parse_config(small_config_data(redis={"epoch_grace_seconds": 1.5})).redis.epoch_grace == 1.5
    assert problems(small_config_data(redis={"epoch_grace_seconds": 1.0})) == [
        "redis.epoch_grace_seconds: must exceed probe_interval_seconds and instance_heartbeat_seconds (1), "
        "the time every instance takes to see a new epoch"
    ]


def test_passthrough_endpoints_default_to_vllms_and_their_features_are_known():
    config = parse_config(small_config_data(providers=[
        {"name": "iris-1", "kind": "managed", "cluster": "iris-1", "models": {"m": {"features": ["chat", "tokenize", "rerank"]}}},
    ]))
    assert {(e.path, e.feature) for e in config.passthrough_endpoints} == {
        ("/tokenize", "tokenize"), ("/detokenize", "detokenize"), ("/v1/rerank", "rerank"), ("/v1/score", "score")}
    assert config.adaptation.restore_model_name is True
    only = parse_config(small_config_data(
        passthrough_endpoints=[{"path": "/v2/rerank", "feature": "rerank2"}],
        providers=[{"name": "iris-1", "kind": "managed", "cluster": "iris-1", "models": {"m": {"features": ["rerank2"]}}}],
    ))
    assert only.passthrough_features() == {"rerank2"}  # a passthrough feature alone serves the model


def test_passthrough_endpoints_cannot_take_openais_paths_or_features():
    data = small_config_data(passthrough_endpoints=[
        {"path": "/tokenize", "feature": "tokenize"}, {"path": "/tokenize", "feature": "tok"},
        {"path": "/v1/responses/x", "feature": "x"}, {"path": "/v1/models", "feature": "y"},
        {"path": "/rerank", "feature": "chat"},
    ])
    data["providers"][0]["models"]["m"]["features"] = ["chat", "score"]  # not listed any more: unknown
    found = problems(data)
    assert "passthrough_endpoints: path '/tokenize' is listed twice" in found
    assert "passthrough_endpoints[2].path: '/v1/responses/x' is one of OpenAI's paths the router serves" in found
    assert "passthrough_endpoints[3].path: '/v1/models' is one of OpenAI's paths the router serves" in found
    assert "passthrough_endpoints[4].feature: 'chat' is already a feature of OpenAI's API" in found
    assert "providers[0].models.m.features: unknown feature(s) ['score']" in found
    bad_path = problems(small_config_data(passthrough_endpoints=[{"path": "tokenize?x", "feature": "t"}]))
    assert bad_path == ["passthrough_endpoints[0].path: must match ^/[A-Za-z0-9._~-]+(/[A-Za-z0-9._~-]+)*$"]


def test_each_worker_listens_on_the_next_port():
    """server.workers N: worker i on listen's port + i (IPv4, IPv6 or a name); the ports must
    exist, and listen must name one."""
    server = parse_config(small_config_data(server={"listen": "[::]:50051", "workers": 3})).server
    assert server.worker_ports() == [50051, 50052, 50053]
    assert [server.worker_listen(i) for i in range(3)] == ["[::]:50051", "[::]:50052", "[::]:50053"]
    assert parse_config(small_config_data()).server.worker_ports() == [50051]  # one worker by default
    assert problems(small_config_data(server={"listen": "0.0.0.0:65535", "workers": 2})) == [
        "server.workers: 2 workers on ports from 65535 would go past port 65535"]
    assert problems(small_config_data(server={"listen": "localhost"})) == [
        "server.listen: 'localhost' is not host:port with a port from 1 to 65535"]
    assert problems(small_config_data(server={"workers": 0})) == ["server.workers: must be >= 1"]
def test_the_admission_queue_settings_are_checked():
    base = {"providers": [{"name": "a", "kind": "managed", "cluster": "a", "models": {"m": {"features": ["chat"]}}}]}
    assert not parse_config(base).routing.queue.enabled("m")  # off by default
    queue = {"classes": [{"name": "interactive", "max_wait_ms": 100}, {"name": "interactive"}], "default_class": "gold",
             "identity_classes": {"trusted_header:x": "silver"}, "ticket_lease_ms": 1000, "poll_ms": 500, "class_header": "x-session-id"}
    queue["classes"][0]["max_wait_ms_by_model"] = {"nope": 10}
    with pytest.raises(ConfigError) as raised:
        parse_config({**base, "routing": {"queue": queue}})
    problems = "\n".join(raised.value.problems)
    for expected in ("duplicate class 'interactive'", "default_class: 'gold' is not one of", "identity_classes.trusted_header:x: 'silver'",
                     "no provider serves the model 'nope'", "ticket_lease_ms: must be at least 3 x poll_ms (1500)",
                     "class_header: 'x-session-id' is already"):
        assert expected in problems, problems
