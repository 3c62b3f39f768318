"""Issue 29, the routing core, end to end (real Envoy, real Redis, simulated providers): how a
lease's renewal is settled when the process that holds it was frozen.

0. A process frozen past its lease timeout is not a Redis that was unreachable: its lease expired
   in Redis while Redis answered everyone, another instance took the slot, and the lease may come
   back only through an admission that respects the pair's limit; else it is lost and its request
   cancelled (before: the late renewal adopted it without a capacity check, 2 running on a 1-slot
   pair, and the frozen instance's stream ran to its end).
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
import redis

from irislab.local_gateway import LocalGateway, ProviderSimulation
from tests.gateway.test_faults_round3 import MODEL, Streams
from tests.support.gateway import provider_stats, redis_now_ms, wait_for_no_leases, wait_until

LEASE_TIMEOUT = 2.0


def one_slot_config() -> dict:
    """iris-1 holds one request of MODEL; tensorx (no limit) takes the rest."""
    limits = {"max_pinned_sessions": 1000, "max_global_in_flight_request_slots": 1, "max_per_session_in_flight_request_slots": 1}
    return {
        "lease_timeout_seconds": LEASE_TIMEOUT,
        "redis": {"key_prefix": "settle"},
        "server": {"expose_routing_headers": True, "reload_poll_seconds": 0},
        "providers": [
            {"name": "iris-1", "kind": "managed", "cluster": "iris-1", "models": {MODEL: {"features": ["chat"], "limits": limits}}},
            {"name": "tensorx", "kind": "unlimited", "cluster": "tensorx", "models": {MODEL: {"features": ["chat"]}}},
        ],
    }


def pair_leases(client: redis.Redis, provider: str) -> int:
    return client.zcount(f"{{settle:{MODEL}}}:leases:{provider}", f"({redis_now_ms(client)}", "+inf")


@pytest.mark.slow
def test_a_frozen_instance_whose_slot_was_taken_loses_its_lease_and_never_over_admits(tmp_path):
    sims = {name: ProviderSimulation(ttft_ms=5, per_token_ms=100) for name in ("iris-1", "tensorx")}
    with LocalGateway(config_data=one_slot_config(), instances=2, simulations=sims, work_dir=tmp_path) as gateway:
        a, b = gateway.running
        state = redis.Redis.from_url(gateway.redis_url)
        frozen = Streams(a.url, count=1, tokens=150, prefix="frozen")  # 15 s on iris-1
        # Its response headers have passed the router: its bytes flow without it from here on.
        assert wait_until(lambda: frozen.answered == 1, within_seconds=10)
        os.kill(a.extproc.pid, signal.SIGSTOP)
        try:
            # A whole lease timeout without a renewal: the lease is gone in Redis, Redis answers B.
            assert wait_until(lambda: pair_leases(state, "iris-1") == 0, within_seconds=LEASE_TIMEOUT + 5)
            taker = Streams(b.url, count=1, tokens=100, prefix="taker")  # 10 s: it runs across A's renewal
            # A's request still runs at the provider (its bytes pass Envoy without its ext_proc).
            assert wait_until(lambda: pair_leases(state, "iris-1") == 1, within_seconds=5)
        finally:
            os.kill(a.extproc.pid, signal.SIGCONT)
        counted = []
        deadline = time.monotonic() + 2 * LEASE_TIMEOUT  # A's renewals are due at once, then every 2/3 s
        while time.monotonic() < deadline:
            counted.append(pair_leases(state, "iris-1"))
            time.sleep(0.05)
        # A's request is cancelled at its first renewal: the provider runs B's alone from then on
        # (before: both, until B's ended). iris-1 ran 2 only while A was frozen: A's request ran on
        # there (its bytes pass Envoy without its ext_proc) after its lease had expired and B had
        # taken the free slot, which no lease can prevent.
        assert wait_until(lambda: provider_stats(gateway, "iris-1")["in_flight"] <= 1, within_seconds=1)
        httpx.post(f"{gateway.provider_url('iris-1')}/stats/reset", timeout=5)
        assert taker.join() == [(200, "iris-1", True)]
        assert frozen.join()[0][2] is False  # cut short (reset mid-body): cancelled as lost
        assert "expired in Redis and its slot is taken" in a.extproc.log_tail(1_000_000)
        assert max(counted) == 1, counted  # Redis never counted A's expired lease again beside B's
        assert provider_stats(gateway, "iris-1")["max_in_flight"] == 1
        assert wait_for_no_leases(state, within_seconds=15) == 0
