"""Per-provider request adaptation and feature support, end to end: the third party is a DNS
cluster with TLS (the shape of envoy/third-party-cluster.example.yaml) in front of a simulator
serving HTTPS with a self-signed certificate; it demands its own key and model names. Nothing of
the client's identity reaches a third party (issue 20, item 10) unless its provider opts in."""

from __future__ import annotations

import subprocess

import httpx
import openai
import orjson
import pytest
import yaml

from extproc.config import DEFAULT_PRIVATE_HEADERS, parse_config
from extproc.config.schema import DEFAULT_AGENT_SESSION_HEADERS
from extproc.openai_api.adaptation import CredentialError, RequestAdapter
from extproc.protocol.messages import route_to_cluster
from irislab import envoy_config
from irislab.local_gateway import LocalGateway, ProviderSimulation
from irislab.processes import envoy_binary
from tests.support.configs import ROOT, small_config_data
from tests.support.gateway import clear_routing_state, live_leases, post, redis_client, self_signed_certificate

EXAMPLE_CLUSTER = ROOT / "envoy" / "third-party-cluster.example.yaml"
TENSORX_KEY = "tx-key-Zq81vL0p"
IRIS2_KEY = "iris2-key-Pm52Kd7w"
CLIENT_SECRETS = ("client-secret-abc", "client-secret-def", "client-secret-ghi")
LLAMA = "llama-3.1-70b"
# The test's stand-in for an authenticating filter (jwt_authn with claim_to_headers) reads the
# authenticated user from this header and sets the trusted identity header x-user-id from it.
AUTHENTICATED = "x-test-authenticated-user"
IMAGE_PART = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}


# -- the adapter alone ----------------------------------------------------------------------


def adapter_config(tmp_path, **credentials):
    data = small_config_data()
    data["providers"][2]["credentials"] = credentials or {"api_key_env": "TX"}
    data["providers"][2]["models"]["m"]["upstream_model"] = "vendor/m-large"
    return parse_config(data)


def test_model_is_renamed_and_the_key_set_for_the_chosen_provider_only(tmp_path):
    config = adapter_config(tmp_path)
    adapter = RequestAdapter(config, environ={"TX": " sk-123 \n"})
    body = {"model": "m", "messages": [{"role": "user", "content": "hé"}], "temperature": 0.5}
    third = adapter.adapt(config.provider("tensorx"), "m", body)
    assert orjson.loads(third.body) == {**body, "model": "vendor/m-large"}
    assert third.set_headers == {"authorization": "Bearer sk-123"}
    session_headers = ["x-session-id", *DEFAULT_AGENT_SESSION_HEADERS]
    assert third.remove == ["api-key", "x-api-key", *DEFAULT_PRIVATE_HEADERS, *session_headers]  # a third party: identity headers too
    own = adapter.adapt(config.provider("iris-1"), "m", body)
    assert (own.body, own.set_headers, own.remove) == (None, {}, ["authorization", "api-key", "x-api-key"])
    assert "sk-123" not in repr(third)


def test_route_answer_sets_content_length_with_a_new_body(tmp_path):
    config = adapter_config(tmp_path)
    change = RequestAdapter(config, environ={"TX": "k"}).adapt(config.provider("tensorx"), "m", {"model": "m"})
    response = route_to_cluster("x-iris-cluster", "tensorx", change.set_headers, change.remove, change.body)
    common = response.request_body.response
    headers = {h.header.key: h.header.raw_value for h in common.header_mutation.set_headers}
    assert headers["content-length"] == str(len(change.body)).encode()
    assert common.body_mutation.body == change.body and common.clear_route_cache


def test_key_from_a_file_in_a_configured_header(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("file-key\n")
    config = adapter_config(tmp_path, api_key_file=str(key_file), header="api-key")
    change = RequestAdapter(config, environ={}).adapt(config.provider("tensorx"), "m", {"model": "m"})
    assert change.set_headers == {"api-key": "file-key"}
    assert change.remove == ["authorization", "x-api-key", *DEFAULT_PRIVATE_HEADERS, "x-session-id", *DEFAULT_AGENT_SESSION_HEADERS]


@pytest.mark.parametrize(
    ("credentials", "environ", "names"),
    [
        ({"api_key_env": "TX"}, {}, "environment variable TX is not set"),
        ({"api_key_env": "TX"}, {"TX": "a\nb"}, "environment variable TX holds control characters"),
        ({"api_key_file": "/nonexistent/key"}, {}, "file /nonexistent/key: FileNotFoundError"),
    ],
)
def test_an_unreadable_key_stops_the_start_naming_where_never_what(tmp_path, credentials, environ, names):
    with pytest.raises(CredentialError) as info:
        RequestAdapter(adapter_config(tmp_path, **credentials), environ=environ)
    assert names in str(info.value) and "provider tensorx" in str(info.value)
    assert "a\nb" not in str(info.value)


def spliced_bootstrap(cluster_changes=None) -> dict:
    """envoy/envoy.yaml with the example third-party cluster in place of the demo `tensorx`."""
    bootstrap = envoy_config.load_envoy_yaml()
    example = yaml.safe_load(EXAMPLE_CLUSTER.read_text())["clusters"][0]
    if cluster_changes:
        cluster_changes(example)
    clusters = bootstrap["static_resources"]["clusters"]
    clusters[[c["name"] for c in clusters].index(example["name"])] = example
    return bootstrap


def test_example_third_party_cluster_is_valid_for_the_shipped_envoy(tmp_path):
    path = envoy_config.write(spliced_bootstrap(), tmp_path / "envoy.yaml")
    result = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    cluster = yaml.safe_load(EXAMPLE_CLUSTER.read_text())["clusters"][0]
    assert cluster["type"] in envoy_config.DNS_CLUSTER_TYPES
    assert cluster["transport_socket"]["name"] == "envoy.transport_sockets.tls"
    assert "auto_host_rewrite: true" in (ROOT / "envoy" / "envoy.yaml").read_text()


# -- end to end -----------------------------------------------------------------------------


def adaptation_config(key_file) -> dict:
    return {
        "redis": {"key_prefix": "adapt"},
        # x-user-id is the trusted identity header: Envoy strips the client's own copy and the
        # stand-in authenticating filter sets it (with_stand_in_authentication).
        "session": {"trusted_identity_headers": ["x-user-id"]},
        "server": {"expose_routing_headers": True},
        "providers": [
            {"name": "iris-1", "kind": "managed", "cluster": "iris-1",
             "models": {LLAMA: {"features": ["chat", "completions", "tools"],
                                "limits": {"max_pinned_sessions": 1, "max_global_in_flight_request_slots": 2,
                                           "max_per_session_in_flight_request_slots": 1}},
                        "llava": {"features": ["chat"]},
                        "small": {"features": ["chat"]}}},
            {"name": "iris-2", "kind": "managed", "cluster": "iris-2",
             "credentials": {"api_key_file": str(key_file), "header": "api-key"},
             "models": {"llava": {"features": ["chat", "vision"], "upstream_model": "iris2-llava"}}},
            {"name": "tensorx", "kind": "unlimited", "cluster": "tensorx",
             "credentials": {"api_key_env": "TEST_TENSORX_KEY"},
             "models": {LLAMA: {"features": ["chat", "completions", "tools", "vision"], "upstream_model": "tx-llama-70b"},
                        "tx-only": {"features": ["chat"]}}},
            # A third party under contract that needs the client's identity: it opts in.
            {"name": "partner", "kind": "unlimited", "cluster": "partner", "forward_client_identity": True,
             "models": {"partner-only": {"features": ["chat"]}}},
        ],
    }


def with_stand_in_authentication(bootstrap: dict) -> dict:
    """The bootstrap with a stand-in for an authenticating filter: the early header mutation
    strips the client's own x-user-id (the trusted identity header) and a header_mutation filter
    before ext_proc sets it from AUTHENTICATED (then removed), as jwt_authn's claim_to_headers
    would from a verified token. Also a `partner` cluster for the opted-in third party (iris-2's, plain HTTP)."""
    manager = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    manager["early_header_mutation_extensions"][0]["typed_config"]["mutations"].append({"remove": "x-user-id"})
    manager["http_filters"].insert(0, {
        "name": "envoy.filters.http.header_mutation",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
            "mutations": {"request_mutations": [
                {"append": {"header": {"key": "x-user-id", "value": f"%REQ({AUTHENTICATED})%"},
                            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}},
                {"remove": AUTHENTICATED},
            ]},
        },
    })
    clusters = bootstrap["static_resources"]["clusters"]
    partner = yaml.safe_load(yaml.safe_dump(next(c for c in clusters if c["name"] == "iris-2")))
    partner.pop("lb_policy", None)
    partner["name"] = partner["load_assignment"]["cluster_name"] = "partner"
    clusters.append(partner)
    return bootstrap


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    work = tmp_path_factory.mktemp("adaptation")
    cert, key = self_signed_certificate(work)
    key_file = work / "iris2.key"
    key_file.write_text(IRIS2_KEY + "\n")

    def for_the_loopback_simulator(cluster):  # the example, pointed at our certificate
        tls = cluster["transport_socket"]["typed_config"]
        tls["sni"] = "localhost"
        validation = tls["common_tls_context"]["validation_context"]
        validation["trusted_ca"] = {"filename": str(cert)}
        validation["match_typed_subject_alt_names"][0]["matcher"]["exact"] = "localhost"

    bootstrap = with_stand_in_authentication(spliced_bootstrap(for_the_loopback_simulator))
    envoy_source = envoy_config.write(bootstrap, work / "envoy-source.yaml")
    fast = ProviderSimulation(ttft_ms=5, per_token_ms=20, block_tokens=8)
    sims = {"iris-1": fast, "iris-2": fast, "tensorx": ProviderSimulation(ttft_ms=5, per_token_ms=1, tls_cert=cert, tls_key=key)}
    gw = LocalGateway(
        config_data=adaptation_config(key_file), simulations=sims, work_dir=work / "gateway",
        env={"TEST_TENSORX_KEY": TENSORX_KEY}, envoy_source=envoy_source,
    )
    gw.__enter__()
    gw.tensorx_url = f"https://127.0.0.1:{gw.providers['tensorx'].port}"
    yield gw
    gw.stop()


def stats(gw, name: str) -> dict:
    base = gw.tensorx_url if name == "tensorx" else gw.provider_url(name)
    return httpx.get(f"{base}/stats", timeout=5, verify=False).json()


@pytest.fixture
def gw(gateway):
    clear_routing_state(redis_client(gateway))
    for name in gateway.providers:
        base = gateway.tensorx_url if name == "tensorx" else gateway.provider_url(name)
        httpx.post(f"{base}/stats/reset", timeout=5, verify=False)
    return gateway


def client_headers(user: str) -> dict:
    return {AUTHENTICATED: user, "authorization": f"Bearer {CLIENT_SECRETS[0]}",
            "api-key": CLIENT_SECRETS[1], "x-api-key": CLIENT_SECRETS[2]}


def assert_no_client_credential(headers: dict) -> None:
    assert not any(secret in value for value in headers.values() for secret in CLIENT_SECRETS), headers


def chat(model: str, text: str = "hi", **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 2, **extra}


def test_offloaded_request_reaches_the_third_party_with_its_key_and_model(gw):
    body = chat(LLAMA, "long story", max_tokens=200, stream=True)
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{gw.url}/v1/chat/completions", json=body, headers=client_headers("carol")) as running:
            assert running.headers["x-iris-provider"] == "iris-1"
            lines = running.iter_lines()  # kept: a dropped iterator closes the response
            next(lines)
            api = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=CLIENT_SECRETS[0], max_retries=0,
                                default_headers={AUTHENTICATED: "carol", "api-key": CLIENT_SECRETS[1]})
            raw = api.chat.completions.with_raw_response.create(
                model=LLAMA, messages=[{"role": "user", "content": "long story"}], max_tokens=3
            )
    assert (raw.headers["x-iris-provider"], raw.headers["x-iris-route-reason"]) == ("tensorx", "offloaded")
    assert raw.parse().choices[0].message.content == "tok0 tok1 tok2"
    received = stats(gw, "tensorx")
    assert received["requests_by_status"] == {"200": 1}
    assert received["last_request_models"] == ["tx-llama-70b"]
    headers = received["last_request_headers"][-1]
    assert headers["authorization"] == f"Bearer {TENSORX_KEY}"
    assert "api-key" not in headers and "x-api-key" not in headers
    assert_no_client_credential(headers)
    assert headers["host"] == "localhost"  # auto_host_rewrite: the DNS name, not the client's Host
    ssl = httpx.get(f"http://127.0.0.1:{gw.running[0].admin_port}/stats?filter=^cluster.tensorx.ssl.handshake$", timeout=5)
    assert int(ssl.text.split(":")[1]) >= 1


def test_new_session_overflowing_to_the_third_party_succeeds(gw):
    first = post(gw, "/v1/chat/completions", json=chat(LLAMA), headers=client_headers("ann"))
    second = post(gw, "/v1/chat/completions", json=chat(LLAMA), headers=client_headers("ben"))
    assert (first.status_code, first.headers["x-iris-provider"]) == (200, "iris-1")
    assert (second.status_code, second.headers["x-iris-provider"], second.headers["x-iris-route-reason"]) == (
        200, "tensorx", "new_pin"
    )
    own = stats(gw, "iris-1")
    assert own["last_request_models"] == [LLAMA]  # no upstream_model: the name is kept
    for name in ("authorization", "api-key", "x-api-key"):
        assert name not in own["last_request_headers"][-1]


def test_vision_goes_only_to_the_provider_configured_for_vision(gw):
    vision = chat("llava")
    vision["messages"] = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, IMAGE_PART]}]
    for user in ("v1", "v2", "v3"):
        response = post(gw, "/v1/chat/completions", json=vision, headers=client_headers(user))
        assert (response.status_code, response.headers["x-iris-provider"]) == (200, "iris-2")
    plain = post(gw, "/v1/chat/completions", json=chat("llava"), headers=client_headers("v4"))
    assert plain.headers["x-iris-provider"] == "iris-1"  # first in priority without vision
    iris2 = stats(gw, "iris-2")
    assert iris2["last_request_models"] == ["iris2-llava"] * 3
    headers = iris2["last_request_headers"][-1]
    assert headers["api-key"] == IRIS2_KEY and "authorization" not in headers
    assert_no_client_credential(headers)
    assert stats(gw, "iris-1")["last_request_models"] == ["llava"]  # only the request without an image


def test_tools_on_a_model_no_provider_serves_with_tools_is_a_400(gw):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    response = post(gw, "/v1/chat/completions", json=chat("small", tools=tools), headers=client_headers("t"))
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["type"], error["param"]) == ("unsupported_feature", "invalid_request_error", "tools")
    assert error["message"] == "model 'small' does not support tools: no provider serves it with tools"
    assert live_leases(redis_client(gw)) == 0
    assert stats(gw, "iris-1")["requests"] == 0


def test_keys_never_appear_in_logs_or_written_configs(gw):
    post(gw, "/v1/chat/completions", json=chat(LLAMA), headers=client_headers("logs"))
    for path in gw.work_dir.iterdir():
        if path.is_file():
            text = path.read_text(errors="replace")
            for secret in (TENSORX_KEY, IRIS2_KEY):
                assert secret not in text, path.name


# -- nothing of the client's identity reaches a third party (issue 20, item 10) ---------------

# What says who the client is or where it connects from, as a client (or a proxy in front of
# Envoy) sends it. Envoy adds x-envoy-external-address itself (use_remote_address).
ADDRESS_HEADERS = {"x-forwarded-for": "203.0.113.7", "forwarded": "for=203.0.113.7", "x-real-ip": "203.0.113.7",
                   "true-client-ip": "203.0.113.7", "x-client-ip": "203.0.113.7", "cf-connecting-ip": "203.0.113.7"}
SESSION_HEADERS = {"x-session-id": "conversation-1", "x-claude-code-session-id": "cc-1", "session_id": "codex-1",
                   "conversation_id": "codex-conv-1", "x-litellm-session-id": "litellm-1"}
IDENTIFIED_BODY = {"user": "end-user-42", "safety_identifier": "safety-42"}  # the body fields that name the client


def identified_request(gw, model: str, user: str) -> httpx.Response:
    """A chat request for `model` carrying every kind of client identity: the authenticated user
    (the trusted header), a cookie, address headers, session and agent session headers, and the
    body's user and safety_identifier."""
    headers = {**client_headers(user), **ADDRESS_HEADERS, **SESSION_HEADERS, "cookie": "sid=secret-cookie"}
    return post(gw, "/v1/chat/completions", json=chat(model, f"identified {user}", **IDENTIFIED_BODY), headers=headers)


def rejected_header_mutations(gw) -> int:
    text = httpx.get(f"http://127.0.0.1:{gw.running[0].admin_port}/stats?filter=rejected_header_mutations", timeout=5).text
    return sum(int(line.rpartition(": ")[2]) for line in text.splitlines() if line.strip())


def identity_received(stats_of_provider: dict) -> tuple[set[str], set[str]]:
    """(identity header names, identity body fields) of the provider's last request."""
    headers = stats_of_provider["last_request_headers"][-1]
    private = {*DEFAULT_PRIVATE_HEADERS, "x-user-id", AUTHENTICATED, *SESSION_HEADERS, *DEFAULT_AGENT_SESSION_HEADERS}
    return {name for name in headers if name in private}, set(stats_of_provider["last_request_fields"][-1]) & set(IDENTIFIED_BODY)


def test_a_third_party_receives_nothing_of_the_clients_identity(gw):
    before = rejected_header_mutations(gw)
    response = identified_request(gw, "tx-only", "dora")
    assert (response.status_code, response.headers["x-iris-provider"]) == (200, "tensorx")
    received = stats(gw, "tensorx")
    headers, fields = identity_received(received)
    assert (headers, fields) == (set(), set()), received["last_request_headers"][-1]
    assert "x-envoy-external-address" not in received["last_request_headers"][-1]
    assert not any(value in str(received["last_request_headers"][-1]) for value in ("dora", "203.0.113.7", "secret-cookie", "conversation-1"))
    assert set(received["last_request_fields"][-1]) == {"model", "messages", "max_tokens"}
    assert rejected_header_mutations(gw) - before == 0  # Envoy applied every removal the server asked for


def test_an_own_provider_and_an_opted_in_third_party_receive_it(gw):
    before = rejected_header_mutations(gw)
    for model, provider in (("small", "iris-1"), ("partner-only", "partner")):
        response = identified_request(gw, model, "erin")
        assert (response.status_code, response.headers["x-iris-provider"]) == (200, provider)
        received = stats(gw, provider)
        headers = received["last_request_headers"][-1]
        assert headers["x-user-id"] == "erin" and headers["cookie"] == "sid=secret-cookie"
        assert headers["x-envoy-external-address"] and "x-forwarded-for" in headers
        assert {name: headers.get(name) for name in SESSION_HEADERS} == SESSION_HEADERS
        assert set(received["last_request_fields"][-1]) >= set(IDENTIFIED_BODY), provider
        assert AUTHENTICATED not in headers
        assert_no_client_credential(headers)  # credentials never leave, whoever the provider
    assert rejected_header_mutations(gw) - before == 0


def test_the_clients_own_copy_of_the_trusted_identity_header_never_counts(gw):
    """Envoy strips a client's x-user-id before any filter runs: a forged identity is no identity."""
    forged = {"x-user-id": "mallory", "authorization": f"Bearer {CLIENT_SECRETS[0]}"}
    response = post(gw, "/v1/chat/completions", json=chat("small", "forged"), headers=forged)
    assert response.status_code == 200
    assert "x-user-id" not in stats(gw, "iris-1")["last_request_headers"][-1]
