"""The session secret is refused when it is a shipped placeholder, shorter than 32 bytes or a
repeated pattern, by `serve` before anything starts and by `check`, with an error naming the
variable and the setting and never the value (issue 22)."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys

import pytest
import yaml

from extproc.config import parse_config
from extproc.config.examples import envoy_yaml, example_config
from extproc.operations.session_secret import SessionSecretError, session_secret, weakness
from tests.support.configs import ROOT, small_config_data

WEAK = {
    "replace-with-32-random-bytes": "is a placeholder",  # deploy/kubernetes/secret.yaml's
    "change-me": "is a placeholder",
    "Replace-With-Your-Own-Secret-Of-32-Bytes": "is a placeholder",
    "x": "is 1 bytes long",
    "a-secret-of-31-bytes-0123456789": "is 31 bytes long",
    "a" * 64: "repeats itself",
    "ab" * 32: "repeats itself",
    "password" * 4: "repeats itself",
    "0123456789" * 4: "repeats itself",
    "change-me-change-me-change-me-xx": "repeats itself",
}


@pytest.mark.parametrize("value, reason", WEAK.items())
def test_weak_values_are_named_for_what_they_are(value, reason):
    assert weakness(value).startswith(reason)


def test_random_values_of_32_bytes_and_more_pass():
    for _ in range(2000):
        for value in (secrets.token_hex(16), secrets.token_hex(32), secrets.token_urlsafe(32)):
            assert weakness(value) is None, value
    assert weakness("correct horse battery staple, then more") is None  # a passphrase is not a pattern


def test_the_error_names_the_variable_and_setting_never_the_value():
    config = parse_config({**small_config_data(), "session": {"secret_env": "MY_SECRET"}})
    with pytest.raises(SessionSecretError) as missing:
        session_secret(config, {})
    assert str(missing.value).startswith("set MY_SECRET (session.secret_env) to the session secret")
    value = "password" * 4
    with pytest.raises(SessionSecretError) as weak:
        session_secret(config, {"MY_SECRET": value})
    assert str(weak.value).startswith("MY_SECRET (session.secret_env) repeats itself") and value not in str(weak.value)
    strong = secrets.token_hex(32)
    assert session_secret(config, {"MY_SECRET": strong}) == strong.encode()


def cli(*args: str, secret: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "IRIS_SESSION_SECRET"}
    if secret is not None:
        env["IRIS_SESSION_SECRET"] = secret
    return subprocess.run([sys.executable, "-m", "extproc.cli", *args], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_serve_refuses_the_placeholder_before_it_starts(tmp_path, workers):
    config = tmp_path / "routing.yaml"
    config.write_text(yaml.safe_dump(small_config_data("redis://127.0.0.1:1/0", server={"listen": "127.0.0.1:1"})))
    result = cli("serve", "--config", str(config), "--workers", workers, secret="replace-with-32-random-bytes")
    assert result.returncode == 2 and result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("iris-extproc: IRIS_SESSION_SECRET (session.secret_env) is a placeholder from this project's examples: "
                           "use at least 32 random bytes; make one with `openssl rand -hex 32`")


def test_check_refuses_a_weak_secret_and_accepts_a_strong_one():
    pair = ("check", "--config", str(example_config()), "--envoy", str(envoy_yaml()))
    weak = cli(*pair, secret="change-me")
    assert weak.returncode == 1
    assert weak.stdout.splitlines()[-1].startswith("IRIS_SESSION_SECRET (session.secret_env) is a placeholder")
    strong = cli(*pair, secret=secrets.token_hex(32))
    assert strong.returncode == 0 and strong.stdout.splitlines()[-1] == "ok: IRIS_SESSION_SECRET is set and strong enough"
    unset = cli(*pair, secret=None)
    assert unset.returncode == 0 and "IRIS_SESSION_SECRET (session.secret_env) is not set here; serve needs it" in unset.stderr
