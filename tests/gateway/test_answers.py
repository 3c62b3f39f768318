"""Answers the router reads, end to end (real Envoy, real Redis, simulated providers): answers
larger than Envoy's buffer (envoy/envoy.yaml: 16 MiB) reach the client whole with the client's
model name, chain records follow polls of background responses, and a chained turn that
switches model stays with the provider that stores its previous response.

Model placement (priority: iris-1, iris-2, tensorx):
- `alpha` (responses) is served by iris-2 only: its responses are stored there;
- `beta` (responses) by iris-1 and iris-2: a new session of it goes to iris-1;
- `gamma` (responses) by iris-1 only: iris-2's responses cannot continue with it;
- `emb` (embeddings) and `large` (responses) by tensorx, which names them its own way, so their
  JSON answers are rewritten (and `large`'s read for its id) by the router."""

from __future__ import annotations

import itertools
import time

import httpx
import orjson
import pytest

from irislab.local_gateway import LocalGateway, ProviderSimulation
from tests.support.gateway import clear_routing_state, live_leases, redis_client, wait_until

ENVOY_BUFFER_BYTES = 16842752  # envoy/envoy.yaml's per_connection_buffer_limit_bytes
LIMITS = {"max_pinned_sessions": 8, "max_global_in_flight_request_slots": 8, "max_per_session_in_flight_request_slots": 4}
_users = itertools.count()


def answers_config(**overrides) -> dict:
    config = {
        "redis": {"key_prefix": "ans"},
        "session": {"trusted_identity_headers": ["x-user-id"]},
        "server": {"expose_routing_headers": True},
        "providers": [
            {"name": "iris-1", "kind": "managed", "cluster": "iris-1",
             "models": {"beta": {"features": ["chat", "responses"], "limits": LIMITS},
                        "gamma": {"features": ["chat", "responses"], "limits": LIMITS}}},
            {"name": "iris-2", "kind": "managed", "cluster": "iris-2",
             "models": {"alpha": {"features": ["chat", "responses"], "limits": LIMITS},
                        "beta": {"features": ["chat", "responses"], "limits": LIMITS}}},
            {"name": "tensorx", "kind": "unlimited", "cluster": "tensorx",
             "models": {"emb": {"features": ["embeddings"], "upstream_model": "BAAI/bge-m3"},
                        "large": {"features": ["responses"], "upstream_model": "tensorx/large-instruct"}}},
        ],
    }
    config.update(overrides)
    return config


def start(tmp_path, **overrides) -> LocalGateway:
    sims = {"iris-1": ProviderSimulation(ttft_ms=5, per_token_ms=20), "iris-2": ProviderSimulation(ttft_ms=5, per_token_ms=20),
            "tensorx": ProviderSimulation(ttft_ms=5, per_token_ms=0)}
    gateway = LocalGateway(config_data=answers_config(**overrides), simulations=sims, work_dir=tmp_path)
    gateway.__enter__()
    return gateway


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    gw = start(tmp_path_factory.mktemp("answers"))
    yield gw
    gw.stop()


@pytest.fixture
def gw(gateway):
    clear_routing_state(redis_client(gateway))
    yield gateway
    assert wait_until(lambda: live_leases(redis_client(gateway)) == 0, within_seconds=10), "a lease leaked"


def user() -> dict[str, str]:
    return {"x-user-id": f"user-{next(_users)}"}


def post(gateway, path: str, body: dict, headers: dict[str, str], timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{gateway.url}{path}", content=orjson.dumps(body), headers={**headers, "content-type": "application/json"},
                      timeout=timeout)


def counted(gateway, name: str, **labels: str) -> float:
    """The sum of the samples of counter `name` (with `labels`) on the ext_proc server's /metrics."""
    total = 0.0
    for line in httpx.get(gateway.running[0].metrics_url, timeout=5).text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


# -- answers larger than Envoy's buffer --------------------------------------------------------


def test_an_embeddings_answer_larger_than_envoys_buffer_reaches_the_client_whole_and_renamed(gw):
    """900 inputs of 1,024 dimensions: about 19 MB of JSON, more than Envoy can buffer. Before, the
    router asked for the renamed answer BUFFERED and the client got 500 internal_error
    (response_payload_too_large) after the provider had done the work."""
    inputs = [f"text number {i}" for i in range(900)]
    tokens_before = counted(gw, "iris_tokens_total", gen_ai_request_model="emb", gen_ai_token_type="input")
    response = post(gw, "/v1/embeddings", {"model": "emb", "input": inputs, "dimensions": 1024}, user())
    assert response.status_code == 200, response.text[:500]
    assert len(response.content) > ENVOY_BUFFER_BYTES
    answer = orjson.loads(response.content)
    assert answer["model"] == "emb"  # the client's name, not BAAI/bge-m3
    assert [item["index"] for item in answer["data"]] == list(range(900))
    assert all(len(item["embedding"]) == 1024 for item in answer["data"])
    assert b"BAAI/bge-m3" not in response.content
    # the usage at its end was read on the way, chunk by chunk
    assert counted(gw, "iris_tokens_total", gen_ai_request_model="emb", gen_ai_token_type="input") == tokens_before + 3 * 900


def test_a_stored_responses_answer_larger_than_envoys_buffer_is_recorded_renamed_and_retrieved(gw):
    """About 19 MB of generated text: the answer is read for its id (the chain record) and renamed
    as it streams, and retrieving it by id (renamed again) works too."""
    alice = user()
    created = post(gw, "/v1/responses", {"model": "large", "input": "write a lot", "max_output_tokens": 1_800_000}, alice)
    assert created.status_code == 200, created.text[:500]
    assert len(created.content) > ENVOY_BUFFER_BYTES
    answer = orjson.loads(created.content)
    assert (answer["model"], answer["status"]) == ("large", "completed")
    assert answer["output"][0]["content"][0]["text"].endswith("tok1799999")
    assert redis_client(gw).keys("{ans:large}:response:*"), "the chain was not recorded"

    found = httpx.get(f"{gw.url}/v1/responses/{answer['id']}", headers=alice, timeout=120)
    assert found.status_code == 200, found.text[:500]
    assert found.headers["x-iris-provider"] == "tensorx"
    retrieved = orjson.loads(found.content)
    assert (retrieved["id"], retrieved["model"]) == (answer["id"], "large")
    assert b"tensorx/large-instruct" not in found.content


def test_a_small_renamed_answer_keeps_its_content_length(gw):
    response = post(gw, "/v1/embeddings", {"model": "emb", "input": ["a", "b"]}, user())
    assert response.status_code == 200 and response.json()["model"] == "emb"
    assert int(response.headers["content-length"]) == len(response.content)


# -- a chained turn that switches model --------------------------------------------------------


def test_a_chained_turn_that_switches_model_goes_to_the_provider_that_stores_its_previous_response(gw):
    """alpha's response is stored on iris-2; a beta turn continuing it would start a new session
    on iris-1 (first in priority), which does not hold the response: before, the client got that
    provider's 404 previous_response_not_found, while a GET of the same id found iris-2."""
    bob = user()
    first = post(gw, "/v1/responses", {"model": "alpha", "input": "hello", "max_output_tokens": 2}, bob)
    assert first.status_code == 200 and first.headers["x-iris-provider"] == "iris-2"
    previous = first.json()["id"]
    fresh = post(gw, "/v1/responses", {"model": "beta", "input": "new", "max_output_tokens": 2}, user())
    assert fresh.headers["x-iris-provider"] == "iris-1"  # where a new beta session goes

    second = post(gw, "/v1/responses", {"model": "beta", "input": "go on", "max_output_tokens": 2,
                                        "previous_response_id": previous}, bob)
    assert second.status_code == 200, second.text
    assert second.headers["x-iris-provider"] == "iris-2"
    assert second.json()["model"] == "beta"
    # the chain goes on under the new model, on the same provider
    third = post(gw, "/v1/responses", {"model": "beta", "input": "and on", "max_output_tokens": 2,
                                       "previous_response_id": second.json()["id"]}, bob)
    assert third.status_code == 200 and third.headers["x-iris-provider"] == "iris-2"


def test_a_chained_turn_to_a_model_its_storing_provider_does_not_serve_is_refused_clearly(gw):
    carol = user()
    first = post(gw, "/v1/responses", {"model": "alpha", "input": "hello", "max_output_tokens": 2}, carol)
    previous = first.json()["id"]
    refused = post(gw, "/v1/responses", {"model": "gamma", "input": "go on", "previous_response_id": previous}, carol)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert (error["code"], error["param"], error["type"]) == ("previous_response_unavailable", "previous_response_id",
                                                              "invalid_request_error")
    assert "iris-2" in error["message"] and "gamma" in error["message"]
    assert "x-simulator-name" not in refused.headers  # no provider was asked
    # another identity knows nothing of the id: a new chain, wherever it goes
    other = post(gw, "/v1/responses", {"model": "gamma", "input": "x", "max_output_tokens": 2, "previous_response_id": previous},
                 user())
    assert other.status_code == 404 and other.headers["x-simulator-name"] == "iris-1"


# -- chain records of polled and background responses (short timeouts) ---------------------------

CHAIN_TTL_SECONDS = 4.0  # pin_inactivity_timeout_seconds + lease_timeout_seconds below


@pytest.fixture(scope="module")
def short_gateway(tmp_path_factory):
    gw = start(tmp_path_factory.mktemp("short"), pin_inactivity_timeout_seconds=2, lease_timeout_seconds=2,
               redis={"key_prefix": "ans"})
    yield gw
    gw.stop()


@pytest.fixture
def sgw(short_gateway):
    clear_routing_state(redis_client(short_gateway))
    yield short_gateway
    assert wait_until(lambda: live_leases(redis_client(short_gateway)) == 0, within_seconds=10), "a lease leaked"


def record_ttl_ms(gateway, model: str) -> int:
    """The remaining life of the (only) chain record of `model`, in milliseconds."""
    client = redis_client(gateway)
    keys = client.keys(f"{{ans:{model}}}:response:*")
    assert len(keys) == 1, keys
    return client.pttl(keys[0])


def get(gateway, path: str, headers: dict[str, str]) -> httpx.Response:
    return httpx.get(f"{gateway.url}{path}", headers=headers, timeout=30)


def test_a_background_response_is_polled_and_cancelled_past_the_chain_ttl(sgw):
    """A background response that would run 30 s, polled with gaps longer than the chain TTL (4 s),
    then cancelled. Before, the record expired 4 s after the creating answer: polls and the cancel
    got the router's 404 while the provider said in_progress."""
    dave = user()
    created = post(sgw, "/v1/responses", {"model": "alpha", "input": "think long", "max_output_tokens": 1500, "background": True}, dave)
    assert created.status_code == 200 and created.json()["status"] == "queued"
    response_id = created.json()["id"]
    for _ in range(2):
        time.sleep(CHAIN_TTL_SECONDS + 1)  # no poll for longer than the chain TTL
        polled = get(sgw, f"/v1/responses/{response_id}", dave)
        assert polled.status_code == 200, polled.text
        assert polled.json()["status"] == "in_progress"
        assert wait_until(lambda: record_ttl_ms(sgw, "alpha") > CHAIN_TTL_SECONDS * 1000, within_seconds=5)  # kept while it runs
    cancelled = httpx.post(f"{sgw.url}/v1/responses/{response_id}/cancel", headers=dave, timeout=30)
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    # it ended: from the cancel's answer on, the record lives the chain TTL
    assert wait_until(lambda: record_ttl_ms(sgw, "alpha") <= CHAIN_TTL_SECONDS * 1000, within_seconds=5)


def test_a_completed_background_response_gets_the_chain_ttl_from_the_poll_that_sees_it_end(sgw):
    erin = user()
    created = post(sgw, "/v1/responses", {"model": "alpha", "input": "quick", "max_output_tokens": 2, "background": True}, erin)
    response_id = created.json()["id"]
    done = wait_until(lambda: get(sgw, f"/v1/responses/{response_id}", erin).json().get("status") == "completed",
                      within_seconds=10)
    assert done
    assert wait_until(lambda: record_ttl_ms(sgw, "alpha") <= CHAIN_TTL_SECONDS * 1000, within_seconds=5)


def test_a_lookup_the_provider_answers_restarts_the_records_ttl(sgw):
    """A stored (not background) response, read again and again: each answered lookup restarts
    its record's TTL, so reads 2.5 s apart outlive the 4 s TTL."""
    frank = user()
    created = post(sgw, "/v1/responses", {"model": "alpha", "input": "hi", "max_output_tokens": 2}, frank)
    response_id = created.json()["id"]
    for path in (f"/v1/responses/{response_id}", f"/v1/responses/{response_id}/input_items",
                 f"/v1/responses/{response_id}", f"/v1/responses/{response_id}/input_items"):
        time.sleep(CHAIN_TTL_SECONDS - 1.5)
        looked_up = get(sgw, path, frank)
        assert looked_up.status_code == 200, (path, looked_up.text)
        assert wait_until(lambda: record_ttl_ms(sgw, "alpha") > (CHAIN_TTL_SECONDS - 0.5) * 1000, within_seconds=2)
    # a chained turn after all that still finds its provider
    turn = post(sgw, "/v1/responses", {"model": "alpha", "input": "more", "max_output_tokens": 2, "previous_response_id": response_id},
                frank)
    assert turn.status_code == 200 and turn.headers["x-iris-provider"] == "iris-2"
