"""Helpers for tests that run a whole gateway (real Envoy, real Redis, simulated providers)."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import redis

from extproc.storage.keys import Keyspace
from irislab.local_gateway import LocalGateway, ProviderSimulation

MODEL = "llama-3.1-70b"

LIMITS = {
    "max_pinned_sessions": 2,
    "max_global_in_flight_request_slots": 3,
    "global_in_flight_request_slots_reserved_for_pinned_sessions": 1,
    "max_per_session_in_flight_request_slots": 1,
}


def gateway_config(**overrides) -> dict:
    """Two own providers with small limits and a third party, for model MODEL and embeddings."""
    config = {
        "lease_timeout_seconds": 30,
        "redis": {"key_prefix": "e2e"},
        # The tests stand in for an authenticating filter: their x-user-id is the trusted identity
        # (envoy.yaml strips only x-iris-user, the example config's trusted header).
        "session": {"trusted_identity_headers": ["x-user-id"]},
        "server": {"expose_routing_headers": True, "max_body_bytes": 16 * 1024 * 1024},
        "providers": [
            {"name": "iris-1", "kind": "managed", "cluster": "iris-1",
             "models": {MODEL: {"features": ["chat", "completions", "tools"], "limits": LIMITS},
                        "bge-m3": {"features": ["embeddings"], "limits": {"max_global_in_flight_request_slots": 8}},
                        "solo": {"features": ["chat"], "limits": {"max_pinned_sessions": 1}}}},
            {"name": "iris-2", "kind": "managed", "cluster": "iris-2",
             "models": {MODEL: {"features": ["chat", "completions"], "limits": LIMITS}}},
            {"name": "tensorx", "kind": "unlimited", "cluster": "tensorx",
             "models": {MODEL: {"features": ["chat", "completions", "tools", "vision"]},
                        "bge-m3": {"features": ["embeddings"]}}},
        ],
    }
    config.update(overrides)
    return config


def start_gateway(tmp_path, instances: int = 1, envoy_source: Path | None = None, **overrides) -> LocalGateway:
    """A gateway with gateway_config(**overrides); `envoy_source`: another envoy.yaml to run."""
    sims = {name: ProviderSimulation(ttft_ms=5, per_token_ms=20, block_tokens=8) for name in ("iris-1", "iris-2", "tensorx")}
    extra = {} if envoy_source is None else {"envoy_source": envoy_source}
    gateway = LocalGateway(config_data=gateway_config(**overrides), instances=instances, simulations=sims,
                           work_dir=tmp_path, **extra)
    gateway.__enter__()
    return gateway


def redis_client(gateway: LocalGateway) -> redis.Redis:
    return redis.Redis.from_url(gateway.redis_url)


def redis_now_ms(client: redis.Redis) -> int:
    """Redis's clock (TIME), in milliseconds."""
    seconds, micros = client.time()
    return seconds * 1000 + micros // 1000


def clear_routing_state(client: redis.Redis) -> None:
    """Delete every key but the epoch (test-only: uses KEYS): an empty routing state between
    tests that the running instances do not take for a Redis that lost its state, which would
    start the epoch grace (docs/routing-state.md "When Redis is gone")."""
    doomed = [key for key in client.keys("*") if not key.endswith(b":epoch")]
    if doomed:
        client.delete(*doomed)


def live_leases(client: redis.Redis, keys: str = "*:leases:*") -> int:
    """Live request leases over every provider and model (test-only: uses KEYS); `keys`, a KEYS
    pattern of lease zsets, counts others (`{p:m}:endpoint-leases:*`: the leases of a pick
    pair's endpoints)."""
    now = redis_now_ms(client)
    return sum(client.zcount(key, f"({now}", "+inf") for key in client.keys(keys))


def wait_for_no_leases(client: redis.Redis, within_seconds: float, keys: str = "*:leases:*") -> int:
    """Poll until no live lease is left in the zsets `keys` matches (live_leases) or
    `within_seconds` passed; returns the last count."""
    deadline = time.monotonic() + within_seconds
    while True:
        count = live_leases(client, keys)
        if count == 0 or time.monotonic() > deadline:
            return count
        time.sleep(0.02)


def chat_body(user_text: str, max_tokens: int = 2, stream: bool = False, **extra) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": user_text}],
        "max_tokens": max_tokens,
        "stream": stream,
        **extra,
    }


def post(gateway: LocalGateway, path: str, user: str = "u", instance: int = 0, **kwargs) -> httpx.Response:
    headers = {"x-user-id": user, **kwargs.pop("headers", {})}
    return httpx.post(f"{gateway.running[instance].url}{path}", headers=headers, timeout=30, **kwargs)


def provider_stats(gateway: LocalGateway, name: str) -> dict:
    return httpx.get(f"{gateway.provider_url(name)}/stats", timeout=5).json()


def envoy_stat(gateway: LocalGateway, name: str) -> int:
    """One counter or gauge of the first instance's Envoy (its admin /stats), 0 when absent."""
    text = httpx.get(f"http://127.0.0.1:{gateway.running[0].admin_port}/stats?filter=^{name}$", timeout=5).text
    return int(text.split(":")[1]) if ":" in text else 0


def self_signed_certificate(directory: Path, host: str = "localhost") -> tuple[Path, Path]:
    """A self-signed certificate for `host` (P-256, one day) and its key, made with the openssl
    command: (cert.pem, key.pem) in `directory`. Skips the test when openssl is missing."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("the openssl command is needed to make a test certificate")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", f"/CN={host}",
         "-addext", f"subjectAltName=DNS:{host}"],
        check=True, capture_output=True,
    )
    return cert, key


def wait_until(predicate, within_seconds: float, interval_seconds: float = 0.02):
    """Poll `predicate` until it returns something truthy (returned) or `within_seconds` pass
    (then the last falsy value is returned)."""
    deadline = time.monotonic() + within_seconds
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval_seconds)


def wait_for_instances_to_know_each_other(gateway: LocalGateway, within_seconds: float = 15.0) -> bool:
    """Until every ext_proc server of `gateway` has heartbeated since all of them were registered
    in Redis (extproc.routing.outage.InstanceRegistry): each then knows how many are live, the
    divisor of its local share in an outage (one heartbeat interval of sleep is not enough on a
    loaded machine). Returns whether that happened within `within_seconds`."""
    client = redis_client(gateway)
    key = Keyspace(gateway.config.redis.key_prefix).instances()
    servers = sum(len(instance.extprocs) for instance in gateway.running)
    latest: list[float] = []  # the latest heartbeat's deadline (ms) once every server is registered

    def known() -> bool:
        deadlines = [score for _, score in client.zrangebyscore(key, f"({redis_now_ms(client)}", "+inf", withscores=True)]
        if len(deadlines) < servers:
            return False
        if not latest:
            latest.append(max(deadlines))
            return False
        # A heartbeat's deadline is its time plus the same TTL: each beat since the latest one then.
        return all(deadline > latest[0] for deadline in deadlines)

    return bool(wait_until(known, within_seconds=within_seconds, interval_seconds=0.05))


class PrintedLines:
    """The lines a subprocess prints on `stream` (a text pipe), read by a thread of their own, so
    a test can wait for the next one with a bound (selectors cannot: a text stream buffers lines
    ahead of the pipe)."""

    def __init__(self, stream):
        import queue
        import threading

        self._lines: queue.Queue = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            self._lines.put(line)
        self._lines.put(None)  # the stream ended

    def next(self, within_seconds: float = 30) -> str | None:
        """The next line (with its newline), None once the stream ended; fails the test after
        `within_seconds` without one."""
        import queue

        try:
            line = self._lines.get(timeout=within_seconds)
        except queue.Empty:
            pytest.fail(f"nothing printed within {within_seconds} s after {self.seen}")
        if line is not None:
            self.seen.append(line)
        return line

    def until(self, prefix: str, within_seconds: float = 120) -> list[str]:
        """The lines up to and including the first starting with `prefix`."""
        lines = []
        while not lines or not lines[-1].startswith(prefix):
            line = self.next(within_seconds)
            assert line is not None, f"the stream ended before a line starting with {prefix!r}: {lines}"
            lines.append(line)
        return lines
