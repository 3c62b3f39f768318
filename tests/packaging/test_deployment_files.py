"""envoy.yaml, the example routing config, compose.yaml and the Dockerfile agree with each other.
No Docker engine runs here, so compose.yaml is checked by reading it."""

from __future__ import annotations

import subprocess
from urllib.parse import urlsplit

import yaml
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from google.protobuf.json_format import ParseDict

from extproc.config import load_config
from extproc.protocol.messages import processing_mode
from irislab import envoy_config
from irislab.processes import envoy_binary
from tests.support.configs import ROOT

ENVOY = ROOT / "envoy" / "envoy.yaml"
EXAMPLE = ROOT / "envoy" / "example-config.yaml"


def test_envoy_yaml_is_valid_for_the_shipped_envoy():
    result = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(ENVOY)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_example_config_names_the_clusters_of_envoy_yaml():
    config = load_config(EXAMPLE)
    bootstrap = envoy_config.load_envoy_yaml(ENVOY)
    clusters = set(envoy_config.cluster_names(bootstrap))
    assert {p.cluster for p in config.providers} == clusters - {"extproc"}
    host, port = config.server.listen.rsplit(":", 1)
    assert envoy_config.cluster_port(bootstrap, "extproc") == int(port)


def test_routing_header_agrees_everywhere():
    config = load_config(EXAMPLE)
    text = ENVOY.read_text()
    header = config.server.routing_header
    assert f"remove: {header}" in text
    assert f"cluster_header: {header}" in text
    assert f"request_headers_to_remove: [{header}]" in text


def test_compose_runs_the_same_files_and_ports():
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = compose["services"]
    bootstrap = envoy_config.load_envoy_yaml(ENVOY)
    assert "./envoy/envoy.yaml:/etc/envoy/envoy.yaml:ro" in services["envoy"]["volumes"]
    assert services["envoy"]["image"].startswith("envoyproxy/envoy:v1.40")
    assert "./envoy/example-config.yaml:/etc/iris/routing.yaml:ro" in services["extproc"]["volumes"]
    assert all(s.get("network_mode") == "host" for s in services.values())
    config = load_config(EXAMPLE)
    for provider in config.providers:
        command = services[provider.name]["command"]
        port = int(command[command.index("--port") + 1])
        assert port == envoy_config.cluster_port(bootstrap, provider.cluster)
    redis_command = services["redis"]["command"]
    assert redis_command[redis_command.index("--port") + 1] == config.redis.url.rsplit(":", 1)[1].split("/")[0]
    assert (ROOT / "Dockerfile").exists()


def test_admin_interface_listens_on_loopback_only():
    bootstrap = envoy_config.load_envoy_yaml(ENVOY)
    assert bootstrap["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"


def test_example_health_and_load_urls_use_the_provider_cluster_ports():
    config = load_config(EXAMPLE)
    bootstrap = envoy_config.load_envoy_yaml(ENVOY)
    checked = 0
    for provider in config.providers:
        for check in (provider.health_check, provider.load):
            if check is not None:
                assert urlsplit(check.url).port == envoy_config.cluster_port(bootstrap, provider.cluster)
                checked += 1
    assert checked == 4


def test_compose_gives_the_third_party_key_to_the_router_and_the_simulated_provider():
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    tensorx = load_config(EXAMPLE).provider("tensorx")
    variable = tensorx.credentials.api_key_env
    assert variable in services["extproc"]["environment"]
    assert variable in services["tensorx"]["environment"]
    command = services["tensorx"]["command"]
    assert command[command.index("--api-key-env") + 1] == variable
    served = command[command.index("--model") + 1:]
    assert [entry.upstream_model or model for model, entry in tensorx.models.items()] == served


def _ext_proc_filter(bootstrap: dict) -> dict:
    manager = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    return next(f for f in manager["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")["typed_config"]


def test_envoy_strips_every_trusted_identity_header_before_any_filter_runs():
    config = load_config(EXAMPLE)
    bootstrap = envoy_config.load_envoy_yaml(ENVOY)
    manager = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    early = manager["early_header_mutation_extensions"][0]["typed_config"]["mutations"]
    removed = {m["remove"] for m in early}
    assert config.session.trusted_identity_headers and set(config.session.trusted_identity_headers) <= removed


def test_the_only_mode_overrides_allowed_are_the_servers_response_body_reads():
    ext_proc = _ext_proc_filter(envoy_config.load_envoy_yaml(ENVOY))
    assert ext_proc["allow_mode_override"] is True
    configured = ParseDict(ext_proc["processing_mode"], ProcessingMode())
    assert configured == processing_mode("NONE")
    allowed = [ParseDict(mode, ProcessingMode()) for mode in ext_proc["allowed_override_modes"]]
    assert allowed == [processing_mode("BUFFERED"), processing_mode("STREAMED")]


def test_example_config_serves_responses_on_every_own_provider():
    config = load_config(EXAMPLE)
    chat = [p for p in config.providers if any("chat" in m.features for m in p.models.values())]
    assert all(any("responses" in m.features for m in p.models.values()) for p in chat)
