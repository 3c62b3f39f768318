"""`check` refuses a provider cluster that speaks TLS without verifying the provider's
certificate (issue 29 item 6): no CA to verify the chain against, no name to verify it by, a
chain accepted untrusted; in `transport_socket` and in each of `transport_socket_matches`. The
shipped envoy/third-party-cluster.example.yaml passes, and so do the other ways Envoy verifies
(SDS, a pinned certificate, auto_sni_san_validation)."""

from __future__ import annotations

import copy

import pytest
import yaml

from extproc.config import envoy_check, parse_config
from extproc.config.examples import envoy_yaml, example_config
from tests.support.configs import ROOT

CONFIG = parse_config(yaml.safe_load(example_config().read_text()))
EXAMPLE = yaml.safe_load((ROOT / "envoy" / "third-party-cluster.example.yaml").read_text())["clusters"][0]


def with_tensorx(cluster: dict) -> dict:
    """The shipped envoy.yaml with `cluster` as its tensorx cluster (a provider's)."""
    bootstrap = envoy_check.load_bootstrap(envoy_yaml())
    clusters = bootstrap["static_resources"]["clusters"]
    clusters[[c["name"] for c in clusters].index("tensorx")] = cluster
    return bootstrap


def tls_problems(cluster: dict) -> list[str]:
    return [p for p in envoy_check.check(CONFIG, with_tensorx(cluster)) if "speaks TLS" in p]


def context(cluster: dict) -> dict:
    return cluster["transport_socket"]["typed_config"]


def validation(cluster: dict) -> dict:
    return context(cluster)["common_tls_context"]["validation_context"]


def sni_only(cluster):  # what `envoy-config` rendered before
    context(cluster).pop("common_tls_context")


def no_ca(cluster):
    validation(cluster).pop("trusted_ca")


def no_name(cluster):
    validation(cluster).pop("match_typed_subject_alt_names")


def untrusted(cluster):
    validation(cluster)["trust_chain_verification"] = "ACCEPT_UNTRUSTED"


def an_unverified_match(cluster):
    bare = copy.deepcopy(cluster["transport_socket"])
    bare["typed_config"].pop("common_tls_context")
    cluster["transport_socket_matches"] = [{"name": "other", "match": {"host": "b"}, "transport_socket": bare}]


@pytest.mark.parametrize(("change", "expected"), [
    (sni_only, "(transport_socket: no CA to verify the certificate chain against"),
    (no_ca, "(transport_socket: no CA to verify the certificate chain against"),
    (no_name, "(transport_socket: no name to verify the certificate against"),
    (untrusted, "(transport_socket: trust_chain_verification ACCEPT_UNTRUSTED accepts any chain)"),
    (an_unverified_match, "(transport_socket_matches[0]: no CA"),
])
def test_tls_that_does_not_verify_the_provider_is_refused(change, expected):
    cluster = copy.deepcopy(EXAMPLE)
    change(cluster)
    [problem] = tls_problems(cluster)
    assert problem.startswith("provider tensorx: cluster 'tensorx' of envoy.yaml speaks TLS without verifying the provider's certificate")
    assert expected in problem and "could receive its API key" in problem


def sds(cluster):
    context(cluster)["common_tls_context"] = {"validation_context_sds_secret_config": {"name": "provider-ca"}}


def pinned(cluster):
    validation(cluster).clear()
    validation(cluster)["verify_certificate_spki"] = ["NvqYIYSbgK2vCJpQhObf77vv+bQWtc5ek5RIOwPiC9A="]


def auto_san(cluster):
    no_name(cluster)
    context(cluster)["auto_sni_san_validation"] = True


def combined(cluster):
    common = context(cluster)["common_tls_context"]
    common["combined_validation_context"] = {"default_validation_context": common.pop("validation_context"),
                                             "validation_context_sds_secret_config": {"name": "provider-ca"}}


@pytest.mark.parametrize("change", [lambda cluster: None, sds, pinned, auto_san, combined])
def test_tls_that_verifies_passes(change):
    cluster = copy.deepcopy(EXAMPLE)
    change(cluster)
    assert tls_problems(cluster) == []


def test_socket_matches_that_no_endpoint_gets_are_refused():
    """Issue 29 item 14: a cluster with a transport socket per host whose endpoints lost their
    `envoy.transport_socket_match` metadata (what the pick cluster rendered) gets the cluster's
    default socket for every endpoint, the first host's name: each entry no endpoint gets is a
    problem, and so is an endpoint whose metadata no entry matches."""
    cluster = copy.deepcopy(EXAMPLE)
    second = copy.deepcopy(cluster["transport_socket"])
    second["typed_config"]["sni"] = "b.tensorx.example"
    second["typed_config"]["common_tls_context"]["validation_context"]["match_typed_subject_alt_names"][0]["matcher"]["exact"] = \
        "b.tensorx.example"
    cluster["transport_socket_matches"] = [
        {"name": "tls-a", "match": {"host": "api.tensorx.example"}, "transport_socket": copy.deepcopy(cluster["transport_socket"])},
        {"name": "tls-b", "match": {"host": "b.tensorx.example"}, "transport_socket": second},
    ]
    cluster["type"] = "STRICT_DNS"
    endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
    other = copy.deepcopy(endpoint)
    other["endpoint"]["address"]["socket_address"]["address"] = "b.tensorx.example"
    cluster["load_assignment"]["endpoints"][0]["lb_endpoints"].append(other)

    def match_problems(cluster: dict) -> list[str]:
        return [p for p in envoy_check.check(CONFIG, with_tensorx(cluster)) if "transport_socket_matches" in p]

    bare = match_problems(cluster)
    assert len(bare) == 2 and all("no endpoint gets transport_socket_matches" in p for p in bare), bare
    endpoint["metadata"] = {"filter_metadata": {"envoy.transport_socket_match": {"host": "api.tensorx.example"}}}
    other["metadata"] = {"filter_metadata": {"envoy.transport_socket_match": {"host": "b.tensorx.example"}}}
    assert match_problems(cluster) == []
    other["metadata"]["filter_metadata"]["envoy.transport_socket_match"]["host"] = "c.tensorx.example"
    wrong = match_problems(cluster)
    assert any("b.tensorx.example:443 has envoy.transport_socket_match metadata" in p for p in wrong), wrong
    assert any("no endpoint gets transport_socket_matches[1]" in p for p in wrong), wrong
    cluster["load_assignment"]["endpoints"][0]["metadata"] = {"filter_metadata": {"envoy.transport_socket_match": {"host": "b.tensorx.example"}}}
    del other["metadata"]  # Envoy reads the locality's metadata when the endpoint's matches no entry
    assert match_problems(cluster) == []
