"""routing.third_party_share through the whole gateway (issue 22): two proxy instances sharing one
Redis, an own provider that serves plain chat and a third party that also serves images, and a cap
of half of an identity's requests on the third party. Counts only: what the third party's
simulator received, and the answers of concurrent requests spread over both instances."""

from __future__ import annotations

import secrets
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from irislab.local_gateway import LocalGateway, ProviderSimulation
from tests.support.gateway import MODEL, chat_body, provider_stats

INSTANCES = 2


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    config = {
        "redis": {"key_prefix": "share"},
        "session": {"trusted_identity_headers": ["x-user-id"]},
        "server": {"expose_routing_headers": True},
        "routing": {"third_party_share": {"max_share": 0.5, "window_seconds": 3600, "burst": 0}},
        "providers": [
            {"name": "iris-1", "kind": "managed", "cluster": "iris-1", "models": {MODEL: {"features": ["chat"]}}},
            {"name": "tensorx", "kind": "unlimited", "cluster": "tensorx", "models": {MODEL: {"features": ["chat", "vision"]}}},
        ],
    }
    sims = {name: ProviderSimulation(ttft_ms=5, per_token_ms=2) for name in ("iris-1", "tensorx")}
    with LocalGateway(config_data=config, instances=INSTANCES, simulations=sims, work_dir=tmp_path_factory.mktemp("share")) as gateway:
        yield gateway


def image_body() -> dict:
    """A new session's request with an image: only the third party serves it."""
    content = [{"type": "text", "text": f"look {secrets.token_hex(8)}"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2}


def send(gw: LocalGateway, user: str, bodies: list[dict]) -> list[httpx.Response]:
    """`bodies` sent at once by `user`, alternating over the instances."""
    def one(indexed: tuple[int, dict]) -> httpx.Response:
        index, body = indexed
        return httpx.post(f"{gw.running[index % INSTANCES].url}/v1/chat/completions", json=body, headers={"x-user-id": user}, timeout=30)

    with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
        return list(pool.map(one, enumerate(bodies)))


def third_party_requests(gw: LocalGateway) -> int:
    return provider_stats(gw, "tensorx")["requests_by_status"].get("200", 0)


def own(gw: LocalGateway, user: str, n: int) -> None:
    """`n` requests of `user` that the own provider serves (new sessions, one at a time)."""
    for response in send(gw, user, [chat_body(f"plain {secrets.token_hex(8)}") for _ in range(n)]):
        assert response.status_code == 200 and response.headers["x-iris-provider"] == "iris-1"


def refusals(gw: LocalGateway) -> float:
    """iris_third_party_share_refusals_total over both instances."""
    total = 0.0
    for instance in gw.running:
        for family in text_string_to_metric_families(httpx.get(instance.metrics_url, timeout=10).text):
            total += sum(s.value for s in family.samples if s.name == "iris_third_party_share_refusals_total")
    return total


def outcomes(responses: list[httpx.Response]) -> dict[str, int]:
    found: dict[str, int] = {}
    for response in responses:
        key = response.headers["x-iris-provider"] if response.status_code == 200 else response.json()["error"]["code"]
        found[key] = found.get(key, 0) + 1
    return found


def test_an_identity_over_its_share_is_refused_exactly_and_another_is_not(gw):
    httpx.post(f"{gw.provider_url('tensorx')}/stats/reset", timeout=5)
    # alice: 6 requests at home, then 20 at once that only the third party serves. Half of her
    # requests may go there: u <= 0.5 x (6 + u), so exactly 6 of the 20 pass.
    own(gw, "alice", 6)
    alice = send(gw, "alice", [image_body() for _ in range(20)])
    assert outcomes(alice) == {"tensorx": 6, "capacity_exceeded": 14}
    assert all(r.headers.get("retry-after") for r in alice if r.status_code == 429)
    assert third_party_requests(gw) == 6
    # bob: 4 at home, 4 at once to the third party: 4 <= 0.5 x 8, every one passes.
    own(gw, "bob", 4)
    assert outcomes(send(gw, "bob", [image_body() for _ in range(4)])) == {"tensorx": 4}
    assert third_party_requests(gw) == 10
    # alice again: at her cap until more of her requests are served at home.
    assert outcomes(send(gw, "alice", [image_body()])) == {"capacity_exceeded": 1}
    own(gw, "alice", 2)  # 8 at home, 6 out: k more may go out while 6 + k <= 0.5 x (14 + k), so 2
    assert outcomes(send(gw, "alice", [image_body() for _ in range(3)])) == {"tensorx": 2, "capacity_exceeded": 1}
    assert third_party_requests(gw) == 12
    assert refusals(gw) == 14 + 1 + 1
