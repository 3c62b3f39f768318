"""`iris-extproc check` and the one-line CLI errors (issue 12): the routing config against the
Envoy file, through the real command; missing and invalid files everywhere in the CLI give one
line and no traceback; a failed start of a local gateway stops every process it started."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from extproc.config import ConfigError, envoy_check, parse_config
from extproc.config.examples import envoy_yaml, example_config
from irislab.local_gateway import GatewayConfigError, LocalGateway
from irislab.processes import ProcessError

ENVOY = envoy_yaml()
EXAMPLE = example_config()


def cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    """`iris-extproc ARGS`, or `iris-lab up ...` (irislab.cli) when ARGS start with `up`."""
    module = "irislab.cli" if args and args[0] == "up" else "extproc.cli"
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def example() -> dict:
    return yaml.safe_load(EXAMPLE.read_text())


def write(path, data) -> str:
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return str(path)


def test_the_shipped_pair_agrees():
    result = cli("check", "--config", str(EXAMPLE), "--envoy", str(ENVOY))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("ok: ")


def test_every_disagreement_is_named(tmp_path):
    data = example()
    data["providers"].append({"name": "iris-3", "kind": "managed", "cluster": "iris-3", "models": {"m": {"features": ["chat"]}}})
    data["providers"][0]["health_check"]["url"] = "http://10.1.2.3:8001/health"
    data["providers"][1]["load"]["url"] = "http://127.0.0.1:9999/metrics"
    data["server"]["routing_header"] = "x-route"
    data["server"]["listen"] = "127.0.0.1:6000"
    result = cli("check", "--config", write(tmp_path / "r.yaml", data), "--envoy", str(ENVOY))
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert "disagree" in lines[0]
    problems = [line.strip() for line in lines[1:]]
    assert any(p.startswith("provider iris-3: cluster 'iris-3' is not a cluster of") for p in problems)
    assert any("cluster_header is 'x-iris-cluster' but server.routing_header is 'x-route'" in p for p in problems)
    assert any("no early header mutation removes 'x-route'" in p for p in problems)
    assert any("reaches port 50051 but server.listen is '127.0.0.1:6000'" in p for p in problems)
    assert any(p.startswith("provider iris-1: health_check.url 'http://10.1.2.3:8001/health' is not on cluster 'iris-1'") for p in problems)
    assert any(p.startswith("provider iris-2: load.url 'http://127.0.0.1:9999/metrics' is not on cluster 'iris-2'") for p in problems)
    assert len(problems) == 6, problems
    assert "Traceback" not in result.stdout + result.stderr


def ext_proc_ports(bootstrap: dict, ports: list[int]) -> dict:
    """`bootstrap` with its `extproc` cluster on 127.0.0.1 at each of `ports`."""
    (cluster,) = [c for c in bootstrap["static_resources"]["clusters"] if c["name"] == "extproc"]
    endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
    cluster["load_assignment"]["endpoints"][0]["lb_endpoints"] = [
        {**endpoint, "endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}} for port in ports
    ]
    return bootstrap


def test_every_worker_port_must_be_an_endpoint_of_the_ext_proc_cluster(tmp_path):
    """server.workers 3 on 50051: workers on 50051-50053. The shipped envoy.yaml lists 50051 only,
    so two workers would get no stream: `check` names the missing ports and exits 1; with all
    three (or more: another server's) listed, the pair agrees."""
    data = example()
    data["server"]["workers"] = 3
    result = cli("check", "--config", write(tmp_path / "r.yaml", data), "--envoy", str(ENVOY))
    assert result.returncode == 1, result.stdout + result.stderr
    assert [line.strip() for line in result.stdout.splitlines()[1:]] == [
        f"{ENVOY}: the ext_proc cluster 'extproc' lacks port 50052, 50053: server.workers is 3, worker i listens on port 50051 + i, "
        "and a worker that is no endpoint gets no stream (list ports 50051-50053)"
    ]
    config = parse_config(data)
    bootstrap = envoy_check.load_bootstrap(ENVOY)
    assert len(envoy_check.check(config, ext_proc_ports(bootstrap, [50051, 50053]))) == 1
    assert envoy_check.check(config, ext_proc_ports(bootstrap, [50051, 50052, 50053])) == []
    assert envoy_check.check(config, ext_proc_ports(bootstrap, [50051, 50052, 50053, 50054])) == []
    agreeing = write(tmp_path / "envoy.yaml", ext_proc_ports(bootstrap, [50051, 50052, 50053]))
    assert cli("check", "--config", str(tmp_path / "r.yaml"), "--envoy", agreeing).returncode == 0


def test_the_envoy_side_of_the_header():
    config = parse_config(example())
    bootstrap = yaml.safe_load(ENVOY.read_text())
    manager = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    manager["early_header_mutation_extensions"] = []
    manager["route_config"]["virtual_hosts"][0]["routes"][0]["route"]["cluster_header"] = "x-other"
    problems = envoy_check.check(config, bootstrap)
    assert len(problems) == 4 and "x-other" in problems[0] and "no early header mutation" in problems[1]
    assert "removes 'x-iris-user' (session.trusted_identity_headers), so any client could claim an identity" in problems[2]
    assert "removes 'x-iris-affinity', so a client could pick its replica" in problems[3]
    assert envoy_check.check(config, {"static_resources": "nonsense"}) != []  # a shape, never an exception


def manager_of(bootstrap: dict) -> dict:
    return bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


def ext_proc_of(bootstrap: dict) -> dict:
    return next(f["typed_config"] for f in manager_of(bootstrap)["http_filters"] if f["name"] == envoy_check.EXT_PROC_FILTER)


def test_a_trusted_identity_header_envoy_does_not_strip_is_refused(tmp_path):
    """Issue 20, item 8: a trusted identity header a client can send is a forged identity. Each
    one must be removed by the early header mutation, as the routing header is; `check`, `serve`
    and a reload all run this check."""
    data = example()
    data["session"]["trusted_identity_headers"] = ["x-iris-user", "x-user-id", "x-auth-subject"]
    result = cli("check", "--config", write(tmp_path / "r.yaml", data), "--envoy", str(ENVOY))
    assert result.returncode == 1, result.stdout + result.stderr
    problems = [line.strip() for line in result.stdout.splitlines()[1:]]
    assert problems == [
        f"{ENVOY}: no early header mutation removes {header!r} (session.trusted_identity_headers), so any client could claim an "
        "identity (early_header_mutation_extensions: remove; an authenticating filter then sets it)"
        for header in ("x-user-id", "x-auth-subject")
    ] + [
        f"{ENVOY}: the ext_proc filter's forward_rules do not forward {header!r} (session.trusted_identity_headers), which the "
        "router reads (render the file with `iris-extproc envoy-config`, or add it to allowed_headers)"
        for header in ("x-user-id", "x-auth-subject")
    ]
    served = cli("serve", "--config", str(tmp_path / "r.yaml"), "--envoy", str(ENVOY), cwd=tmp_path)
    assert served.returncode == 2 and "x-user-id" in served.stderr  # serve refuses the pair before it starts
    bootstrap = yaml.safe_load(ENVOY.read_text())
    manager_of(bootstrap)["early_header_mutation_extensions"][0]["typed_config"]["mutations"] += [
        {"remove": "x-user-id"}, {"remove": "X-Auth-Subject"},
    ]
    ext_proc_of(bootstrap)["forward_rules"]["allowed_headers"]["patterns"] += [{"exact": "x-user-id"}, {"prefix": "x-auth-"}]
    assert envoy_check.check(parse_config(data), bootstrap) == []  # stripped (names compared without case): they agree
    data["session"]["identity_sources"] = ["credential", "body"]
    assert envoy_check.check(parse_config(data), yaml.safe_load(ENVOY.read_text())) == []  # never read: nothing to forge


def test_the_ext_proc_filter_must_be_allowed_to_remove_envoys_own_headers():
    """Issue 20, item 10: x-envoy-external-address (the client's address) is a private header, and
    Envoy ignores an ext_proc removal of an x-envoy-* header unless mutation_rules allow it."""
    config = parse_config(example())
    bootstrap = yaml.safe_load(ENVOY.read_text())
    ext_proc = next(f for f in manager_of(bootstrap)["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")["typed_config"]
    assert ext_proc["mutation_rules"] == {"allow_envoy": True}  # the shipped file
    expected = [
        "envoy.yaml: the ext_proc filter may not remove 'x-envoy-external-address', so it would reach third parties "
        "(ext_proc mutation_rules: allow_envoy: true)"
    ]
    for rules, problems in [
        (None, expected),
        ({"allow_envoy": False}, expected),
        ({"allow_envoy": {"value": True}}, []),
        ({"allow_envoy": True, "disallow_expression": {"regex": "x-envoy-.*"}}, expected),
        ({"allow_expression": {"regex": "x-envoy-external-.*"}}, []),
        ({"allow_envoy": True, "disallow_all": True}, expected),
    ]:
        if rules is None:
            ext_proc.pop("mutation_rules", None)
        else:
            ext_proc["mutation_rules"] = rules
        assert envoy_check.check(config, bootstrap) == problems, rules
    data = example()
    data["adaptation"] = {"private_headers": ["cookie", "x-forwarded-for"]}
    assert envoy_check.check(parse_config(data), bootstrap) == []  # no x-envoy-* header to remove: no rule needed


def test_the_ext_proc_filter_must_allow_the_response_body_overrides_the_server_asks_for():
    """Without them Envoy ignores the server's mode override: no Responses chain is recorded and
    no model name rewritten, silently. The expected modes are the ones the server builds."""
    from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
    from google.protobuf.json_format import ParseDict

    from extproc.protocol.messages import processing_mode

    for body in ("NONE", *envoy_check.OVERRIDE_BODY_MODES):
        expected = ParseDict({**envoy_check.PROCESSING_MODE, "response_body_mode": body}, ProcessingMode())
        assert expected == processing_mode(body)
    config = parse_config(example())
    bootstrap = yaml.safe_load(ENVOY.read_text())
    ext_proc = next(f for f in manager_of(bootstrap)["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")["typed_config"]
    shipped = list(ext_proc["allowed_override_modes"])
    ext_proc["allowed_override_modes"] = shipped[:1]
    assert envoy_check.check(config, bootstrap) == [
        "envoy.yaml: the ext_proc filter's allowed_override_modes lack the processing mode with response_body_mode "
        "STREAMED (the rest as envoy/envoy.yaml's processing_mode)"
    ]
    ext_proc["allowed_override_modes"] = []  # Envoy then allows any override
    assert envoy_check.check(config, bootstrap) == []
    ext_proc["allowed_override_modes"] = [{k: v for k, v in m.items() if k != "request_trailer_mode"} for m in shipped]
    assert envoy_check.check(config, bootstrap) == []  # SKIP is Envoy's default
    del ext_proc["allow_mode_override"]
    assert envoy_check.check(config, bootstrap) == [
        "envoy.yaml: the ext_proc filter must set allow_mode_override: true (Responses chains, model names in answers)"
    ]


def test_a_pool_needs_a_consistent_hash_cluster_and_the_routes_hash_policy():
    """A managed provider keeps its sessions' replica by hash (the default affinity): its cluster
    must balance by consistent hash and the route must hash on server.affinity_header."""
    config = parse_config(example())
    bootstrap = yaml.safe_load(ENVOY.read_text())
    clusters = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}
    del clusters["iris-2"]["lb_policy"]
    manager = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    del manager["route_config"]["virtual_hosts"][0]["routes"][0]["route"]["hash_policy"]
    problems = envoy_check.check(config, bootstrap)
    assert problems == [
        "provider iris-2: cluster 'iris-2' of envoy.yaml does not balance by consistent hash, so its sessions would lose their "
        "replica's cache (lb_policy: MAGLEV or RING_HASH; or affinity: none)",
        "envoy.yaml: the route with cluster_header has no hash_policy on 'x-iris-affinity' (server.affinity_header), so provider "
        "iris-1's sessions would not keep their replica",
    ]
    data = example()
    for provider in data["providers"][:2]:
        provider["affinity"] = "none"
    assert envoy_check.check(parse_config(data), bootstrap) == []  # no pool: nothing to hash


def test_affinity_settings_are_checked():
    data = example()
    data["providers"][0].update(affinity="own_router")
    data["providers"][1].update(router_session_header="dynamo", sessionless_cluster="iris-2")
    data["providers"][2].update(affinity="session_hash", endpoints=["ftp://x", "https://api.example:443"])
    with pytest.raises(ConfigError) as raised:
        parse_config(data)
    assert raised.value.problems == [
        "providers[0].router_session_header: own_router needs one: a preset (dynamo, llm-d, sglang, vllm-router) or a header name",
        "providers[1].router_session_header: only with affinity own_router",
        "providers[1].sessionless_cluster: must differ from cluster (it balances by least request)",
        "providers[2].affinity: an unlimited provider (a third party) never receives a session key: use none",
        "providers[2].endpoints[0]: 'ftp://x' is not http(s)://host[:port]",
        "providers[2].endpoints: mixes http and https (one cluster speaks one)",
    ]


@pytest.mark.parametrize(
    "command",
    [
        ["check", "--config", "{missing}", "--envoy", "{envoy}"],
        ["check", "--config", "{example}", "--envoy", "{missing}"],
        ["check", "--config", "{bad_yaml}", "--envoy", "{envoy}"],
        ["check", "--config", "{example}", "--envoy", "{bad_yaml}"],
        ["check", "--config", "{invalid}", "--envoy", "{envoy}"],
        ["check", "--config", "{binary}", "--envoy", "{binary}"],
        ["serve", "--config", "{missing}"],
        ["serve", "--config", "{example}", "--envoy", "{missing}"],
        ["serve", "--config", "{disagreeing}", "--envoy", "{envoy}"],
        ["up", "--config", "{missing}"],
        ["up", "--envoy", "{bad_yaml}"],
        ["up", "--config", "{disagreeing}"],
        ["status", "--config", "{missing}"],
        ["status", "--config", "{directory}"],
        ["drain", "iris-1", "--config", "{invalid}"],
        ["undrain", "iris-1", "--config", "{bad_yaml}"],
    ],
)
def test_missing_and_invalid_files_are_one_line_errors(tmp_path, command):
    disagreeing = example()
    disagreeing["providers"][2]["cluster"] = "tensorx-eu"
    invalid = example()
    invalid["providers"][0]["models"]["llama-3.1-70b"]["limits"]["max_pinned_sessions"] = -1
    files = {
        "missing": str(tmp_path / "nope.yaml"),
        "envoy": str(ENVOY),
        "example": str(EXAMPLE),
        "bad_yaml": write(tmp_path / "bad.yaml", "providers: [\n"),
        "invalid": write(tmp_path / "invalid.yaml", invalid),
        "disagreeing": write(tmp_path / "disagreeing.yaml", disagreeing),
        "directory": str(tmp_path),
    }
    (tmp_path / "binary.yaml").write_bytes(b"\xff\xfe\x00garbage")
    files["binary"] = str(tmp_path / "binary.yaml")
    result = cli(*[part.format(**files) for part in command], cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    if lines[0].startswith("invalid configuration") or "disagree" in lines[0]:
        assert len(lines) >= 2 and all(line.startswith("  ") for line in lines[1:])  # one line per problem
    else:
        assert len(lines) == 1, lines
        assert lines[0].startswith("iris-lab: " if command[0] == "up" else "iris-extproc: ")


def test_drain_of_a_model_a_provider_does_not_serve_names_what_it_serves():
    """Answered from the configuration, before any Redis call (the example's Redis is not running)."""
    managed = cli("drain", "iris-1", "--model", "nosuch", "--config", str(EXAMPLE))
    assert managed.returncode == 1 and managed.stdout == ""
    assert managed.stderr.strip() == "iris-extproc: iris-1 serves no model 'nosuch' (it serves: llama-3.1-70b, bge-m3)"
    unlimited = cli("undrain", "tensorx", "--config", str(EXAMPLE))
    assert unlimited.returncode == 1
    assert unlimited.stderr.strip() == "iris-extproc: tensorx has no managed model: unlimited providers are never degraded"


def test_the_local_gateway_refuses_a_provider_missing_from_the_envoy_file(tmp_path):
    data = example()
    data["providers"].append({"name": "iris-3", "kind": "managed", "cluster": "iris-3", "models": {"m": {"features": ["chat"]}}})
    gateway = LocalGateway(config_data=data, work_dir=tmp_path)
    with pytest.raises(GatewayConfigError, match="iris-3"):
        gateway.__enter__()
    assert gateway.started == []


def test_a_failed_start_stops_every_process_it_started(tmp_path):
    """Envoy refuses its file after Redis, the providers and the ext_proc server are up: none of
    them is left running (it used to leave an orphan ext_proc server)."""
    bootstrap = yaml.safe_load(ENVOY.read_text())
    bootstrap["admin"]["no_such_field"] = True  # envoy_check has nothing against it; Envoy has
    broken = tmp_path / "envoy.yaml"
    write(broken, bootstrap)
    gateway = LocalGateway(envoy_source=broken, work_dir=tmp_path / "gw")
    with pytest.raises(ProcessError, match="envoy-0 did not start"):
        gateway.__enter__()
    names = [p.name for p in gateway.started]
    assert "extproc-0" in names and "envoy-0" in names and len(names) == 6  # redis, 3 providers, extproc, envoy
    assert not any(p.alive() for p in gateway.started)


def test_the_admission_queue_needs_its_class_header_stripped_and_time_to_wait():
    """docs/queue.md: with the queue on, a class header a client could send is a forged priority,
    and Envoy's ext_proc message_timeout (5 s in envoy.yaml) must outlast the longest wait plus
    the decision timeout (2 s)."""
    data = example()
    data.setdefault("routing", {})["queue"] = {"classes": [{"name": "interactive", "max_wait_ms": 2500}], "default_class": "interactive",
                                              "class_header": "x-iris-priority"}
    bootstrap = yaml.safe_load(ENVOY.read_text())
    problems = envoy_check.check(parse_config(data), bootstrap)
    assert len(problems) == 2 and "removes 'x-iris-priority' (routing.queue.class_header)" in problems[0]
    assert "forward_rules do not forward 'x-iris-priority' (routing.queue.class_header)" in problems[1]
    manager_of(bootstrap)["early_header_mutation_extensions"][0]["typed_config"]["mutations"].append({"remove": "x-iris-priority"})
    ext_proc_of(bootstrap)["forward_rules"]["allowed_headers"]["patterns"].append({"exact": "x-iris-priority"})
    assert envoy_check.check(parse_config(data), bootstrap) == []
    data["routing"]["queue"]["classes"][0]["max_wait_ms_by_model"] = {next(iter(data["providers"][0]["models"])): 3000}
    problems = envoy_check.check(parse_config(data), bootstrap)
    assert len(problems) == 1 and "message_timeout (5 s) must exceed" in problems[0] and "(5 s)" in problems[0]
    data["routing"]["queue"]["classes"][0] = {"name": "interactive"}  # the queue off: nothing to check
    assert envoy_check.check(parse_config(data), bootstrap) == []
