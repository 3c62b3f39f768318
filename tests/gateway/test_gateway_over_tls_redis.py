"""A whole gateway (real Envoy, ext_proc servers, simulated providers) whose routing state lives
in a TLS Redis (`rediss://` with `tls_ca_file`: a trustme CA, irislab.tls_redis's terminator
before a plain Redis). Requests are routed to the own providers, decided in Redis over TLS by both
clients (the pipelined hot path for the scripts, redis-py for the rest), never sent to the third
party for want of Redis."""

from __future__ import annotations

import redis

from irislab.local_gateway import LocalGateway, ProviderSimulation
from irislab.tls_redis import TlsStandalone
from tests.support.gateway import chat_body, gateway_config, post, provider_stats


def test_requests_go_to_own_providers_through_a_tls_redis(tmp_path):
    with TlsStandalone(tmp_path / "tls-redis") as tls:
        config = gateway_config(redis={"url": tls.url, "key_prefix": "e2e", "tls_ca_file": str(tls.ca.ca_file)})
        sims = {name: ProviderSimulation(ttft_ms=5, per_token_ms=5, block_tokens=8) for name in ("iris-1", "iris-2", "tensorx")}
        with LocalGateway(config_data=config, simulations=sims, work_dir=tmp_path / "gw", redis_url=tls.url) as gateway:
            providers = []
            for user in range(4):  # two pinned sessions per own provider (LIMITS): room for all four
                response = post(gateway, "/v1/chat/completions", user=f"user-{user}", json=chat_body(f"hello {user}"))
                assert response.status_code == 200, response.text
                providers.append(response.headers["x-iris-provider"])
            assert sorted(providers) == ["iris-1", "iris-1", "iris-2", "iris-2"], providers
            assert provider_stats(gateway, "tensorx")["requests"] == 0
            # The decisions are in Redis (read on its plain port, behind the terminator): a pin per session.
            plain = redis.Redis(host="127.0.0.1", port=tls.redis.port)
            assert plain.keys("*e2e*"), "no routing state in Redis"
            plain.close()
