"""The token usage of OpenAI-compatible answers (extproc.openai_api.usage): JSON bodies and streams
as OpenAI, vLLM, llama.cpp and the Responses API write them, under any chunking."""

from __future__ import annotations

import orjson
import pytest

from extproc.openai_api.usage import TAIL_BYTES, Usage, UsageReader, find_usage


def sse(*events: dict) -> bytes:
    return b"".join(b"data: " + orjson.dumps(event) + b"\n\n" for event in events) + b"data: [DONE]\n\n"


def read(body: bytes, chunk: int) -> Usage | None:
    reader = UsageReader()
    pieces = [body[i:i + chunk] for i in range(0, len(body), chunk)] or [b""]
    for piece in pieces[:-1]:
        assert reader.feed(piece, False) is False
        assert len(reader.tail) <= 2 * TAIL_BYTES
    assert reader.feed(pieces[-1], True) is True
    assert reader.feed(b"more", True) is True  # after the end: ignored
    return reader.usage


CHAT_JSON = orjson.dumps({
    "id": "chatcmpl-1", "object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
    "usage": {"prompt_tokens": 31, "completion_tokens": 7, "total_tokens": 38, "prompt_tokens_details": {"cached_tokens": 16}},
    "system_fingerprint": None,
})
# llama.cpp's order: usage, then id and timings.
LLAMA_JSON = orjson.dumps({
    "choices": [], "created": 1, "model": "m", "object": "chat.completion",
    "usage": {"completion_tokens": 5, "prompt_tokens": 12, "total_tokens": 17}, "id": "x",
    "timings": {"prompt_n": 12, "cache_n": 0, "predicted_n": 5},
})
EMBEDDINGS_JSON = orjson.dumps({
    "object": "list", "data": [{"embedding": [0.1] * 64}], "model": "m", "usage": {"prompt_tokens": 9, "total_tokens": 9},
})
# OpenAI with stream_options.include_usage: "usage": null in every chunk, the usage in the last one.
CHAT_STREAM = sse(
    *({"id": "c", "choices": [{"index": 0, "delta": {"content": f" tok{i}"}}], "usage": None} for i in range(40)),
    {"id": "c", "choices": [], "usage": {"prompt_tokens": 100, "completion_tokens": 40, "total_tokens": 140}},
)
# vLLM with continuous_usage_stats: a cumulative usage in every chunk.
VLLM_STREAM = sse(*({"choices": [{"delta": {"content": "x"}}], "usage": {"prompt_tokens": 8, "completion_tokens": i + 1}} for i in range(30)))
# The Responses API: the usage is the completed response's; a tool's schema may name a "usage" property before it.
RESPONSES_STREAM = sse(
    {"type": "response.created", "sequence_number": 0, "response": {"id": "resp_1", "status": "in_progress", "usage": None}},
    {"type": "response.output_text.delta", "sequence_number": 1, "delta": "hello"},
    {"type": "response.completed", "sequence_number": 2, "response": {
        "id": "resp_1", "status": "completed", "output": [{"type": "message", "content": [{"type": "output_text", "text": "hello"}]}],
        "tools": [{"type": "function", "name": "f", "parameters": {"properties": {"usage": {"type": "string"}}}}],
        "usage": {"input_tokens": 21, "output_tokens": 3, "total_tokens": 24}, "user": None, "metadata": {"k": "v" * 500},
    }},
)


@pytest.mark.parametrize("chunk", [1, 7, 512, 1 << 20])
@pytest.mark.parametrize(("body", "expected"), [
    (CHAT_JSON, Usage(31, 7)),
    (LLAMA_JSON, Usage(12, 5)),
    (EMBEDDINGS_JSON, Usage(9, 0)),
    (CHAT_STREAM, Usage(100, 40)),
    (VLLM_STREAM, Usage(8, 30)),
    (RESPONSES_STREAM, Usage(21, 3)),
], ids=["chat-json", "llama.cpp-json", "embeddings-json", "chat-stream", "vllm-continuous-stream", "responses-stream"])
def test_the_usage_reported_is_found_whatever_the_chunking(body, expected, chunk):
    assert read(body, chunk) == expected


def test_a_stream_without_usage_reports_none():
    stream = sse(*({"choices": [{"delta": {"content": "x"}}]} for _ in range(5)))
    assert read(stream, 3) is None
    assert read(sse({"choices": [], "usage": None}), 3) is None


def test_usage_text_inside_a_string_is_not_usage():
    # What a model wrote is a JSON string: its quotes are escaped, so it never reads as the key.
    body = orjson.dumps({"choices": [{"message": {"content": 'the "usage": {"prompt_tokens": 999, "completion_tokens": 1}'}}]})
    assert find_usage(body) is None


def test_a_long_answer_keeps_only_its_tail():
    body = orjson.dumps({"choices": [{"message": {"content": "w " * 1_000_000}}], "usage": {"prompt_tokens": 3, "completion_tokens": 2}})
    assert read(body, 16 * 1024) == Usage(3, 2)


@pytest.mark.parametrize("usage", [
    {"prompt_tokens": -1, "completion_tokens": 2}, {"prompt_tokens": True, "completion_tokens": 2},
    {"prompt_tokens": "3", "completion_tokens": 2}, {"prompt_tokens": 3, "completion_tokens": None}, {"total_tokens": 5},
    {"prompt_tokens": 1 << 41, "completion_tokens": 1},
])
def test_counts_that_are_not_counts_are_not_believed(usage):
    assert find_usage(orjson.dumps({"usage": usage})) is None


def test_an_unfinished_usage_object_is_none():
    assert find_usage(b'{"choices": [], "usage": {"prompt_tokens": 3, "completion_') is None
