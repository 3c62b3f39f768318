"""`check` refuses an ext_proc filter the server cannot work with (issue 29 item 13): its own
processing_mode (not only allowed_override_modes), the settings under which Envoy does not do
what the server answers (failure_mode_allow, observability_mode, disable_immediate_response,
disable_clear_route_cache, route_cache_action RETAIN), its place after the router filter, and a
per-route config of the routing route that disables the filter or overrides those."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import yaml

from extproc.config import envoy_check, parse_config
from extproc.config.examples import envoy_yaml, example_config

CONFIG = parse_config(yaml.safe_load(example_config().read_text()))
SHIPPED = envoy_check.load_bootstrap(envoy_yaml())
PER_ROUTE = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"


def manager(bootstrap: dict) -> dict:
    return bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


def ext_proc(bootstrap: dict) -> dict:
    return manager(bootstrap)["http_filters"][0]["typed_config"]


def routing_route(bootstrap: dict) -> dict:
    return manager(bootstrap)["route_config"]["virtual_hosts"][0]["routes"][0]


def mode(**fields):
    def change(bootstrap):
        ext_proc(bootstrap)["processing_mode"].update(fields)
    return change


def setting(**fields):
    def change(bootstrap):
        ext_proc(bootstrap).update(fields)
    return change


def after_the_router(bootstrap):
    filters = manager(bootstrap)["http_filters"]
    filters.reverse()


def no_processing_mode(bootstrap):
    del ext_proc(bootstrap)["processing_mode"]


def disabled(bootstrap):
    manager(bootstrap)["http_filters"][0]["disabled"] = True


def per_route(config: dict, at: str = "route"):
    def change(bootstrap):
        scope = routing_route(bootstrap) if at == "route" else manager(bootstrap)["route_config"]["virtual_hosts"][0]
        scope["typed_per_filter_config"] = {"envoy.filters.http.ext_proc": {"@type": PER_ROUTE, **config}}
    return change


CASES = {
    "request_body_mode STREAMED": (mode(request_body_mode="STREAMED"), "request_body_mode: STREAMED, but the server needs BUFFERED"),
    "request_body_mode BUFFERED_PARTIAL": (mode(request_body_mode="BUFFERED_PARTIAL"), "needs BUFFERED"),
    "request_body_mode as Envoy's number 1": (mode(request_body_mode=1), "request_body_mode: STREAMED"),
    "response_header_mode SKIP": (mode(response_header_mode="SKIP"), "response_header_mode: SKIP, but the server needs SEND"),
    "response_trailer_mode SKIP": (mode(response_trailer_mode="SKIP"), "response_trailer_mode: SKIP, but the server needs SEND"),
    "response_body_mode STREAMED": (mode(response_body_mode="STREAMED"), "response_body_mode: STREAMED, but the server needs NONE"),
    "request_header_mode SKIP": (mode(request_header_mode="SKIP"), "request_header_mode: SKIP"),
    "no processing_mode (Envoy's defaults)": (no_processing_mode, "request_body_mode: NONE, but the server needs BUFFERED"),
    "failure_mode_allow": (setting(failure_mode_allow=True), "sets failure_mode_allow: true, but it must stay false"),
    "observability_mode": (setting(observability_mode=True), "sets observability_mode: true"),
    "disable_immediate_response": (setting(disable_immediate_response=True), "sets disable_immediate_response: true"),
    "disable_clear_route_cache": (setting(disable_clear_route_cache=True), "sets disable_clear_route_cache: true"),
    "route_cache_action RETAIN": (setting(route_cache_action="RETAIN"), "route_cache_action is RETAIN"),
    "after the router filter": (after_the_router, "the ext_proc filter comes after the router filter"),
    "disabled": (disabled, "the ext_proc filter is disabled (disabled: true)"),
    "the routing route disables it": (per_route({"disabled": True}), "the routing route's ext_proc per-route config disables"),
    "its virtual host disables it": (per_route({"disabled": True}, at="host"), "per-route config disables the ext_proc filter"),
    "the routing route streams the body": (per_route({"overrides": {"processing_mode": {"request_body_mode": "STREAMED"}}}),
                                           "per-route config's processing_mode has request_body_mode: STREAMED"),
    "the routing route fails open": (per_route({"overrides": {"failure_mode_allow": True}}), "per-route config sets failure_mode_allow"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_filter_the_server_cannot_work_with_is_refused(case):
    change, expected = CASES[case]
    bootstrap = copy.deepcopy(SHIPPED)
    change(bootstrap)
    problems = envoy_check.check(CONFIG, bootstrap)
    assert any(expected in p for p in problems), problems


def test_the_shipped_filter_and_harmless_variants_pass():
    assert envoy_check.check(CONFIG, SHIPPED) == []
    bootstrap = copy.deepcopy(SHIPPED)
    ext_proc(bootstrap)["processing_mode"].update(request_trailer_mode="SEND", request_header_mode="DEFAULT")  # passed on; the default
    ext_proc(bootstrap)["route_cache_action"] = "CLEAR"
    routing_route(bootstrap)["typed_per_filter_config"] = {
        "envoy.filters.http.ext_proc": {"@type": PER_ROUTE, "overrides": {"request_attributes": ["request.path"]}},
    }
    # A route that is not the routing one (a health route answered by Envoy) may run without it.
    routes = manager(bootstrap)["route_config"]["virtual_hosts"][0]["routes"]
    routes.insert(0, {"match": {"path": "/healthz"}, "direct_response": {"status": 200},
                      "typed_per_filter_config": {"envoy.filters.http.ext_proc": {"@type": PER_ROUTE, "disabled": True}}})
    assert envoy_check.check(CONFIG, bootstrap) == []


def test_the_check_command_refuses_a_streamed_body(tmp_path):
    bootstrap = yaml.safe_load(envoy_yaml().read_text())
    mode(request_body_mode="STREAMED")(bootstrap)
    setting(failure_mode_allow=True)(bootstrap)
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(bootstrap))
    result = subprocess.run([sys.executable, "-m", "extproc.cli", "check", "--config", str(example_config()), "--envoy", str(path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "request_body_mode: STREAMED, but the server needs BUFFERED" in result.stdout
    assert "failure_mode_allow: true, but it must stay false" in result.stdout
