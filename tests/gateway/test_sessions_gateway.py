"""Sessions as real clients make them, end to end: the openai SDK through two gateway instances
(real Envoys, ext_proc servers, one real Redis) to two own providers serving `responses` and a
third party. A chained Responses turn sent to a provider that does not hold its previous
response gets a 404 from the simulator, so a misroute fails these tests."""

from __future__ import annotations

import itertools

import httpx
import openai
import pytest

from extproc import cli
from irislab.local_gateway import LocalGateway, ProviderSimulation
from tests.support.gateway import MODEL, clear_routing_state, provider_stats, redis_client, wait_until

OWN = ("iris-1", "iris-2")
THIRD_PARTY_ONLY = "ext-only"
LIMITS = {
    "max_pinned_sessions": 8,
    "max_global_in_flight_request_slots": 8,
    "global_in_flight_request_slots_reserved_for_pinned_sessions": 1,
    "max_per_session_in_flight_request_slots": 2,
}
_keys = itertools.count()


def sessions_config() -> dict:
    """As the example config: x-iris-user is the trusted identity header (envoy.yaml strips a
    client's copy), identities otherwise come from the client's API key."""
    own = {MODEL: {"features": ["chat", "responses"], "limits": LIMITS}}
    return {
        "redis": {"key_prefix": "sess"},
        "server": {"expose_routing_headers": True, "degraded_refresh_seconds": 0.1},
        "session": {"trusted_identity_headers": ["x-iris-user"]},
        "providers": [
            *({"name": name, "kind": "managed", "cluster": name, "models": own} for name in OWN),
            {"name": "tensorx", "kind": "unlimited", "cluster": "tensorx",
             "models": {MODEL: {"features": ["chat", "responses"]}, THIRD_PARTY_ONLY: {"features": ["chat"]}}},
        ],
    }


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    sims = {name: ProviderSimulation(ttft_ms=2, per_token_ms=1, block_tokens=4) for name in (*OWN, "tensorx")}
    gw = LocalGateway(config_data=sessions_config(), instances=2, simulations=sims, work_dir=tmp_path_factory.mktemp("sessions"))
    gw.__enter__()
    yield gw
    gw.stop()


@pytest.fixture
def gw(gateway):
    clear_routing_state(redis_client(gateway))
    for name in gateway.providers:
        httpx.post(f"{gateway.provider_url(name)}/stats/reset", timeout=5)
    yield gateway
    for name in gateway.providers:  # whatever a test did, no provider was asked for a response it lacks
        assert provider_stats(gateway, name)["requests_by_status"].get("404", 0) == 0, name


def clients(gateway: LocalGateway, **headers) -> list[openai.OpenAI]:
    """One SDK client per gateway instance, all with one new API key: one identity."""
    key = f"sk-user-{next(_keys)}"
    return [openai.OpenAI(base_url=f"{i.url}/v1", api_key=key, default_headers=headers, max_retries=0) for i in gateway.running]


def pins(gateway: LocalGateway) -> int:
    return len(redis_client(gateway).keys(f"{{sess:{MODEL}}}:pin:*"))


def respond(api: openai.OpenAI, text: str, stream: bool, **fields) -> tuple[str, str]:
    """One Responses turn; (response id, provider). A streamed turn takes the id from its
    `response.created` event."""
    raw = api.responses.with_raw_response.create(model=MODEL, input=text, max_output_tokens=3, stream=stream, **fields)
    if not stream:
        return raw.parse().id, raw.headers["x-iris-provider"]
    response_id = None
    for event in raw.parse():
        if event.type == "response.created":
            response_id = event.response.id
    return response_id, raw.headers["x-iris-provider"]


def chat(api: openai.OpenAI, text: str, **fields) -> str:
    raw = api.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=2, **fields
    )
    return raw.headers["x-iris-provider"]


def test_a_previous_response_id_chain_through_two_instances_is_one_session_on_one_provider(gw):
    apis = clients(gw)
    previous, served = None, []
    for turn in range(6):  # alternately through each instance, streamed and not
        fields = {"previous_response_id": previous} if previous else {"instructions": "be brief"}
        previous, provider = respond(apis[turn % 2], f"turn {turn}", stream=turn % 2 == 0, **fields)
        served.append(provider)
    assert len(set(served)) == 1 and pins(gw) == 1
    stats = provider_stats(gw, served[0])
    assert stats["requests_by_status"] == {"200": 6} and stats["responses_stored"] == 6
    assert stats["cached_tokens"] > 0  # each turn extends the stored transcript: prefix-cache hits


def test_a_conversation_through_two_instances_is_one_session(gw):
    apis = clients(gw)
    served = {respond(apis[turn % 2], f"new words {turn}", stream=turn == 3, conversation="conv_abc")[1] for turn in range(6)}
    assert len(served) == 1 and pins(gw) == 1


@pytest.mark.parametrize("signal", [
    {"extra_body": {"prompt_cache_key": "pk-1"}},
    {"extra_headers": {"session_id": "codex-1", "conversation_id": "codex-1"}},  # Codex CLI
    {"extra_headers": {"x-claude-code-session-id": "cc-1"}},  # Claude Code
])
def test_chat_turns_with_a_session_signal_are_one_session_whatever_their_prompt(gw, signal):
    apis = clients(gw)
    served = {chat(apis[turn % 2], f"a different opening {turn}", **signal) for turn in range(6)}
    assert len(served) == 1 and pins(gw) == 1


def test_identity_is_the_api_key_and_a_client_cannot_claim_another(gw):
    same_key = clients(gw)[0]
    for user in ("alice", "bob", "carol"):  # stripped by Envoy (trusted) or not trusted: ignored
        chat(same_key, "same opening", extra_headers={"x-iris-user": user, "x-user-id": user})
    assert pins(gw) == 1
    chat(clients(gw)[0], "same opening")
    assert pins(gw) == 2  # another identity, the same opening message: another session


def test_a_third_party_receives_no_identity_cookie_or_forwarded_for(gw):
    api = clients(gw)[0]
    private = {"cookie": "sid=abc", "x-forwarded-for": "203.0.113.7", "forwarded": "for=203.0.113.7",
               "x-real-ip": "203.0.113.7", "x-user-id": "alice", "x-iris-user": "alice"}
    api.chat.completions.create(model=THIRD_PARTY_ONLY, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                extra_headers=private)
    received = provider_stats(gw, "tensorx")["last_request_headers"][-1]
    assert not set(private) & set(received) and "authorization" not in received, received


def test_models_are_listed_from_the_configuration_without_a_provider(gw):
    api = clients(gw)[1]
    assert [m.id for m in api.models.list()] == [MODEL, THIRD_PARTY_ONLY]
    assert api.models.retrieve(MODEL).owned_by == "iris"
    with pytest.raises(openai.NotFoundError) as missing:
        api.models.retrieve("no-such-model")
    assert missing.value.code == "model_not_found"
    assert httpx.post(f"{gw.url}/v1/models", timeout=5).json()["error"]["code"] == "method_not_allowed"
    assert all(provider_stats(gw, name)["requests"] == 0 for name in gw.providers)


def test_chat_costs_three_ext_proc_messages_and_only_responses_answers_are_read(gw):
    admin = f"http://127.0.0.1:{gw.running[0].admin_port}"

    def sent() -> int:
        text = httpx.get(f"{admin}/stats?filter=ext_proc.stream_msgs_sent$", timeout=5).text
        return int(text.split(":")[1])

    api = clients(gw)[0]
    before = sent()
    for i in range(4):
        chat(api, f"hello {i}")
    assert sent() - before == 4 * 3  # request headers, request body, response headers: as before
    before = sent()
    respond(api, "hello", stream=False)
    assert sent() - before == 4  # and the response body, once


def test_a_chained_turn_on_a_drained_provider_gets_the_documented_error_never_a_404(gw):
    apis = clients(gw)
    first, provider = respond(apis[0], "start", stream=False, instructions="be brief")
    config = str(gw.running[0].config_path)
    assert cli.main(["drain", provider, "--config", config]) == 0
    try:
        def chained_answer():  # until every instance sees the drain: a 200 meanwhile is a fine turn
            try:
                respond(apis[1], "next", stream=False, previous_response_id=first)
            except openai.APIStatusError as exc:
                return exc
            return None

        error = wait_until(chained_answer, within_seconds=10)
        assert isinstance(error, openai.APIStatusError), error
        assert error.status_code == 503 and error.code == "previous_response_unavailable"
        assert error.body["param"] == "previous_response_id" and provider in error.message
        other = next(name for name in OWN if name != provider)
        # Instance 0 sees the drain at its own flag refresh, which may come after instance 1's.
        assert wait_until(lambda: respond(apis[0], "a new chain", stream=False, instructions="be brief")[1] == other, within_seconds=10)
    finally:
        assert cli.main(["undrain", provider, "--config", config]) == 0
