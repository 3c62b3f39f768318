"""The simulated provider, checked over real HTTP on 127.0.0.1 (no assertion on elapsed time)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson
import pytest

from irislab.processes import free_port
from irislab.simulator import SimulatorConfig, decode_token_ms, start_simulator

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL = "sim-model"


@contextlib.asynccontextmanager
async def running(**config: Any) -> AsyncIterator[tuple[Any, aiohttp.ClientSession]]:
    """A simulator named "sim" with `config`, and a client session whose base URL is it."""
    simulator = await start_simulator(SimulatorConfig(name="sim", **config))
    try:
        async with aiohttp.ClientSession(base_url=simulator.url) as http:
            yield simulator, http
    finally:
        await simulator.stop()


def chat(prompt: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], **extra}


async def post(http: aiohttp.ClientSession, path: str, body: Any, **kw: Any) -> tuple[int, Any]:
    async with http.post(path, json=body, **kw) as response:
        return response.status, await response.json()


async def stats(http: aiohttp.ClientSession) -> dict[str, Any]:
    async with http.get("/stats") as response:
        return await response.json()


async def wait_idle(http: aiohttp.ClientSession) -> dict[str, Any]:
    """/stats once in_flight is back to 0, or after about 5 seconds of polling."""
    for _ in range(100):
        current = await stats(http)
        if current["in_flight"] == 0:
            break
        await asyncio.sleep(0.05)
    return current


def sse_events(raw: bytes) -> list[bytes]:
    """The ``data:`` payloads of a server-sent-events body, in order."""
    return [
        line.removeprefix(b"data: ")
        for line in raw.split(b"\n")
        if line.startswith(b"data: ")
    ]


def words(start: int, count: int, tag: str = "w") -> str:
    return " ".join(f"{tag}{i}" for i in range(start, start + count))


@pytest.mark.asyncio
async def test_chat_answer_shape_and_usage() -> None:
    async with running() as (simulator, http):
        async with http.post("/v1/chat/completions", json=chat("a b c d e", max_tokens=3)) as r:
            assert r.status == 200
            assert r.headers["x-simulator-name"] == "sim"
            assert r.content_type == "application/json"
            body = await r.json()
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    assert body["model"] == MODEL
    assert isinstance(body["created"], int)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "tok0 tok1 tok2"}
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 3,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert simulator.state.requests_by_status == {"200": 1}


@pytest.mark.asyncio
async def test_chat_content_parts_and_default_max_tokens() -> None:
    content = [
        {"type": "text", "text": "one two"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "text", "text": "three"},
    ]
    request = {
        "model": MODEL,
        "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": content}],
    }
    async with running(default_max_tokens=2) as (_, http):
        status, body = await post(http, "/v1/chat/completions", request)
    assert status == 200
    assert body["usage"]["prompt_tokens"] == 4
    assert body["usage"]["completion_tokens"] == 2


@pytest.mark.asyncio
async def test_completions_shape() -> None:
    request = {"model": MODEL, "prompt": ["a b", "c"], "max_tokens": 2}
    async with running() as (_, http):
        status, body = await post(http, "/v1/completions", request)
    assert status == 200
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == "tok0 tok1"
    assert body["usage"]["prompt_tokens"] == 3


@pytest.mark.asyncio
async def test_prefix_cache_counts_shared_leading_blocks() -> None:
    async with running(block_tokens=4) as (simulator, http):

        async def cached(prompt: str) -> int:
            status, body = await post(http, "/v1/chat/completions", chat(prompt, max_tokens=1))
            assert status == 200
            return body["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert await cached(words(0, 10)) == 0  # 2 full blocks cached, 2 words not
        assert await cached(words(0, 8) + " other tail") == 8
        assert await cached(words(0, 4) + " x " + words(5, 10)) == 4
        assert await cached("different " + words(1, 10)) == 0
        assert await cached(words(0, 3)) == 0  # no full block
        state = simulator.state
    assert state.cached_tokens == 12
    assert state.prompt_tokens == 10 + 10 + 15 + 11 + 3


@pytest.mark.asyncio
async def test_prefix_cache_evicts_least_recently_used() -> None:
    async with running(block_tokens=2, cache_blocks=2) as (_, http):

        async def cached(prompt: str) -> int:
            _, body = await post(http, "/v1/chat/completions", chat(prompt, max_tokens=1))
            return body["usage"]["prompt_tokens_details"]["cached_tokens"]

        await cached("a b c d")  # blocks [ab], [ab|cd]
        await cached("x y")  # evicts [ab]
        assert await cached("a b c d") == 0


@pytest.mark.asyncio
async def test_stream_sends_one_chunk_per_token_then_usage_and_done() -> None:
    request = chat("a b c", max_tokens=5, stream=True, stream_options={"include_usage": True})
    async with running(per_token_ms=1) as (simulator, http):
        async with http.post("/v1/chat/completions", json=request) as r:
            assert r.status == 200
            assert r.content_type == "text/event-stream"
            assert r.headers["x-simulator-name"] == "sim"
            events = sse_events(await r.read())
        assert simulator.state.completion_tokens == 5
    assert events[-1] == b"[DONE]"
    chunks = [orjson.loads(event) for event in events[:-1]]
    token_chunks = [chunk for chunk in chunks if chunk["choices"]]
    assert len(token_chunks) == 5
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    text = "".join(chunk["choices"][0]["delta"]["content"] for chunk in token_chunks)
    assert text == "tok0 tok1 tok2 tok3 tok4"
    assert token_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    assert chunks[-1]["usage"]["prompt_tokens"] == 3


@pytest.mark.asyncio
async def test_stream_without_include_usage_has_no_usage_chunk() -> None:
    async with running() as (_, http):
        async with http.post("/v1/completions", json={
            "model": MODEL, "prompt": "a", "max_tokens": 3, "stream": True
        }) as r:
            events = sse_events(await r.read())
    assert events[-1] == b"[DONE]"
    chunks = [orjson.loads(event) for event in events[:-1]]
    assert [chunk["choices"][0]["text"] for chunk in chunks] == ["tok0", " tok1", " tok2"]


@pytest.mark.asyncio
async def test_responses_api_plain_and_streamed() -> None:
    request = {
        "model": MODEL,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "a b"}]}],
        "max_output_tokens": 2,
    }
    async with running() as (_, http):
        status, body = await post(http, "/v1/responses", request)
        async with http.post("/v1/responses", json={**request, "stream": True}) as r:
            events = [orjson.loads(event) for event in sse_events(await r.read())]
    assert status == 200
    assert body["object"] == "response"
    assert body["output"][0]["content"][0]["text"] == "tok0 tok1"
    assert body["usage"]["input_tokens"] == 2
    assert body["usage"]["output_tokens"] == 2
    types = [event["type"] for event in events]
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    assert {event["item_id"] for event in events if "item_id" in event} == {events[2]["item"]["id"]}
    assert events[6]["text"] == "tok0 tok1"
    assert events[-1]["response"]["usage"]["output_tokens"] == 2


@pytest.mark.asyncio
async def test_openai_sdk_responses_stream_reads_the_streamed_events() -> None:
    """The openai SDK's `responses.stream` accumulates the events into the final response; it
    raises when an item or content part is not announced before its deltas."""
    import openai

    async with running() as (simulator, _):
        client = openai.AsyncOpenAI(base_url=f"{simulator.url}/v1", api_key="unused", max_retries=0)
        try:
            async with client.responses.stream(model=MODEL, input="a b c", max_output_tokens=3) as stream:
                deltas = [event.delta async for event in stream if event.type == "response.output_text.delta"]
                final = await stream.get_final_response()
        finally:
            await client.close()
    assert "".join(deltas) == "tok0 tok1 tok2"
    assert final.output_text == "tok0 tok1 tok2"
    assert final.status == "completed" and final.usage.output_tokens == 3


@pytest.mark.asyncio
async def test_stored_responses_chain_here_only_and_an_unknown_one_is_a_404() -> None:
    first = {"model": MODEL, "input": "a b c d", "max_output_tokens": 2}
    async with running(block_tokens=2) as (_, http), running() as (_, elsewhere):
        _, one = await post(http, "/v1/responses", first)
        status, two = await post(http, "/v1/responses", {**first, "input": "e f", "previous_response_id": one["id"]})
        assert status == 200 and two["usage"]["input_tokens"] == 4 + 2 + 2  # stored prompt, answer, new input
        assert two["usage"]["input_tokens_details"]["cached_tokens"] == 4
        status, missing = await post(elsewhere, "/v1/responses", {**first, "previous_response_id": one["id"]})
        assert (status, missing["error"]["code"]) == (404, "previous_response_not_found")
        _, unstored = await post(http, "/v1/responses", {**first, "store": False})
        status, _ = await post(http, "/v1/responses", {**first, "previous_response_id": unstored["id"]})
        assert status == 404
        for _ in range(2):
            status, _ = await post(http, "/v1/responses", {**first, "conversation": {"id": "conv_1"}})
        assert status == 200 and (await stats(http))["responses_stored"] == 4


@pytest.mark.asyncio
async def test_max_in_flight_counts_concurrent_requests() -> None:
    async with running(ttft_ms=200) as (simulator, http):
        results = await asyncio.gather(
            *(post(http, "/v1/chat/completions", chat("hi", max_tokens=1)) for _ in range(5))
        )
        current = await stats(http)
    assert [status for status, _ in results] == [200] * 5
    assert current["max_in_flight"] == 5
    assert current["in_flight"] == 0
    assert current["max_in_flight_by_model"] == {MODEL: 5}
    assert current["in_flight_by_model"] == {MODEL: 0}
    assert current["requests"] == 5
    assert simulator.state.max_in_flight == 5


@pytest.mark.asyncio
async def test_client_disconnect_mid_stream_ends_the_request() -> None:
    request = chat("a", max_tokens=100_000, stream=True)
    async with running(per_token_ms=20) as (simulator, http):
        async with aiohttp.ClientSession(base_url=simulator.url) as client:
            async with client.post("/v1/chat/completions", json=request) as r:
                assert r.status == 200
                await r.content.readline()  # the first chunk has arrived
                assert (await stats(http))["in_flight"] == 1
        current = await wait_idle(http)
    assert current["in_flight"] == 0
    assert current["in_flight_by_model"] == {MODEL: 0}
    assert current["requests_by_status"] == {"499": 1}


@pytest.mark.asyncio
async def test_client_timeout_before_answer_ends_the_request() -> None:
    async with running(ttft_ms=60_000) as (_, http):
        with pytest.raises(asyncio.TimeoutError):
            await post(
                http,
                "/v1/chat/completions",
                chat("a"),
                timeout=aiohttp.ClientTimeout(total=0.3),
            )
        current = await wait_idle(http)
    assert current["in_flight"] == 0
    assert current["requests_by_status"] == {"499": 1}


@pytest.mark.asyncio
async def test_prefill_time_is_spent_only_on_uncached_tokens() -> None:
    # 30 s per uncached token: the first request cannot finish in time; its block is cached as
    # soon as it arrives, so the same prompt then needs no prefill at all.
    async with running(prefill_ms_per_token=30_000, block_tokens=2) as (_, http):
        with pytest.raises(asyncio.TimeoutError):
            await post(
                http, "/v1/chat/completions", chat("a b", max_tokens=1),
                timeout=aiohttp.ClientTimeout(total=0.3),
            )
        status, body = await post(
            http, "/v1/chat/completions", chat("a b", max_tokens=1),
            timeout=aiohttp.ClientTimeout(total=10),
        )
    assert status == 200
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 2


@pytest.mark.asyncio
async def test_required_api_key() -> None:
    async with running(required_api_key="secret") as (_, http):
        status, body = await post(http, "/v1/chat/completions", chat("a"))
        wrong, _ = await post(
            http, "/v1/chat/completions", chat("a"), headers={"authorization": "Bearer nope"}
        )
        bearer, _ = await post(
            http, "/v1/chat/completions", chat("a"), headers={"authorization": "Bearer secret"}
        )
        api_key, _ = await post(
            http, "/v1/chat/completions", chat("a"), headers={"api-key": "secret"}
        )
    assert status == 401
    assert set(body["error"]) == {"message", "type", "code"}
    assert body["error"]["code"] == "invalid_api_key"
    assert (wrong, bearer, api_key) == (401, 200, 200)


@pytest.mark.asyncio
async def test_served_model_names() -> None:
    async with running(served_model_names=[MODEL]) as (_, http):
        ok, _ = await post(http, "/v1/chat/completions", chat("a"))
        status, body = await post(
            http, "/v1/chat/completions", {**chat("a"), "model": "other"}
        )
    assert ok == 200
    assert status == 404
    assert body["error"]["code"] == "model_not_found"


@pytest.mark.asyncio
async def test_bad_json_is_an_openai_error() -> None:
    async with running() as (simulator, http):
        async with http.post(
            "/v1/chat/completions", data=b"{nope", headers={"content-type": "application/json"}
        ) as r:
            status, body = r.status, await r.json()
    assert status == 400
    assert body["error"]["type"] == "invalid_request_error"
    assert simulator.state.in_flight == 0
    assert simulator.state.requests_by_status == {"400": 1}


@pytest.mark.asyncio
async def test_headers_and_models_are_recorded() -> None:
    async with running() as (_, http):
        await post(http, "/v1/chat/completions", chat("a"), headers={"X-Trace-Id": "t-1"})
        await post(http, "/v1/embeddings", {"model": "embedder", "input": "a"})
        current = await stats(http)
        reset = await (await http.post("/stats/reset")).json()
    assert current["last_request_headers"][0]["x-trace-id"] == "t-1"
    assert current["last_request_models"] == [MODEL, "embedder"]
    assert current["prompt_tokens"] == 2
    assert reset["requests"] == 0
    assert reset["last_request_headers"] == []
    assert reset["max_in_flight"] == 0


@pytest.mark.asyncio
async def test_failure_injection_status_and_count() -> None:
    async with running() as (simulator, http):
        armed, _ = await post(http, "/control/fail", {"status": 503, "count": 2})
        first, error = await post(http, "/v1/chat/completions", chat("a"))
        second, _ = await post(http, "/v1/chat/completions", chat("a"))
        third, _ = await post(http, "/v1/chat/completions", chat("a"))
        await post(http, "/control/fail", {"status": 429, "count": -1})
        until_cleared = [
            (await post(http, "/v1/chat/completions", chat("a")))[0] for _ in range(3)
        ]
        await http.post("/control/clear")
        cleared, _ = await post(http, "/v1/chat/completions", chat("a"))
    assert armed == 200
    assert (first, second, third) == (503, 503, 200)
    assert set(error["error"]) == {"message", "type", "code"}
    assert until_cleared == [429, 429, 429]
    assert cleared == 200
    assert simulator.state.requests_by_status == {"503": 2, "200": 2, "429": 3}


@pytest.mark.asyncio
async def test_failure_injection_rejects_a_bad_plan() -> None:
    async with running() as (_, http):
        status, body = await post(http, "/control/fail", {"mode": "hang"})
    assert status == 400
    assert "mode" in body["error"]["message"]


@pytest.mark.asyncio
async def test_reset_mode_drops_the_connection() -> None:
    stream = chat("a", max_tokens=5, stream=True)
    async with running() as (simulator, http):
        await post(http, "/control/fail", {"mode": "reset", "count": 2})
        with pytest.raises(aiohttp.ClientError):
            await post(http, "/v1/chat/completions", chat("a"))
        with pytest.raises(aiohttp.ClientError):
            async with http.post("/v1/chat/completions", json=stream) as r:
                await r.read()
        after, _ = await post(http, "/v1/chat/completions", chat("a"))
        current = await wait_idle(http)
    assert after == 200
    assert current["requests_by_status"] == {"reset": 2, "200": 1}
    assert simulator.state.in_flight == 0


@pytest.mark.asyncio
async def test_health_toggles() -> None:
    async with running() as (_, http):
        healthy = (await http.get("/health")).status
        await post(http, "/control/health", {"healthy": False})
        async with http.get("/health") as r:
            down, down_body = r.status, await r.json()
        await post(http, "/control/health", {"healthy": True})
        back = (await http.get("/health")).status
    assert (healthy, down, back) == (200, 503, 200)
    assert down_body["status"] != "ok"


@pytest.mark.asyncio
async def test_embeddings_shape() -> None:
    request = {"model": "embedder", "input": ["a b", "c", "a b"]}
    async with running() as (_, http):
        status, body = await post(http, "/v1/embeddings", request)
        _, single = await post(http, "/v1/embeddings", {"model": "embedder", "input": "c"})
    assert status == 200
    assert body["object"] == "list"
    vectors = [item["embedding"] for item in body["data"]]
    assert [item["index"] for item in body["data"]] == [0, 1, 2]
    assert all(len(vector) == 8 for vector in vectors)
    assert all(isinstance(x, float) and -1 <= x < 1 for vector in vectors for x in vector)
    assert vectors[0] == vectors[2] != vectors[1]
    assert single["data"][0]["embedding"] == vectors[1]
    assert body["usage"]["prompt_tokens"] == 5


def test_cli_serves_and_exits_on_sigterm() -> None:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "SIM_TEST_KEY": "k-123"}
    command = [
        sys.executable, "-m", "irislab.simulator", "--name", "cli-sim", "--port", str(port),
        "--api-key-env", "SIM_TEST_KEY", "--model", MODEL,
    ]  # fmt: skip
    process = subprocess.Popen(
        command, env=env, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(100):
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            time.sleep(0.1)
        response = httpx.post(
            f"{url}/v1/chat/completions",
            json=chat("a b", max_tokens=2),
            headers={"authorization": "Bearer k-123"},
        )
        assert response.status_code == 200
        assert response.headers["x-simulator-name"] == "cli-sim"
        assert response.json()["usage"]["completion_tokens"] == 2
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=10)
        assert process.returncode == 0
        assert b"listening on" in stderr
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


async def wait_stats(http: aiohttp.ClientSession, **expected: int) -> dict[str, Any]:
    """/stats once every `expected` counter has its value, or after about 10 s of polling."""
    for _ in range(200):
        current = await stats(http)
        if all(current[key] == value for key, value in expected.items()):
            break
        await asyncio.sleep(0.05)
    return current


@pytest.mark.asyncio
async def test_max_num_seqs_makes_the_others_wait_before_their_prefill() -> None:
    async with running(ttft_ms=60_000, max_num_seqs=2) as (_, http):
        tasks = [asyncio.create_task(post(http, "/v1/chat/completions", chat(f"p{i} a b"))) for i in range(5)]
        try:
            current = await wait_stats(http, running=2, waiting=3)
            assert (current["in_flight"], current["running"], current["waiting"]) == (5, 2, 3)
            assert current["prompt_tokens"] == 2 * 3  # only the two running reached the prefix cache
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        current = await wait_idle(http)
    assert (current["running"], current["waiting"]) == (0, 0)
    assert (current["max_waiting"], current["queued_requests"]) == (3, 3)
    assert current["requests_by_status"] == {"499": 5}


@pytest.mark.asyncio
async def test_a_waiting_request_runs_when_a_place_frees() -> None:
    long_stream = chat("a", max_tokens=100_000, stream=True)
    async with running(per_token_ms=20, max_num_seqs=1) as (simulator, http):
        async with aiohttp.ClientSession(base_url=simulator.url) as client:
            async with client.post("/v1/chat/completions", json=long_stream) as r:
                await r.content.readline()  # the first one runs, and did not wait
                assert (await stats(http))["max_waiting"] == 0
                second = asyncio.create_task(post(http, "/v1/chat/completions", chat("b", max_tokens=1)))
                assert (await wait_stats(http, waiting=1))["waiting"] == 1
                assert not second.done()
            status, body = await asyncio.wait_for(second, timeout=30)  # its place freed when the first left
        current = await wait_idle(http)
    assert status == 200 and body["usage"]["completion_tokens"] == 1
    assert current["requests_by_status"] == {"499": 1, "200": 1}
    assert (current["max_waiting"], current["queued_requests"], current["waiting"]) == (1, 1, 0)


@pytest.mark.asyncio
async def test_without_max_num_seqs_nothing_waits() -> None:
    async with running(ttft_ms=300) as (_, http):
        results = await asyncio.gather(*(post(http, "/v1/chat/completions", chat("x")) for _ in range(4)))
        current = await stats(http)
    assert [status for status, _ in results] == [200] * 4
    assert (current["max_waiting"], current["queued_requests"]) == (0, 0)


def test_decode_slows_with_the_batch() -> None:
    config = SimulatorConfig(name="sim", per_token_ms=10, decode_ms_per_running_seq=2.5)
    assert [decode_token_ms(config, running) for running in (0, 1, 2, 5)] == [10, 10, 12.5, 20]
    assert decode_token_ms(SimulatorConfig(name="sim", per_token_ms=4), 9) == 4


@pytest.mark.asyncio
async def test_stored_responses_are_served_by_id_through_the_openai_sdk() -> None:
    """retrieve, input_items.list and delete as the openai SDK calls them; a deleted response
    can no longer be chained; an id held elsewhere is a 404 `response_not_found`."""
    import openai

    async with running() as (simulator, _), running() as (other, _):
        client = openai.AsyncOpenAI(base_url=f"{simulator.url}/v1", api_key="unused", max_retries=0)
        elsewhere = openai.AsyncOpenAI(base_url=f"{other.url}/v1", api_key="unused", max_retries=0)
        try:
            created = await client.responses.create(model=MODEL, input=[{"role": "user", "content": "a b"}], max_output_tokens=2)
            found = await client.responses.retrieve(created.id)
            assert (found.id, found.status, found.output_text, found.model) == (created.id, "completed", "tok0 tok1", MODEL)
            items = await client.responses.input_items.list(created.id)
            assert [(item.type, item.role, item.content[0].text) for item in items.data] == [("message", "user", "a b")]
            with pytest.raises(openai.NotFoundError) as missing:
                await elsewhere.responses.retrieve(created.id)
            assert missing.value.code == "response_not_found"
            await client.responses.delete(created.id)
            with pytest.raises(openai.NotFoundError):
                await client.responses.retrieve(created.id)
            with pytest.raises(openai.NotFoundError):
                await client.responses.create(model=MODEL, input="c", previous_response_id=created.id)
        finally:
            await client.close()
            await elsewhere.close()
    lookups = simulator.state.response_lookups
    assert lookups == {"retrieve": 2, "input_items": 1, "delete": 1} and simulator.state.requests == 2


@pytest.mark.asyncio
async def test_a_background_response_is_queued_then_completes_or_is_cancelled() -> None:
    import openai

    async with running(ttft_ms=0, per_token_ms=200) as (simulator, _):
        client = openai.AsyncOpenAI(base_url=f"{simulator.url}/v1", api_key="unused", max_retries=0)
        try:
            quick = await client.responses.create(model=MODEL, input="a", max_output_tokens=1, background=True)
            assert quick.status == "queued" and quick.background
            for _ in range(100):
                if (done := await client.responses.retrieve(quick.id)).status == "completed":
                    break
                await asyncio.sleep(0.05)
            assert done.status == "completed" and done.output_text == "tok0"
            slow = await client.responses.create(model=MODEL, input="a", max_output_tokens=50, background=True)
            cancelled = await client.responses.cancel(slow.id)
            assert cancelled.status == "cancelled" and (await client.responses.retrieve(slow.id)).status == "cancelled"
            with pytest.raises(openai.BadRequestError):  # a synchronous response cannot be cancelled
                await client.responses.cancel((await client.responses.create(model=MODEL, input="b")).id)
        finally:
            await client.close()


@pytest.mark.asyncio
async def test_engine_endpoints_tokenize_detokenize_rerank_and_score() -> None:
    async with running() as (_, http):
        status, tokens = await post(http, "/tokenize", {"model": MODEL, "prompt": "the cat saw the dog"})
        assert status == 200 and tokens["tokens"] == [0, 1, 2, 0, 3] and tokens["count"] == 5
        status, text = await post(http, "/detokenize", {"model": MODEL, "tokens": [3, 1]})
        assert (status, text) == (200, {"prompt": "dog cat"})
        status, ranked = await post(http, "/v1/rerank", {"model": MODEL, "query": "red fox", "documents": ["blue", "red fox", "red"]})
        assert status == 200 and ranked["model"] == MODEL
        assert [(r["index"], r["relevance_score"]) for r in ranked["results"]] == [(1, 1.0), (2, 0.5), (0, 0.0)]
        status, scored = await post(http, "/v1/score", {"model": MODEL, "text_1": "a b", "text_2": ["a", "c"]})
        assert status == 200 and [d["score"] for d in scored["data"]] == [0.5, 0.0]
        status, error = await post(http, "/detokenize", {"model": MODEL, "tokens": [99]})
        assert status == 400 and error["error"]["type"] == "invalid_request_error"
        assert (await stats(http))["requests"] == 5


async def test_gzip_compresses_answers_only_when_the_request_accepts_it() -> None:
    """`gzip`: a public API's habit, JSON and streams alike; a request asking for identity gets plain bytes."""
    async with running(gzip=True) as (simulator, _):
        async with httpx.AsyncClient(base_url=simulator.url, timeout=10) as http:
            for stream in (False, True):
                zipped = await http.post("/v1/chat/completions", json=chat("hi", stream=stream), headers={"accept-encoding": "gzip"})
                assert (zipped.status_code, zipped.headers.get("content-encoding")) == (200, "gzip")
                assert "tok0" in zipped.text  # httpx decompressed it
                plain = await http.post("/v1/chat/completions", json=chat("hi", stream=stream), headers={"accept-encoding": "identity"})
                assert (plain.status_code, plain.headers.get("content-encoding")) == (200, None) and "tok0" in plain.text
            health = await http.get("/stats", headers={"accept-encoding": "gzip"})
            assert health.headers.get("content-encoding") is None  # control endpoints stay plain
