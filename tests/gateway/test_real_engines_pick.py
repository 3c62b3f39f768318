"""Affinity pick over real engines (issue 30): three llama-servers (SmolLM2-135M, 2 slots each)
are the endpoints of ONE managed provider with `affinity: pick` and `max_in_flight_per_endpoint:
2`, through real Envoy (the override_host cluster `envoy-config` renders) and the real ext_proc
server, with a simulated third party behind them. The router's pick is `x-iris-endpoint`; which
engine served a request is read from the engines' own counters (`llamacpp:prompt_tokens_total`,
`llamacpp:prompt_tokens_cached_total`) and the usage's `cached_tokens`, requests that are not
held open being sent one at a time. After every test no lease is live on any endpoint.

Sessions come from `x-session-id` alone (`session.signals`), so a request without it has no
session at all. The last test kills an engine."""

from __future__ import annotations

import concurrent.futures
import contextlib

import httpx
import pytest
import redis

from irislab.engines import MODEL_NAME, LlamaServer
from irislab.local_gateway import LocalGateway, ProviderSimulation
from tests.gateway.test_real_engines import PARALLEL, client, served_by, started_engines, system_prompt
from tests.support.gateway import live_leases, wait_for_no_leases, wait_until

ENGINES = 3
PREFIX = "realpool"
ENDPOINT_LEASES = f"{{{PREFIX}:{MODEL_NAME}}}:endpoint-leases:iris-1:"  # + ip:port: the zset of the endpoint's leases


def pool_config(urls: list[str]) -> dict:
    own = {"features": ["chat", "completions"], "limits": {"max_global_in_flight_request_slots": ENGINES * PARALLEL},
           "max_in_flight_per_endpoint": PARALLEL}
    return {
        "redis": {"key_prefix": PREFIX},
        "server": {"expose_routing_headers": True, "degraded_refresh_seconds": 0.1},
        "session": {"signals": ["session_header"]},
        "degradation": {"connect": {"ttl_seconds": 60}},
        "providers": [
            {"name": "iris-1", "kind": "managed", "cluster": "iris-1", "affinity": "pick", "endpoints": urls,
             "models": {MODEL_NAME: own}},
            {"name": "tensorx", "kind": "unlimited", "cluster": "tensorx", "models": {MODEL_NAME: {"features": ["chat", "completions"]}}},
        ],
    }


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    with started_engines(tmp_path_factory.mktemp("pool-engines"), ENGINES) as servers:
        yield servers


@pytest.fixture(scope="module")
def gateway(engines, tmp_path_factory):
    urls = [server.url for server in engines]
    gateway = LocalGateway(config_data=pool_config(urls), engines={"iris-1": urls},
                           default_simulation=ProviderSimulation(ttft_ms=1, per_token_ms=1), work_dir=tmp_path_factory.mktemp("pool"))
    with gateway:
        yield gateway


@pytest.fixture
def store(gateway):
    """The gateway's Redis; on leaving, every lease, of the pair and of each endpoint, is over."""
    client = redis.Redis.from_url(gateway.redis_url)
    yield client
    try:
        assert wait_for_no_leases(client, within_seconds=10, keys=f"{ENDPOINT_LEASES}*") == 0
        assert wait_for_no_leases(client, within_seconds=10) == 0
    finally:
        client.close()


def endpoint(server: LlamaServer) -> str:
    """The engine's `ip:port`, as the router names it in `x-iris-endpoint`."""
    return f"127.0.0.1:{server.port}"


def messages(prefix_owner: str, question: str, facts: int = 8) -> list[dict[str, str]]:
    """A system prompt that every user of `prefix_owner` shares (about 20 tokens a fact: 180 tokens
    with 8, a few seconds of prompt processing on a loaded 2-core machine), then the user's own
    question."""
    return [{"role": "system", "content": system_prompt(prefix_owner, facts)}, {"role": "user", "content": question}]


def turn(gateway: LocalGateway, chat: list[dict[str, str]], session: str | None):
    """One chat turn through the gateway, non-streamed, 4 tokens at most: the raw answer."""
    headers = {"x-session-id": session} if session else {}
    return client(gateway).chat.completions.with_raw_response.create(model=MODEL_NAME, messages=chat, max_tokens=4, extra_headers=headers)


def ask(gateway: LocalGateway, engines: list[LlamaServer], chat: list[dict[str, str]], session: str | None):
    """One turn (`turn`), alone on `engines`: (the raw answer, the index of the engine whose
    prompt counter moved)."""
    return served_by(engines, lambda: turn(gateway, chat, session))


@contextlib.contextmanager
def held(gateway: LocalGateway, chat: list[dict[str, str]], session: str):
    """A streamed request that would run for thousands of tokens (`ignore_eos`), held open while
    inside: yields the endpoint picked, once the engine has streamed its first token. Leaving
    closes the connection: the engine stops and the lease is released."""
    body = {"model": MODEL_NAME, "messages": chat, "max_tokens": 4000, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=120) as http, http.stream("POST", f"{gateway.url}/v1/chat/completions", json=body,
                                                        headers={"x-session-id": session, "authorization": "Bearer user-key"}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["x-iris-provider"] == "iris-1"
        lines = response.iter_lines()  # kept until the end: a collected iterator closes the connection
        next(line for line in lines if line.startswith("data:"))
        yield response.headers["x-iris-endpoint"]


def cached_tokens(answer) -> int:
    return answer.parse().usage.prompt_tokens_details.cached_tokens


def test_a_groups_users_land_where_their_prefix_is(gateway, engines, store):
    """Users of one group (each its own session) share a long system prompt: the first lands on
    some engine, every later one on the same engine, which serves most of their prompt from its
    cache (its own `prompt_tokens_cached_total` grows); a second group's users share an engine
    of their own the same way."""
    for group in ("group-a", "group-b"):
        home = None
        for user in range(3):
            before = engines[home].metrics()["llamacpp:prompt_tokens_cached_total"] if home is not None else 0
            answer, engine = ask(gateway, engines, messages(group, f"I am user {user}. What is fact {user}?"), f"{group}-user-{user}")
            assert answer.headers["x-iris-provider"] == "iris-1"
            assert answer.headers["x-iris-endpoint"] == endpoint(engines[engine]), "the engine picked served it"
            if home is None:
                home = engine
                continue
            assert engine == home, f"{group} user {user} left the engine holding the group's prefix"
            prompt = answer.parse().usage.prompt_tokens
            assert cached_tokens(answer) > prompt // 2, (group, user, answer.parse().usage)
            assert engines[home].metrics()["llamacpp:prompt_tokens_cached_total"] - before > prompt // 2


def test_an_endpoint_at_its_cap_is_skipped(gateway, engines, store):
    """Three users of a group are placed where its prefix is, engine A; the next turns of two of
    them, long streams, fill A to its cap (2): the third user's next turn (pinned to A) and a new
    user of the group are placed on other engines, and A's count goes back to 0 afterwards."""
    users = [f"group-c-user-{user}" for user in range(PARALLEL + 1)]
    homes = {ask(gateway, engines, messages("group-c", f"I am {user}."), user)[1] for user in users}
    assert len(homes) == 1, "the group's later users went where its prefix is"
    home = homes.pop()
    with contextlib.ExitStack() as stack:
        for user in users[:PARALLEL]:
            picked = stack.enter_context(held(gateway, messages("group-c", f"I am {user}. Tell a long story."), user))
            assert picked == endpoint(engines[home]), "a pinned turn goes to its endpoint while it is under its cap"
        assert wait_until(lambda: engines[home].metrics()["llamacpp:requests_processing"] == PARALLEL, within_seconds=10)
        assert live_leases(store, ENDPOINT_LEASES + endpoint(engines[home])) == PARALLEL
        for user in (users[-1], "group-c-late"):
            answer, engine = ask(gateway, engines, messages("group-c", f"I am {user}. What is fact 1?"), user)
            assert engine is not None and engine != home, f"{user}: the engine at its cap was skipped"
            assert answer.headers["x-iris-endpoint"] == endpoint(engines[engine])
    assert wait_for_no_leases(store, within_seconds=10, keys=ENDPOINT_LEASES + endpoint(engines[home])) == 0
    assert wait_until(lambda: engines[home].metrics()["llamacpp:requests_processing"] == 0, within_seconds=10), "the engine stopped the streams"


def test_sessionless_requests_go_to_the_least_loaded_engine(gateway, engines, store):
    """One long stream on each of two engines (neither at its cap): requests without a session,
    each with a prompt no engine has seen, all go to the third, idle engine."""
    with contextlib.ExitStack() as stack:
        busy = {stack.enter_context(held(gateway, messages(f"busy-{n}", "Tell a long story.", facts=1), f"busy-{n}")) for n in range(2)}
        assert len(busy) == 2, "the second new session went to an engine without a request"
        idle = next(i for i, server in enumerate(engines) if endpoint(server) not in busy)
        assert [live_leases(store, ENDPOINT_LEASES + endpoint(server)) for server in engines] == [int(i != idle) for i in range(ENGINES)]
        for number in range(3):
            answer, engine = ask(gateway, engines, messages(f"sessionless-{number}", "Say hello.", facts=1), None)
            assert answer.headers["x-iris-endpoint"] == endpoint(engines[idle]) and engine == idle, number


def test_a_killed_engine_moves_only_its_sessions(gateway, engines, store):
    """Six sessions placed at once spread over the three engines (by their counts); one
    engine is stopped. Each session's next turn answers 200: those of the stopped engine from
    another engine (its refused connection is retried by Envoy on the pick's next endpoint, and
    the router takes the endpoint out, source connect), the others from their own engine and its
    cache. Last in the module: it stops an engine."""
    sessions = [f"kill-{n}" for n in range(6)]
    chats = {s: messages(s, "What is fact 1?", facts=2) for s in sessions}
    with concurrent.futures.ThreadPoolExecutor(len(sessions)) as workers:
        firsts = dict(zip(sessions, workers.map(lambda s: turn(gateway, chats[s], s), sessions)))
    home = {s: answer.headers["x-iris-endpoint"] for s, answer in firsts.items()}
    assert set(home.values()) == {endpoint(server) for server in engines}, home  # two each unless a turn ended early
    victim = engines[0]
    victim.stop()
    for session in sessions:
        chats[session] += [{"role": "assistant", "content": firsts[session].parse().choices[0].message.content},
                           {"role": "user", "content": "And fact 2?"}]
        answer, engine = ask(gateway, engines[1:], chats[session], session)
        assert answer.status_code == 200 and answer.headers["x-iris-provider"] == "iris-1"
        if home[session] == endpoint(victim):
            assert engine is not None, f"{session}: no live engine served the dead engine's session"
            # The pick names the dead engine until the router has taken it out (Envoy's retry served
            # that turn on the next endpoint of the pick), another engine after.
            assert answer.headers["x-iris-endpoint"] in (endpoint(victim), endpoint(engines[1:][engine]))
        else:
            assert endpoint(engines[1:][engine]) == home[session] == answer.headers["x-iris-endpoint"], f"{session} of a live engine moved"
            assert cached_tokens(answer) > answer.parse().usage.prompt_tokens // 2
    flags = store.hgetall(f"{{{PREFIX}:{MODEL_NAME}}}:endpoint-health:iris-1")
    assert any(field.decode().startswith(f"{endpoint(victim)} connect") for field in flags), flags
