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
