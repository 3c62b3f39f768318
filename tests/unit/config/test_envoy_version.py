"""The minimum Envoy (issue 22): reading `/server_info`'s version and comparing it with the
features envoy/envoy.yaml uses. `check --envoy-admin` against a running Envoy is in
tests/gateway/test_operator_commands.py."""

from __future__ import annotations

import pytest
import yaml

from extproc.config.envoy_version import (
    FEATURES,
    MINIMUM_ENVOY,
    EnvoyVersionError,
    version_from_server_info,
    version_problem,
)
from extproc.config.examples import envoy_yaml


@pytest.mark.parametrize(
    "version, parsed",
    [
        ("9e5580933739775e8bce696a57a2e1bc99368f23/1.40.0/Clean/RELEASE/BoringSSL", (1, 40, 0)),
        ("dc2d3098ae5641555f15c71d5bb5ce0060a8015c/1.36.2/Clean/RELEASE/BoringSSL", (1, 36, 2)),
        ("abc/1.41.0-dev/Modified/DEBUG/BoringSSL-FIPS", (1, 41, 0)),
        ("1.34.1", (1, 34, 1)),
    ],
)
def test_the_version_is_read_from_server_info(version, parsed):
    assert version_from_server_info({"version": version, "state": "LIVE"}) == parsed


@pytest.mark.parametrize("info", [{}, {"version": "unknown"}, {"version": 140}, ["1.40.0"], None])
def test_server_info_without_a_version_is_an_error(info):
    with pytest.raises(EnvoyVersionError):
        version_from_server_info(info)


def test_the_minimum_is_the_newest_feature_used():
    assert MINIMUM_ENVOY == (1, 37)
    assert version_problem((1, 37, 0)) is None and version_problem((1, 40, 0)) is None and version_problem((2, 0, 0)) is None
    assert version_problem((1, 36, 2)) == (
        "Envoy 1.36.2 is older than 1.37, the oldest that runs envoy/envoy.yaml; it lacks ext_proc on Envoy's own reply to a "
        "refused connection (the connect degradation) (1.37)"
    )
    assert "the access log's %PATH(NQ)% (1.34)" in version_problem((1, 33, 9))
    problem = version_problem((1, 29, 3))
    assert problem.startswith("Envoy 1.29.3 is older than 1.37")
    assert all(f"({major}.{minor})" in problem for major, minor, _ in FEATURES)  # everything newer than 1.29 is named


def test_the_features_named_are_in_envoy_yaml():
    """If envoy.yaml stops using one of them, the minimum may drop: this test says so."""
    text = envoy_yaml().read_text()
    bootstrap = yaml.safe_load(text)
    assert "%PATH(NQ)%" in text and "reset-before-request" in text
    ext_proc = [f["typed_config"] for listener in bootstrap["static_resources"]["listeners"]
                for chain in listener["filter_chains"] for nf in chain["filters"]
                for f in nf["typed_config"].get("http_filters", []) if f["name"] == "envoy.filters.http.ext_proc"]
    (config,) = ext_proc
    assert config["allowed_override_modes"] and config["response_attributes"] and config["metadata_options"]["receiving_namespaces"]
