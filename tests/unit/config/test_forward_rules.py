"""Issue 24: Envoy's ext_proc filter forwards only the headers the server reads
(`forward_rules.allowed_headers`, extproc.config.envoy_check.read_headers). The list must hold
every header the code reads (read from the code itself here), and the config's own headers
(identity, credential, session, queue class), or a signal is lost without a word."""

from __future__ import annotations

import ast
from pathlib import Path

import yaml

from extproc.config import envoy_check, envoy_render, parse_config
from extproc.config.examples import envoy_yaml, example_config
from extproc.protocol import tracing

PACKAGE = Path(envoy_check.__file__).resolve().parents[1]
READERS = [*sorted((PACKAGE / "protocol").glob("*.py")), *sorted((PACKAGE / "openai_api").glob("*.py"))]


def literal_header_reads(path: Path) -> set[str]:
    """The header names `path` reads by literal: `<...headers...>.get("name", ...)` and
    `header_value(<phase>, "name")`."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        function = node.func
        if isinstance(function, ast.Attribute) and function.attr == "get" and "headers" in ast.unparse(function.value).lower():
            argument = node.args[0]
        elif getattr(function, "attr", getattr(function, "id", None)) == "header_value" and len(node.args) == 2:
            argument = node.args[1]
        else:
            continue
        if isinstance(argument, ast.Constant) and isinstance(argument.value, str):
            found.add(argument.value)
    return found


def example() -> dict:
    return yaml.safe_load(example_config().read_text())


def allowed(bootstrap: dict) -> list[str]:
    [manager] = envoy_check.connection_managers(bootstrap)
    [ext_proc] = [f["typed_config"] for f in manager["http_filters"] if f["name"] == envoy_check.EXT_PROC_FILTER]
    return [pattern["exact"] for pattern in ext_proc["forward_rules"]["allowed_headers"]["patterns"]]


def test_every_header_the_code_reads_is_forwarded():
    read = set().union(*(literal_header_reads(path) for path in READERS)) | set(tracing.TRACE_HEADERS)
    # The reads of both directions are found (the parse would find nothing if the code changed shape).
    assert {":path", ":method", "content-length", ":status", "content-type", "content-encoding", "traceparent"} <= read
    assert read <= set(envoy_check.FIXED_READ_HEADERS), read - set(envoy_check.FIXED_READ_HEADERS)


def test_the_shipped_envoy_file_forwards_what_the_example_config_reads_and_nothing_else():
    bootstrap = yaml.safe_load(envoy_yaml().read_text())
    assert allowed(bootstrap) == list(envoy_check.read_headers(parse_config(example())))
    assert "user-agent" not in allowed(bootstrap) and ":authority" not in allowed(bootstrap)


def test_the_rendered_filter_forwards_the_configs_own_headers():
    data = example()
    data["session"].update(trusted_identity_headers=["x-auth-subject"], session_headers=["x-conversation-key"],
                           agent_session_headers=["x-agent-run"])
    data.setdefault("routing", {})["queue"] = {"classes": [{"name": "interactive"}], "default_class": "interactive",
                                              "class_header": "x-iris-priority"}
    config = parse_config(data)
    template = yaml.safe_load(envoy_yaml().read_text())
    rendered = envoy_render.render(config, template)
    forwarded = allowed(rendered)
    assert {"x-auth-subject", "x-conversation-key", "x-agent-run", "x-iris-priority", "authorization"} <= set(forwarded)
    assert "x-iris-user" not in forwarded and "x-session-id" not in forwarded  # the example's, not this config's
    assert forwarded == list(envoy_check.read_headers(config)) and len(forwarded) == len(set(forwarded))
    assert not [p for p in envoy_check.check(config, rendered) if "forward_rules" in p]
    missing = [p for p in envoy_check.check(config, template) if "forward_rules" in p]  # the shipped file lacks them
    assert len(missing) == 4 and all("which the router reads" in p for p in missing)
    assert any("'x-auth-subject' (session.trusted_identity_headers)" in p for p in missing)


def test_headers_of_sources_and_signals_the_config_does_not_use_are_not_forwarded():
    data = example()
    data["session"].update(identity_sources=["body"], signals=["prompt_cache_key", "prefix"])
    read = envoy_check.read_headers(parse_config(data))
    assert set(read) == set(envoy_check.FIXED_READ_HEADERS)  # no identity, credential or session header is read


def test_envoys_string_matchers_are_honoured_by_the_check():
    config = parse_config(example())
    bootstrap = yaml.safe_load(envoy_yaml().read_text())
    [manager] = envoy_check.connection_managers(bootstrap)
    rules = next(f["typed_config"] for f in manager["http_filters"] if f["name"] == envoy_check.EXT_PROC_FILTER)["forward_rules"]
    rules["allowed_headers"]["patterns"] = [{"prefix": ":"}, {"safe_regex": {"regex": "content-.*"}}, {"suffix": "-id"},
                                            {"contains": "trace"}, {"exact": "X-IRIS-USER", "ignore_case": True},
                                            {"exact": "authorization"}, {"exact": "api-key"}, {"exact": "x-api-key"},
                                            {"contains": "session"}, {"suffix": "_id"}]
    assert envoy_check.check(config, bootstrap) == []
    rules["disallowed_headers"] = {"patterns": [{"exact": "authorization"}]}
    [problem] = envoy_check.check(config, bootstrap)
    assert "'authorization' (adaptation.client_credential_headers)" in problem
    del rules["allowed_headers"], rules["disallowed_headers"]  # no rules: Envoy forwards every header
    assert envoy_check.check(config, bootstrap) == []
