"""The settings of issue 22: tracing (restart-only), token_usage and routing.third_party_share."""

from __future__ import annotations

import pytest

from extproc.config import ConfigError, parse_config
from extproc.operations.reload import keep_restart_only
from tests.support.configs import small_config_data


def test_defaults_leave_everything_off_but_reading_third_parties_usage():
    config = parse_config(small_config_data())
    assert config.tracing.otlp_endpoint is None and config.routing.third_party_share is None
    assert config.token_usage.providers == "unlimited"


@pytest.mark.parametrize(("overrides", "path"), [
    ({"tracing": {"otlp_endpoint": "grpc://collector:4317"}}, "tracing.otlp_endpoint"),
    ({"tracing": {"otlp_endpoint": "http://c:4317", "sample_ratio": 1.5}}, "tracing.sample_ratio"),
    ({"token_usage": {"providers": "some"}}, "token_usage.providers"),
    ({"routing": {"third_party_share": {"max_share": 1.2}}}, "routing.third_party_share.max_share"),
    ({"routing": {"third_party_share": {"window_seconds": 60}}}, "routing.third_party_share.max_share"),
    ({"routing": {"third_party_share": {"max_share": 0.2, "burst": -1}}}, "routing.third_party_share.burst"),
])
def test_bad_values_are_named(overrides, path):
    with pytest.raises(ConfigError) as raised:
        parse_config(small_config_data(**overrides))
    assert any(problem.startswith(path) for problem in raised.value.problems), raised.value.problems


def test_tracing_keeps_its_running_value_on_reload_and_the_rest_follows():
    running = parse_config(small_config_data())
    new = parse_config(small_config_data(
        tracing={"otlp_endpoint": "http://127.0.0.1:4317", "sample_ratio": 0.5},
        token_usage={"providers": "all"}, routing={"third_party_share": {"max_share": 0.3}},
    ))
    kept, names = keep_restart_only(running, new)
    assert kept.tracing == running.tracing and names == ["tracing.otlp_endpoint", "tracing.sample_ratio"]
    assert kept.token_usage.providers == "all" and kept.routing.third_party_share.max_share == 0.3
