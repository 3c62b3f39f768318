"""`check` never raises on any YAML (issue 29 item 9): a malformed value anywhere in the Envoy
file (a cluster `name: [iris-2]`, a list where a mapping goes, ...) is a problem named in one
sentence, never a TypeError; YAML text the safe loader cannot read (a date that is none, an
explicit tag that does not fit, nesting too deep) is one error naming the file, for the Envoy
file and the routing config alike; `iris-extproc check` says so without a traceback; and a
template of any shape renders or is one RenderError (`envoy-config --template`)."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.config import ConfigError, envoy_check, load_config, parse_config
from extproc.config.envoy_render import RenderError, render
from extproc.config.examples import envoy_yaml, example_config
from extproc.config.yaml_text import YamlTextError, parse_yaml
from tests.support.configs import ROOT

CONFIG = parse_config(yaml.safe_load(example_config().read_text()))
SHIPPED = envoy_check.load_bootstrap(envoy_yaml())


def rich_bootstrap() -> dict:
    """The shipped file with more for `check` to read: the third-party example's TLS cluster as
    tensorx (with a transport socket match too) and an ext_proc per-route config on the routing route."""
    bootstrap = copy.deepcopy(SHIPPED)
    example = yaml.safe_load((ROOT / "envoy" / "third-party-cluster.example.yaml").read_text())["clusters"][0]
    example["transport_socket_matches"] = [{"name": "b", "match": {"host": "b"}, "transport_socket": copy.deepcopy(example["transport_socket"])}]
    clusters = bootstrap["static_resources"]["clusters"]
    clusters[[c["name"] for c in clusters].index("tensorx")] = example
    manager = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    manager["route_config"]["virtual_hosts"][0]["routes"][0]["typed_per_filter_config"] = {"envoy.filters.http.ext_proc": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
        "overrides": {"processing_mode": {"request_body_mode": "BUFFERED"}, "failure_mode_allow": False}}}
    return bootstrap


RICH = rich_bootstrap()

# What a YAML document can hold, odd shapes included: scalars of every kind, lists and mappings
# (keys of any hashable scalar kind, as PyYAML makes them).
SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=12) | st.sampled_from(
    ["iris-1", "extproc", "envoy.filters.http.ext_proc", "envoy.filters.http.router", "SEND", "BUFFERED", "STREAMED", "5s"]
)
KEYS = st.text(max_size=10) | st.sampled_from(["name", "typed_config", "clusters", "http_filters", "processing_mode"]) | st.integers()
TREES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=4), max_leaves=20)


def paths(node, prefix=()):
    """Every path (keys and indexes) into `node`, its root included."""
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from paths(value, (*prefix, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from paths(value, (*prefix, index))


RICH_PATHS = [p for p in paths(RICH) if p]


def replaced(bootstrap: dict, path: tuple, value) -> dict:
    """A copy of `bootstrap` with `value` at `path`."""
    out = copy.deepcopy(bootstrap)
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


def assert_sentences(problems) -> None:
    assert isinstance(problems, list) and all(isinstance(p, str) and "\n" not in p for p in problems), problems


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(RICH_PATHS), TREES)
def test_any_value_anywhere_in_the_shipped_file_is_a_problem_not_an_exception(path, value):
    assert_sentences(envoy_check.check(CONFIG, replaced(RICH, path, value)))


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["static_resources", "admin", "x"]), TREES, max_size=3))
def test_any_bootstrap_shape_is_a_problem_not_an_exception(bootstrap):
    assert_sentences(envoy_check.check(CONFIG, bootstrap))


def test_a_cluster_name_that_is_no_string_is_named():
    clusters = [dict(c) for c in SHIPPED["static_resources"]["clusters"]]
    clusters[2] = {**clusters[2], "name": ["iris-2"]}
    bootstrap = {**SHIPPED, "static_resources": {**SHIPPED["static_resources"], "clusters": clusters}}
    problems = envoy_check.check(CONFIG, bootstrap, "envoy.yaml")
    assert "envoy.yaml: static_resources.clusters[2] has no name that is a string (name: ['iris-2'])" in problems
    assert any(p.startswith("provider iris-2: cluster 'iris-2' is not a cluster of envoy.yaml") for p in problems)


@pytest.mark.parametrize("text", [
    "a: 2020-02-30", "a: 0x_", "a: !!float x", "a: !!bool maybe", "a: !!timestamp 2020-13-45", "[" * 5000, "a: [", "? [1]\n: 2",
])
def test_yaml_the_safe_loader_cannot_read_is_one_error(text, tmp_path):
    with pytest.raises(YamlTextError):
        parse_yaml(text)
    path = tmp_path / "file.yaml"
    path.write_text(text)
    with pytest.raises(envoy_check.EnvoyConfigError, match=f"the Envoy configuration {path} is not valid YAML: "):
        envoy_check.load_bootstrap(path)
    with pytest.raises(ConfigError, match="<file>: not valid YAML: "):
        load_config(path)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab:-[]{}!&*?|>'\"#,0x123456789 \n\t.")), max_size=60))
def test_any_text_is_a_value_or_one_error(text):
    try:
        parse_yaml(text)
    except YamlTextError as exc:
        assert "\n" not in str(exc)


def test_the_check_command_names_a_malformed_value_without_a_traceback(tmp_path):
    envoy = yaml.safe_load(envoy_yaml().read_text())
    (iris2,) = [c for c in envoy["static_resources"]["clusters"] if c["name"] == "iris-2"]
    iris2["name"] = ["iris-2"]
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(envoy))
    result = subprocess.run([sys.executable, "-m", "extproc.cli", "check", "--config", str(example_config()), "--envoy", str(path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "has no name that is a string (name: ['iris-2'])" in result.stdout
    assert "Traceback" not in result.stdout + result.stderr
    path.write_text("static_resources: {clusters: [{name: a, connect_timeout: 2020-02-30}]}")
    result = subprocess.run([sys.executable, "-m", "extproc.cli", "check", "--config", str(example_config()), "--envoy", str(path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "is not valid YAML: a value that cannot be read" in result.stderr, result.stderr
    assert "Traceback" not in result.stdout + result.stderr


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(RICH_PATHS), TREES)
def test_any_template_shape_renders_or_is_a_render_error(path, value):
    """`iris-extproc envoy-config --template`: a template of any shape renders (the result is then
    checked) or is one RenderError, never another exception."""
    try:
        rendered = render(CONFIG, replaced(RICH, path, value))
    except RenderError:
        return
    assert_sentences(envoy_check.check(CONFIG, rendered, addresses=False))


@pytest.mark.parametrize("command", [["check", "--envoy", str(envoy_yaml())], ["status"], ["envoy-config"]])
def test_a_routing_config_the_safe_loader_cannot_read_is_one_error_in_every_command(command, tmp_path):
    path = tmp_path / "routing.yaml"
    path.write_text("redis: {url: 'redis://127.0.0.1:1/0'}\nproviders: []\nwhen: 2020-02-30\n")
    result = subprocess.run([sys.executable, "-m", "extproc.cli", command[0], "--config", str(path), *command[1:]],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "not valid YAML: a value that cannot be read (ValueError: day is out of range for month)" in result.stderr
    assert "Traceback" not in result.stdout + result.stderr
