"""The `iris-extproc` and `iris-lab` commands by the conventions operators expect (issue 22):
`--version` from the package metadata, every option's help with its default, global options
before or after the subcommand, IRIS_CONFIG / IRIS_REDIS_URL / IRIS_LOG_LEVEL, `undrain` that
says when nothing was drained, and `status --redis-url` that works while the routing file is
broken and names the outage policy, against a real Redis."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from importlib.metadata import version

import pytest
import yaml

from extproc import cli
from extproc.config import parse_config
from extproc.config.examples import envoy_yaml, example_config
from extproc.operations.fleet_state import instance_description
from extproc.routing.outage import InstanceRegistry
from irislab import cli as lab_cli
from tests.support.configs import ROOT, small_config_data

ENV_VARS = ("IRIS_CONFIG", "IRIS_REDIS_URL", "IRIS_LOG_LEVEL")


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)


def run(*args: str, module: str = "extproc.cli", env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**{k: v for k, v in os.environ.items() if k not in ENV_VARS}, **(env or {})})


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


@pytest.mark.parametrize("module, prog", [("extproc.cli", "iris-extproc"), ("irislab.cli", "iris-lab")])
def test_version_comes_from_the_package_metadata(module, prog):
    result = run("--version", module=module)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{prog} {version('iris-extproc')}"


@pytest.mark.parametrize("make_parser", [cli._parser, lab_cli._parser], ids=["iris-extproc", "iris-lab"])
def test_every_option_has_help_and_shows_its_default(make_parser):
    parser = make_parser()
    checked = 0
    for name, sub in {"": parser, **subcommands(parser)}.items():
        text = " ".join(sub.format_help().split())
        for action in sub._actions:
            if not action.option_strings or action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
                continue
            assert action.help, (name, action.option_strings)
            default = "info" if action.dest == "log_level" else action.default
            if default not in (None, False, argparse.SUPPRESS) and not isinstance(action, argparse._VersionAction):
                assert f"(default: {default}" in text, (name, action.option_strings, text)
                checked += 1
    assert checked >= 8 if make_parser is cli._parser else checked >= 2


@pytest.mark.parametrize(
    "argv, level",
    [
        (["--log-level", "warning", "status", "--redis-url", "redis://h:1/0"], "warning"),
        (["status", "--redis-url", "redis://h:1/0", "--log-level", "DEBUG"], "debug"),
        (["--log-level", "warning", "status", "--log-level", "error", "--redis-url", "redis://h:1/0"], "error"),
        (["status", "--redis-url", "redis://h:1/0"], "info"),
    ],
)
def test_global_options_go_before_or_after_the_subcommand(argv, level):
    assert cli._parser().parse_args(argv).log_level == level
    lab = lab_cli._parser().parse_args(["up", "--log-level", level] if level != "info" else ["up"])
    assert lab.log_level == level


def test_a_global_option_after_the_subcommand_runs():
    result = run("check", "--config", str(example_config()), "--envoy", str(envoy_yaml()), "--log-level", "debug")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok: ")


def test_the_environment_gives_defaults_and_a_flag_wins(monkeypatch):
    monkeypatch.setenv("IRIS_CONFIG", str(example_config()))
    monkeypatch.setenv("IRIS_REDIS_URL", "redis://10.0.0.1:6380/2")
    monkeypatch.setenv("IRIS_LOG_LEVEL", "WARNING")
    args = cli._parser().parse_args(["drain", "iris-1"])
    assert (args.config, args.redis_url, args.log_level) == (str(example_config()), "redis://10.0.0.1:6380/2", "warning")
    args = cli._parser().parse_args(["drain", "iris-1", "--config", "other.yaml", "--redis-url", "redis://h:1/0", "--log-level", "error"])
    assert (args.config, args.redis_url, args.log_level) == ("other.yaml", "redis://h:1/0", "error")
    monkeypatch.setenv("COLUMNS", "40")  # a narrow terminal: every help line wraps, as a long checkout path does
    help_lines = subcommands(cli._parser())["drain"].format_help().splitlines()
    help_text = " ".join(" ".join(help_lines).split())
    assert f"(default: {example_config()})" in help_text and "environment: IRIS_CONFIG" in help_text
    assert any(str(example_config()) in line for line in help_lines)  # the path is never cut, whatever its length
    assert "(default: warning; environment: IRIS_LOG_LEVEL)" in help_text
    result = run("check", "--envoy", str(envoy_yaml()), env={"IRIS_CONFIG": str(example_config())})
    assert result.returncode == 0 and result.stdout.startswith("ok: "), result.stderr


@pytest.mark.parametrize("name, value", [("IRIS_LOG_LEVEL", "loud"), ("IRIS_REDIS_URL", "http://x")])
def test_a_bad_environment_variable_is_one_line_naming_it(name, value):
    result = run("status", env={name: value})
    assert result.returncode == 2 and result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"iris-extproc: {name}: ")


def test_a_redis_url_flag_must_be_a_redis_url():
    result = run("status", "--redis-url", "localhost:6379")
    assert result.returncode == 2 and "is not a redis:// or rediss:// URL" in result.stderr


async def main(*argv: str) -> int:
    """`iris-extproc ARGV` in a thread: it runs its own event loop, the test's is busy."""
    return await asyncio.to_thread(cli.main, list(argv))


def write(path, data) -> str:
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return str(path)


async def test_undrain_of_a_pair_not_drained_says_so(tmp_path, redis_client, redis_url, capsys):
    config = write(tmp_path / "routing.yaml", small_config_data(redis_url))
    assert await main("undrain", "iris-2", "--config", config) == 0
    assert capsys.readouterr().out == "iris-2 m was not drained\n"
    elsewhere = write(tmp_path / "elsewhere.yaml", small_config_data("redis://127.0.0.1:1/0"))  # --redis-url wins
    assert await main("drain", "iris-2", "--config", elsewhere, "--redis-url", redis_url) == 0
    assert await main("undrain", "iris-2", "--config", config) == 0
    assert capsys.readouterr().out == "drained iris-2 m\nundrained iris-2 m\n"
    assert await main("drain", "iris-2", "--config", config) == 0
    assert await main("undrain", "iris-2", "--config", config) == 0
    assert capsys.readouterr().out == "drained iris-2 m\nundrained iris-2 m\n"
    assert await main("undrain", "iris-2", "--config", config) == 0
    assert capsys.readouterr().out == "iris-2 m was not drained\n"


def broken(data: dict) -> dict:
    data = json.loads(json.dumps(data))
    data["providers"][0]["models"]["m"]["limits"]["max_pinned_sessions"] = -1
    return data


async def test_status_with_a_broken_file_reads_redis_and_names_the_default_policy(tmp_path, redis_client, redis_url, capsys):
    """No live instance: nothing says which pairs exist, but Redis is read and the policy named."""
    data = broken(small_config_data("redis://127.0.0.1:1/0"))
    data["redis"]["outage_policy"] = "fail_closed"
    config = write(tmp_path / "routing.yaml", data)
    assert await main("status", "--config", config, "--redis-url", redis_url) == 0
    captured = capsys.readouterr()
    assert "providers[0].models.m.limits.max_pinned_sessions: must be >= 0" in captured.err
    assert "no live instance advertises its routing config" in captured.err
    assert captured.out.splitlines() == [
        "live proxy instances: 0",
        "outage policy: fail_closed (the routing config's redis section): while Redis is unreachable, new requests get 503 "
        "routing_unavailable",
    ]
    assert await main("status", "--redis-url", redis_url, "--json") == 0  # no file at all
    document = json.loads(capsys.readouterr().out)
    assert document["pairs"] == [] and document["outage_policy"]["policy"] == "degrade" and document["outage_policy"]["source"] == "the default"


async def test_status_with_a_broken_file_shows_what_the_live_instances_run(tmp_path, redis_client, redis_url, capsys):
    """Two instances advertise the config they run (as `serve` does with every heartbeat); the
    file on disk has an error. `status --redis-url` shows their pairs, with the live counts, and
    their outage policy, not the file's."""
    running = parse_config(small_config_data(redis_url, redis={"url": redis_url, "key_prefix": "t", "outage_policy": "local_share"}))
    registries = [InstanceRegistry(redis_client, "t") for _ in range(2)]
    for registry in registries:
        registry.description = instance_description(running)
        await registry.heartbeat()
    assert await main("drain", "iris-1", "--model", "m", "--config", write(tmp_path / "ok.yaml", small_config_data(redis_url))) == 0
    capsys.readouterr()
    file = broken(small_config_data(redis_url))
    file["redis"]["outage_policy"] = "fail_closed"  # what the file says, not what runs
    config = write(tmp_path / "routing.yaml", file)
    for argv in (["status", "--config", config, "--redis-url", redis_url], ["status", "--config", config]):
        assert await main(*argv) == 0
        captured = capsys.readouterr()
        assert "must be >= 0" in captured.err and "the pairs shown are those the live instances run" in captured.err
        lines = {tuple(line.split()[:3]): line for line in captured.out.splitlines()}
        assert lines[("iris-1", "managed", "m")].split()[3:6] == ["0/4", "0/2", "drained"]
        assert ("iris-1", "managed", "e") in lines and ("tensorx", "unlimited", "m") in lines
        assert lines[("live", "proxy", "instances:")].endswith(" 2")
        assert lines[("outage", "policy:", "local_share")].startswith("outage policy: local_share (run by 2 live instances): ")
    assert await main("status", "--redis-url", redis_url, "--key-prefix", "t", "--json") == 0  # no file at all
    document = json.loads(capsys.readouterr().out)
    assert document["pairs_from"] == "live instances" and document["live_instances"] == 2
    assert document["outage_policy"] == {"policy": "local_share", "source": "run by 2 live instances", "instances": {"local_share": 2}}
    for registry in registries:
        await registry.leave()
    assert await main("status", "--redis-url", redis_url, "--key-prefix", "t") == 0
    assert capsys.readouterr().out.splitlines()[0] == "live proxy instances: 0"


def test_status_needs_a_file_or_a_redis_url():
    result = run("status")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip() == "iris-extproc: status needs --config or --redis-url (or IRIS_CONFIG, IRIS_REDIS_URL)"


def test_drain_without_redis_is_one_line(tmp_path):
    config = write(tmp_path / "routing.yaml", small_config_data("redis://127.0.0.1:1/0"))
    result = run("drain", "iris-2", "--config", config)
    assert result.returncode == 1 and result.stdout == "" and "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("iris-extproc: cannot reach Redis at 127.0.0.1:1: ")


def test_a_reader_that_went_away_ends_the_command_quietly():
    """`iris-extproc envoy-config | head -1`: the reader closes the pipe before the bootstrap is
    written; the command ends with 1 and writes no traceback (nor Python's "Exception ignored")."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run([sys.executable, "-m", "extproc.cli", "envoy-config", "--config", str(ROOT / "envoy" / "example-config.yaml")],
                                stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write_end)
    assert result.returncode == 1 and result.stderr == "", result.stderr


async def test_status_says_when_the_file_is_not_what_the_live_instances_run(tmp_path, redis_client, redis_url, capsys):
    """The file raised iris-1's pin limit; the running instances were not reloaded. The limits
    shown are the file's (the operator asked for them), and stderr says they are not what runs."""
    running = parse_config(small_config_data(redis_url, redis={"url": redis_url, "key_prefix": "t"}))
    registry = InstanceRegistry(redis_client, "t")
    registry.description = instance_description(running)
    await registry.heartbeat()
    try:
        same = write(tmp_path / "same.yaml", small_config_data(redis_url))
        assert await main("status", "--config", same) == 0
        assert "not those" not in capsys.readouterr().err  # the file is what runs: nothing to say
        edited = json.loads(json.dumps(small_config_data(redis_url)))  # its pairs share one limits dict
        edited["providers"][0]["models"]["m"]["limits"]["max_pinned_sessions"] = 9
        edited_path = write(tmp_path / "edited.yaml", edited)
        assert await main("status", "--config", edited_path) == 0
        captured = capsys.readouterr()
        assert f"the limits shown are those of {edited_path}, not those 1 of the 1 live instances run (they differ on iris-1 m)" in captured.err
        line = next(line for line in captured.out.splitlines() if line.split()[:3] == ["iris-1", "managed", "m"])
        assert line.split()[4] == "0/9"  # the file's limit, as said
        assert await main("status", "--config", edited_path, "--json") == 0
        assert json.loads(capsys.readouterr().out)["instances_running_other_limits"] == 1
    finally:
        await registry.leave()
