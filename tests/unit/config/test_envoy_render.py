"""The Envoy bootstrap rendered from the routing config (extproc.config.envoy_render and
`iris-extproc envoy-config`): it agrees with the config by envoy_check, and real Envoy accepts it."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from extproc.config import ConfigError, envoy_check, parse_config
from extproc.config.envoy_render import SYSTEM_CA_FILE, RenderError, render
from extproc.config.examples import envoy_yaml
from irislab.processes import envoy_binary
from tests.support.configs import ROOT


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
    # Every cluster of the template stays in its place (tensorx is the provider without endpoints'); the rendered follow.
    assert list(clusters) == ["extproc", "iris-1", "iris-2", "tensorx", "pool", "pool-spread", "dyn"]
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
    assert_envoy_accepts(bootstrap, tmp_path)


def verified_tls(host: str, ca_file: str = SYSTEM_CA_FILE, san_type: str = "DNS") -> dict:
    """The transport socket that verifies `host`'s certificate (chain and name), as
    envoy/third-party-cluster.example.yaml does."""
    context = {"@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"}
    if san_type == "DNS":
        context["sni"] = host
    context["common_tls_context"] = {"validation_context": {
        "trusted_ca": {"filename": ca_file}, "match_typed_subject_alt_names": [{"san_type": san_type, "matcher": {"exact": host}}],
    }}
    return {"name": "envoy.transport_sockets.tls", "typed_config": context}


def test_https_endpoints_get_tls_that_verifies_the_chain_and_the_name():
    """Issue 29 item 6: the system's CA bundle by default, the endpoint's host as SNI and as the
    name the certificate must carry; `tls_ca_file` for a private CA."""
    data = fleet()
    data["providers"][2].update(endpoints=["https://api.tensorx.example"])
    bootstrap = render(parse_config(data), template())
    tensorx = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}["tensorx"]
    address = tensorx["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    assert address == {"address": "api.tensorx.example", "port_value": 443}
    assert tensorx["transport_socket"] == verified_tls("api.tensorx.example")
    assert "transport_socket_matches" not in tensorx  # one host name: one socket
    assert "health_checks" not in tensorx  # a third party is never checked
    data["providers"][2]["tls_ca_file"] = "/etc/iris/provider-ca.pem"
    bootstrap = render(parse_config(data), template())
    tensorx = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}["tensorx"]
    assert tensorx["transport_socket"] == verified_tls("api.tensorx.example", "/etc/iris/provider-ca.pem")


def test_https_endpoints_on_several_hosts_each_verify_their_own_name(tmp_path):
    """Issue 29 item 14: each endpoint gets its own host's SNI and name, not the first one's: a
    transport socket match per host name, picked by the endpoint's metadata; an IP address is
    verified as an IP SAN and sends no SNI. Real Envoy accepts it."""
    data = fleet()
    data["providers"][2].update(endpoints=["https://a.tensorx.example", "https://b.tensorx.example:8443", "https://a.tensorx.example:444",
                                           "https://10.1.2.3"])
    bootstrap = render(parse_config(data), template())
    tensorx = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}["tensorx"]
    endpoints = tensorx["load_assignment"]["endpoints"][0]["lb_endpoints"]
    picked = [e["metadata"]["filter_metadata"]["envoy.transport_socket_match"]["host"] for e in endpoints]
    assert picked == ["a.tensorx.example", "b.tensorx.example", "a.tensorx.example", "10.1.2.3"]
    assert tensorx["transport_socket_matches"] == [
        {"name": "tls-a.tensorx.example", "match": {"host": "a.tensorx.example"}, "transport_socket": verified_tls("a.tensorx.example")},
        {"name": "tls-b.tensorx.example", "match": {"host": "b.tensorx.example"}, "transport_socket": verified_tls("b.tensorx.example")},
        {"name": "tls-10.1.2.3", "match": {"host": "10.1.2.3"}, "transport_socket": verified_tls("10.1.2.3", san_type="IP_ADDRESS")},
    ]
    assert tensorx["transport_socket"] == verified_tls("a.tensorx.example")  # never plaintext, whatever an endpoint matches
    config = parse_config(data)
    assert envoy_check.check(config, bootstrap) == []
    assert_envoy_accepts(bootstrap, tmp_path)


def assert_envoy_accepts(bootstrap: dict, tmp_path) -> None:
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(bootstrap))
    result = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


JWKS_CLUSTER = {
    "name": "jwks", "type": "STATIC", "connect_timeout": "1s",
    "load_assignment": {"cluster_name": "jwks", "endpoints": [{"lb_endpoints": [
        {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 8900}}}}]}]},
}


def with_jwt_authn(bootstrap: dict, jwks_cluster: dict = JWKS_CLUSTER) -> dict:
    """`bootstrap` with jwt_authn before ext_proc, its keys fetched from the `jwks` cluster."""
    manager = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    manager["http_filters"].insert(0, {
        "name": "envoy.filters.http.jwt_authn",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication",
            "providers": {"iris": {
                "issuer": "https://issuer.example",
                "remote_jwks": {"http_uri": {"uri": "http://127.0.0.1/jwks.json", "cluster": "jwks", "timeout": "2s"}},
                "claim_to_headers": [{"header_name": "x-auth-user", "claim_name": "sub"}],
            }},
            "rules": [{"match": {"prefix": "/"}, "requires": {"provider_name": "iris"}}],
        },
    })
    bootstrap["static_resources"]["clusters"].append(jwks_cluster)
    return bootstrap


def test_the_templates_own_clusters_are_kept(tmp_path):
    """Issue 29 item 14: a template with jwt_authn and its remote JWKS cluster renders a
    bootstrap with that cluster, as the template has it (it was dropped: every request 401)."""
    bootstrap = render(parse_config(fleet()), with_jwt_authn(template()))
    clusters = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}
    assert clusters["jwks"] == JWKS_CLUSTER
    assert_envoy_accepts(bootstrap, tmp_path)


HTTP_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"


def connection_options(cluster: dict) -> dict:
    return cluster["typed_extension_protocol_options"][HTTP_OPTIONS]["common_http_protocol_options"]


def test_own_engines_get_a_connection_per_request_and_third_parties_reuse_theirs(tmp_path):
    """Issue 30 item 6: llama.cpp's server closes a connection right after a streamed answer, so
    a managed provider's clusters carry one request per connection; an unlimited provider's
    rendered cluster reuses its connections (the template's first provider cluster, which every
    rendered cluster copies, carries the setting: it is not inherited). A template whose provider
    clusters have no HTTP options gets them, HTTP/1.1 as envoy.yaml's; an HTTP/2 one keeps
    multiplexing."""
    data = fleet()
    data["providers"][2]["endpoints"] = ["https://api.tensorx.example"]
    config = parse_config(data)
    bootstrap = render(config, template())
    clusters = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}
    for name in ("pool", "pool-spread", "dyn", "iris-1", "iris-2"):  # rendered, and the template's own providers'
        assert connection_options(clusters[name]) == {"idle_timeout": "4s", "max_requests_per_connection": 1}, name
    assert connection_options(clusters["tensorx"]) == {"idle_timeout": "4s"}
    assert_envoy_accepts(bootstrap, tmp_path)
    bare = template()
    for cluster in bare["static_resources"]["clusters"]:
        if cluster["name"] != "extproc":
            cluster.pop("typed_extension_protocol_options")
    options = {c["name"]: c for c in render(config, bare)["static_resources"]["clusters"]}["pool"]["typed_extension_protocol_options"]
    assert options == {HTTP_OPTIONS: {"@type": f"type.googleapis.com/{HTTP_OPTIONS}", "explicit_http_config": {"http_protocol_options": {}},
                                      "common_http_protocol_options": {"max_requests_per_connection": 1}}}
    http2 = template()  # a template whose provider clusters speak HTTP/2: its streams share connections, as it says
    http2["static_resources"]["clusters"][1]["typed_extension_protocol_options"][HTTP_OPTIONS].update(
        explicit_http_config={"http2_protocol_options": {}}, common_http_protocol_options={"idle_timeout": "4s"})
    assert connection_options({c["name"]: c for c in render(config, http2)["static_resources"]["clusters"]}["pool"]) == {"idle_timeout": "4s"}


def test_a_template_whose_shape_cannot_be_read_is_a_render_error():
    broken = template()
    broken["static_resources"]["clusters"][1] = ["iris-1"]
    with pytest.raises(RenderError, match="the template's shape cannot be read"):
        render(parse_config(fleet()), broken)


@pytest.mark.parametrize(("endpoint", "problem"), [
    ("http://127.0.0.11:0", "has port 0"),
    ("https://user:secret@api.tensorx.example", "carries user:password@ (not shown here)"),
    ("https://api.tensorx.example#x", "is not http(s)://host[:port]"),
    ("https://api.tensorx.example:70000", "has an invalid port"),
])
def test_an_endpoint_that_cannot_be_rendered_is_refused(endpoint, problem):
    data = fleet()
    data["providers"][2].update(endpoints=[endpoint])
    with pytest.raises(ConfigError) as raised:
        parse_config(data)
    assert any(p.startswith("providers[2].endpoints[0]: ") and problem in p for p in raised.value.problems), raised.value.problems
    assert "secret" not in str(raised.value)


def test_tls_ca_file_goes_with_https_endpoints():
    data = fleet()
    data["providers"][0]["tls_ca_file"] = "/etc/iris/ca.pem"
    with pytest.raises(ConfigError, match=r"providers\[0\].tls_ca_file: only with https endpoints"):
        parse_config(data)


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


THIRD_PARTY_EXAMPLE = ROOT / "envoy" / "third-party-cluster.example.yaml"


def test_a_template_whose_providers_pick_their_protocol_by_alpn_renders_one_envoy_accepts(tmp_path):
    """A template whose first provider cluster is envoy/third-party-cluster.example.yaml's
    (`auto_config`: HTTP/2 or HTTP/1.1 by ALPN) rendered a managed pool with `auto_config` and
    `explicit_http_config` both (one oneof: Envoy refused the file, `check` passed it) and one
    request per connection on a cluster ALPN may make HTTP/2. Now the protocol is set only when
    the template sets none; an https cluster keeps auto_config with no per-connection limit; a
    plaintext one (ALPN needs TLS) gets HTTP/1.1, and the managed one a connection per request."""
    data = fleet()
    data["providers"][2]["endpoints"] = ["https://api.tensorx.example"]
    data["providers"].append({"name": "tls-pool", "kind": "managed", "cluster": "tls-pool", "endpoints": ["https://10.0.0.7:8443"],
                              "affinity": "session_hash", "models": {"m": {"features": ["chat"]}}})
    config = parse_config(data)
    alpn = template()
    clusters = alpn["static_resources"]["clusters"]
    clusters[1:] = yaml.safe_load(THIRD_PARTY_EXAMPLE.read_text())["clusters"]  # extproc, then the third party's
    bootstrap = render(config, alpn)
    assert envoy_check.check(config, bootstrap) == []
    rendered = {c["name"]: c["typed_extension_protocol_options"][HTTP_OPTIONS] for c in bootstrap["static_resources"]["clusters"]}
    auto = {"http_protocol_options": {}, "http2_protocol_options": {}}
    for name in ("tensorx", "tls-pool"):  # https: ALPN decides; streams may share a connection
        assert "explicit_http_config" not in rendered[name] and rendered[name]["auto_config"] == auto, name
        assert rendered[name]["common_http_protocol_options"] == {"idle_timeout": "60s"}, name
    for name in ("pool", "pool-spread", "dyn"):  # plaintext: HTTP/1.1, one request per connection
        assert "auto_config" not in rendered[name] and rendered[name]["explicit_http_config"] == {"http_protocol_options": {}}, name
        assert rendered[name]["common_http_protocol_options"] == {"idle_timeout": "60s", "max_requests_per_connection": 1}, name
    assert_envoy_accepts(bootstrap, tmp_path)


def test_check_refuses_more_than_one_protocol_choice(tmp_path):
    """`check` refuses what Envoy refuses: two of HttpProtocolOptions' oneof in one cluster
    ("'explicit_http_config' has already been set (oneof)"), and auto_config on a cluster without
    TLS ("ALPN configured for cluster ... which has a non-ALPN transport socket")."""
    config = parse_config(fleet())
    bootstrap = render(config, template())
    pool = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}["pool"]
    options = pool["typed_extension_protocol_options"][HTTP_OPTIONS]
    options["auto_config"] = {"http_protocol_options": {}, "http2_protocol_options": {}}
    problems = envoy_check.check(config, bootstrap)
    assert any("cluster 'pool': typed_extension_protocol_options" in p and "sets explicit_http_config and auto_config" in p
               for p in problems), problems
    assert any("auto_config on a cluster without a transport_socket" in p for p in problems), problems
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(bootstrap))
    result = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True, timeout=60)
    output = "".join((result.stdout + result.stderr).split())  # protobuf's messages vary their spacing from run to run
    assert result.returncode != 0 and "hasalreadybeenset(eitherdirectlyoraspartofaoneof)" in output, result.stderr[-2000:]
    del options["explicit_http_config"]
    assert [p for p in envoy_check.check(config, bootstrap) if "typed_extension_protocol_options" in p] == \
        [next(p for p in problems if "auto_config on a cluster without" in p)]
