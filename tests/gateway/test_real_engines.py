"""Real inference engines behind the gateway: llama.cpp's llama-server with SmolLM2-135M
(irislab.engines; `./dev test` builds it once per machine). Their streaming format, usage fields,
prompt cache, errors and crashes are the engines' own, not the simulator's.

Providers: `iris-1` is a pool of two llama-servers behind one MAGLEV cluster (the shipped
envoy.yaml), `iris-2` one llama-server, `tensorx` a simulated third party. Which replica served a
request is read from the engines' own counters (`llamacpp:prompt_tokens_total`), requests being
sent one at a time."""

from __future__ import annotations

import contextlib
from pathlib import Path

import httpx
import openai
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from extproc import cli
from irislab.engines import MODEL_NAME, LlamaServer
from irislab.local_gateway import LocalGateway, ProviderSimulation
from tests.support.gateway import wait_for_no_leases, wait_until

PARALLEL = 2  # llama-server slots per engine: the pair's capacity per replica


def engines_config() -> dict:
    own = {"features": ["chat", "completions"], "limits": {"max_global_in_flight_request_slots": 2 * PARALLEL}}
    return {
        "redis": {"key_prefix": "engines"},
        "server": {"expose_routing_headers": True, "degraded_refresh_seconds": 0.1},
        "degradation": {"connect": {"ttl_seconds": 60}},
        "token_usage": {"providers": "all"},  # the engines' own usage fields, counted (iris_tokens_total)
        "providers": [
            {"name": "iris-1", "kind": "managed", "cluster": "iris-1", "models": {MODEL_NAME: own}},
            {"name": "iris-2", "kind": "managed", "cluster": "iris-2", "models": {MODEL_NAME: own}},
            {"name": "tensorx", "kind": "unlimited", "cluster": "tensorx", "models": {MODEL_NAME: {"features": ["chat", "completions"]}}},
        ],
    }


@contextlib.contextmanager
def started_engines(logs: Path, count: int = 3):
    """`count` llama-servers of PARALLEL slots, logging into `logs`, each stopped on leaving."""
    servers = [LlamaServer(logs, parallel=PARALLEL, name=f"llama-{i}") for i in range(count)]
    try:
        for server in servers:
            server.start()
        yield servers
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    with started_engines(tmp_path_factory.mktemp("engines")) as servers:
        yield servers


@pytest.fixture(scope="module")
def gateway(engines, tmp_path_factory):
    pool, single = [s.url for s in engines[:2]], [engines[2].url]
    gateway = LocalGateway(config_data=engines_config(), engines={"iris-1": pool, "iris-2": single},
                           default_simulation=ProviderSimulation(ttft_ms=1, per_token_ms=1), work_dir=tmp_path_factory.mktemp("gateway"))
    with gateway:
        yield gateway


def client(gateway: LocalGateway, key: str = "user-key") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=120)


def system_prompt(session: str, facts: int = 40) -> str:
    """A long opening (about 20 tokens a fact, 800 with 40), different from its first words on, so
    no other session shares its prefix."""
    facts = " ".join(f"Fact {i} of {session}: the number {i} is written {i * 7 % 97}." for i in range(facts))
    return f"You are the assistant of {session}. Answer in one short sentence. {facts}"


def served_by(engines: list[LlamaServer], send):
    """Call `send()` and return (its result, the index of the engine whose prompt counter moved)."""
    before = [server.metrics().get("llamacpp:prompt_tokens_total", 0) for server in engines]
    result = send()
    after = [server.metrics().get("llamacpp:prompt_tokens_total", 0) for server in engines]
    moved = [i for i, (a, b) in enumerate(zip(before, after)) if b > a]
    assert len(moved) <= 1, moved
    return result, (moved[0] if moved else None)


def tokens_counted(gateway: LocalGateway) -> dict[str, float]:
    """iris_tokens_total summed over providers: {gen_ai_token_type: tokens}."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(gateway.running[0].metrics_url, timeout=10).text):
        for sample in family.samples:
            if sample.name == "iris_tokens_total":
                kind = sample.labels["gen_ai_token_type"]
                found[kind] = found.get(kind, 0) + sample.value
    return found


def test_streamed_and_non_streamed_chat_through_the_openai_sdk(gateway):
    sdk = client(gateway)
    before = tokens_counted(gateway)
    answer = sdk.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8)
    assert answer.choices[0].message.content and answer.usage.prompt_tokens > 0 and answer.usage.completion_tokens > 0
    stream = sdk.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Count to three."}], max_tokens=8, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert wait_for_no_leases(redis.Redis.from_url(gateway.redis_url), within_seconds=10) == 0
    # The gateway counted exactly what the engine reported, from its JSON answer and its stream's last
    # chunk (counted when Envoy hands the server the body's end, which may come after the client
    # read the last chunk: waited for, then checked not to grow further).
    reported = (answer.usage, chunks[-1].usage)
    expected = {"input": sum(u.prompt_tokens for u in reported), "output": sum(u.completion_tokens for u in reported)}

    def counted() -> dict[str, float]:
        after = tokens_counted(gateway)
        return {kind: after.get(kind, 0) - before.get(kind, 0) for kind in ("input", "output")}

    wait_until(lambda: counted() == expected, within_seconds=10)
    assert counted() == expected


def test_each_session_keeps_its_replica_and_meets_its_own_cache_there_only(gateway, engines):
    """Every turn of a session on one engine of the pool, its later turns served from that
    engine's prompt cache (the engine's own `cached_tokens`); the same turn sent straight to the
    pool's other engine finds nothing of the session cached."""
    sdk = client(gateway)
    pool = engines[:2]
    homes = {}
    for number in range(6):
        session = f"session-{number}"
        messages = [{"role": "system", "content": system_prompt(session)}]
        for turn in range(3):
            messages.append({"role": "user", "content": f"Question {turn}: what is fact {turn}?"})

            def send(messages=messages, session=session):
                return sdk.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8, extra_headers={"x-session-id": session})

            answer, engine = served_by(pool, send)
            assert engine is not None
            assert homes.setdefault(session, engine) == engine, f"{session} moved on turn {turn}"
            cached = answer.usage.prompt_tokens_details.cached_tokens
            if turn > 0:
                assert cached > answer.usage.prompt_tokens // 2, (session, turn, answer.usage)
            messages.append({"role": "assistant", "content": answer.choices[0].message.content})
        other = pool[1 - homes[session]]
        elsewhere = httpx.post(f"{other.url}/v1/chat/completions", json={"model": MODEL_NAME, "messages": messages, "max_tokens": 4},
                               timeout=120).json()
        # Only the chat template's opening and "You are the assistant of session-" are shared by
        # every session: a few tokens, against most of the prompt on the session's own replica.
        assert elsewhere["usage"]["prompt_tokens_details"]["cached_tokens"] < 16, elsewhere["usage"]
    assert set(homes.values()) == {0, 1}, homes  # six sessions over both replicas


def test_an_engine_error_passes_through_and_releases_the_lease(gateway):
    """A prompt longer than a slot's context: llama-server's own 400 reaches the client as it
    wrote it, and the lease is released."""
    sdk = client(gateway)
    with pytest.raises(openai.BadRequestError) as raised:
        sdk.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "word " * 9000}], max_tokens=4)
    error = raised.value.body if isinstance(raised.value.body, dict) else {}
    assert "context" in str(error).lower(), raised.value
    assert wait_for_no_leases(redis.Redis.from_url(gateway.redis_url), within_seconds=10) == 0


async def test_the_llamacpp_load_preset_reads_the_engines_own_metrics(gateway, engines):
    """The `llamacpp` preset on a real llama-server's /metrics: more requests than its slots wait
    (`llamacpp:requests_deferred`), the pair is degraded (source load) while they do, and the
    flag clears once the engine has caught up."""
    import asyncio

    from extproc.config import parse_config
    from extproc.operations.health import HealthMonitor
    from extproc.routing.degraded import LOAD, DegradedFlags
    from extproc.storage.client import connect

    engine = engines[1]
    data = engines_config()
    data["redis"] = {"url": gateway.redis_url, "key_prefix": "load-preset"}
    data["providers"][0]["load"] = {"url": f"{engine.url}/metrics", "preset": "llamacpp", "interval_seconds": 0.1, "timeout_seconds": 1}
    config = parse_config(data)
    redis_client = connect(gateway.redis_url, timeout_seconds=5)
    flags = DegradedFlags(redis_client, config)
    monitor = HealthMonitor(config, redis_client, flags)
    monitor.start()
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Write a long story about a river."}], "max_tokens": 96}
    try:
        async with httpx.AsyncClient(timeout=300) as http:
            flood = [asyncio.create_task(http.post(f"{engine.url}/v1/chat/completions", json=body)) for _ in range(PARALLEL + 4)]
            seen = None
            for _ in range(600):
                await flags.refresh()
                seen = flags.flags("iris-1", MODEL_NAME).get(LOAD)
                if seen:
                    break
                await asyncio.sleep(0.05)
            assert seen and "llamacpp:requests_deferred=" in seen, seen
            assert all(r.status_code == 200 for r in await asyncio.gather(*flood))
        for _ in range(600):
            await flags.refresh()
            if not flags.is_degraded("iris-1", MODEL_NAME):
                break
            await asyncio.sleep(0.05)
        assert not flags.is_degraded("iris-1", MODEL_NAME)
    finally:
        await monitor.close()
        await redis_client.aclose()


def test_a_killed_engine_degrades_its_provider_and_traffic_moves_on(gateway, engines):
    """iris-2's only engine dies while iris-1 is drained (so iris-2 takes the traffic): the request
    that meets the dead engine gets a clean 503 with retry-after, the pair is degraded (source
    connect) at once, later requests go to the third party, and no lease is left."""
    sdk = client(gateway, key="other-key")
    config_path = str(gateway.running[0].config_path)
    assert cli.main(["drain", "iris-1", "--config", config_path]) == 0
    try:
        def served_by_iris_2() -> bool:
            response = sdk.chat.completions.with_raw_response.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            return response.headers["x-iris-provider"] == "iris-2"

        assert wait_until(served_by_iris_2, within_seconds=10)
        engines[2].kill()
        with pytest.raises(openai.APIStatusError) as raised:
            sdk.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hello"}], max_tokens=2)
        assert raised.value.status_code == 503 and raised.value.response.headers.get("retry-after")
        assert raised.value.body["code"] == "upstream_unavailable", raised.value.body
        state = redis.Redis.from_url(gateway.redis_url)
        assert any(key.endswith(b":degraded:iris-2:connect") for key in state.keys("*degraded*"))
        for i in range(4):
            response = sdk.chat.completions.with_raw_response.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": f"hello {i}"}], max_tokens=2,
            )
            assert response.headers["x-iris-provider"] == "tensorx"
        assert wait_for_no_leases(state, within_seconds=10) == 0
    finally:
        cli.main(["undrain", "iris-1", "--config", config_path])
