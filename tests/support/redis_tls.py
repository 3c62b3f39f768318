"""Helpers for the TLS Redis tests (tests/unit/storage/test_redis_tls.py,
tests/gateway/test_redis_tls_topologies.py)."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import yaml

from extproc.config import Config, parse_config
from extproc.routing.state import RoutingState
from irislab.processes import free_port
from tests.support.configs import small_config_data

T0 = 1_000_000_000


def routing_config(**redis) -> Config:
    """small_config_data with these `redis` settings (key prefix `tls`)."""
    return parse_config(small_config_data(redis=({"key_prefix": "tls", **redis})))


async def admit_and_release(state: RoutingState) -> tuple[str, str]:
    """One admission with a pin and its release through the routing scripts: their results."""
    _, admitted = await state.get_pin_and_try_admit("m", "s1", ["iris-1"], lease_id="L1", pin_id="P1", now_ms=T0)
    released = await state.release_request_lease(admitted.lease, refresh_pin=True, now_ms=T0 + 1)
    return admitted.result.value, released.result.value


def serve_once(folder: Path, redis: dict) -> subprocess.CompletedProcess:
    """`iris-extproc serve` of small_config_data with these `redis` settings, run until it exits
    (within 60 s: a server that starts serving runs into the timeout)."""
    data = small_config_data(redis=redis, server={"listen": f"127.0.0.1:{free_port()}"})
    path = folder / "routing.yaml"
    path.write_text(yaml.safe_dump(data))
    return subprocess.run([sys.executable, "-m", "extproc", "serve", "--config", str(path)], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "IRIS_SESSION_SECRET": secrets.token_hex(32)})
