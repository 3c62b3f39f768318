"""The operator's commands against a running gateway (issue 22): `drain --wait` returns only once
a request that runs across the drain has ended (and gives up with exit code 1 at its timeout),
`status --redis-url` works while the routing file is broken and names the outage policy the
instances run, and `check --envoy-admin` reads the running Envoy's version."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest
import yaml

from extproc.config.envoy_version import MINIMUM_ENVOY, format_version
from tests.support.configs import ROOT
from tests.support.gateway import MODEL, PrintedLines, chat_body, start_gateway

LONG = 400  # tokens of a generation that outlasts the checks below (20 ms each: about 8 s)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    gw = start_gateway(tmp_path_factory.mktemp("operator"))  # 20 ms per token
    yield gw
    gw.stop()


def command(*args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("IRIS_CONFIG", "IRIS_REDIS_URL", "IRIS_LOG_LEVEL")}
    return subprocess.Popen([sys.executable, "-m", "extproc.cli", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, env=env)


def run(*args: str) -> subprocess.CompletedProcess:
    process = command(*args)
    out, err = process.communicate(timeout=120)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def stream_on_own_provider(http: httpx.Client, gateway, user: str):
    """A long streamed generation of a new session: (response, its data events, the provider:
    iris-1, or iris-2 while an instance still sees iris-1 drained by an earlier test)."""
    response = http.send(http.build_request("POST", f"{gateway.url}/v1/chat/completions", headers={"x-user-id": user},
                                            json=chat_body(f"long story for {user}", max_tokens=LONG, stream=True)), stream=True)
    assert response.status_code == 200 and response.headers["x-iris-provider"] in ("iris-1", "iris-2"), response.headers
    return response, (line for line in response.iter_lines() if line.startswith("data:")), response.headers["x-iris-provider"]


def test_drain_wait_returns_once_the_request_running_across_it_has_ended(gateway):
    config = str(gateway.running[0].config_path)
    with httpx.Client(timeout=60) as http:
        response, events, provider = stream_on_own_provider(http, gateway, "drainer")
        for _ in range(3):
            next(events)  # generating: its lease is held on iris-1
        drain = command("drain", provider, "--model", MODEL, "--config", config, "--wait", "--wait-timeout", "120")
        printed = PrintedLines(drain.stdout)
        try:
            assert printed.next() == f"drained {provider} {MODEL}\n"
            assert printed.next().startswith(f"waiting: 1 requests in flight ({provider} {MODEL}: 1), ")
            # Through the first half of the generation (4 s of it), drain still waits: it returns
            # only once the request has ended, whatever its refresh interval (1 s) says.
            for _ in range(LONG // 2):
                next(events)
                assert drain.poll() is None, printed.seen
            rest = list(events)
            response.close()
            assert rest[-1] == "data: [DONE]" and len(rest) > LONG // 3
            drain.wait(timeout=60)
            while printed.next() is not None:
                pass
        finally:
            drain.kill()
    assert drain.returncode == 0, drain.stderr.read()
    assert printed.seen[-1].startswith(f"no request in flight on {provider} {MODEL} after ")
    assert run("undrain", provider, "--model", MODEL, "--config", config).stdout == f"undrained {provider} {MODEL}\n"


def test_drain_wait_gives_up_at_its_timeout_and_the_drain_stays(gateway):
    config = str(gateway.running[0].config_path)
    with httpx.Client(timeout=60) as http:
        response, events, provider = stream_on_own_provider(http, gateway, "timeout")
        next(events)
        result = run("drain", provider, "--model", MODEL, "--config", config, "--wait", "--wait-timeout", "1")
        assert next(events)  # still generating
        response.close()
    assert result.returncode == 1, result
    assert result.stderr.strip() == f"iris-extproc: still 1 requests in flight after 1 s ({provider} {MODEL}: 1); the drain stays"
    status = run("status", "--config", config)
    line = next(line for line in status.stdout.splitlines() if line.split()[:3] == [provider, "managed", MODEL])
    assert " drained " in line
    assert run("undrain", provider, "--model", MODEL, "--config", config).returncode == 0


def test_status_with_a_broken_routing_file_shows_the_running_fleet(gateway, tmp_path):
    data = yaml.safe_load(gateway.running[0].config_path.read_text())
    data["providers"][1]["kind"] = "manged"
    data["redis"]["outage_policy"] = "fail_closed"  # the broken file's, not what runs
    broken = tmp_path / "routing.yaml"
    broken.write_text(yaml.safe_dump(data))
    for extra in ((), ("--redis-url", gateway.redis_url)):
        result = run("status", "--config", str(broken), *extra)
        assert result.returncode == 0, result.stderr
        assert "providers[1].kind: Input should be 'managed' or 'unlimited'" in result.stderr
        lines = {tuple(line.split()[:3]): line for line in result.stdout.splitlines()}
        assert {("iris-1", "managed", MODEL), ("iris-2", "managed", MODEL), ("tensorx", "unlimited", MODEL)} <= set(lines)
        assert lines[("live", "proxy", "instances:")] == "live proxy instances: 1"
        assert lines[("outage", "policy:", "degrade")].startswith("outage policy: degrade (run by 1 live instance): while Redis is "
                                                                  "unreachable, only pairs without an in-flight limit")


def test_check_reads_the_running_envoys_version(gateway):
    instance = gateway.running[0]
    admin = f"http://127.0.0.1:{instance.admin_port}"
    result = run("check", "--config", str(instance.config_path), "--envoy", str(gateway.work_dir / "envoy-0.yaml"),
                 "--envoy-admin", admin)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"ok: Envoy 1.40.0 at {admin} (at least {format_version(MINIMUM_ENVOY)})" in result.stdout.splitlines()
    unreachable = run("check", "--config", str(instance.config_path), "--envoy-admin", "http://127.0.0.1:1")
    assert unreachable.returncode == 2 and unreachable.stderr.startswith("iris-extproc: cannot read the Envoy version from "
                                                                          "http://127.0.0.1:1/server_info: ")
