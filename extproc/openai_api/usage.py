"""The token usage an OpenAI-compatible answer reports, read from its body (docs/operations.md
"Third-party spend").

Every OpenAI-compatible server (OpenAI, vLLM, SGLang, llama.cpp) reports what a request cost in a
`usage` object: `prompt_tokens` and `completion_tokens` for chat and text completions and
embeddings (no completion tokens there), `input_tokens` and `output_tokens` for the Responses API.
A JSON answer carries it near its end; a stream carries it in its last chunk when the client asked
with `stream_options.include_usage` (a chunk with empty `choices`; the earlier chunks say
`"usage": null`), vLLM in every chunk with `continuous_usage_stats` (cumulative), and a Responses
stream in its last event (`response.completed`, under `response`).

So only the last TAIL_BYTES of a body are kept, whatever its size or its chunking, and the usage
is the last `"usage": {...}` object in them: outside a JSON string a key is never escaped, and
inside one every quote is, so the text `"usage":{` only occurs as a key. The object is found by
matching its braces and decoded with orjson once, when the body ends.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import orjson

TAIL_BYTES = 16 * 1024  # more than what follows `usage` in any answer: a Responses object's metadata is at most ~9 KiB
MAX_TOKENS = 1 << 40  # larger counts are not believed
_USAGE_KEY = re.compile(rb'"usage"\s*:\s*\{')


@dataclass(frozen=True, slots=True)
class Usage:
    """Tokens of one answer: `input_tokens` (the prompt) and `output_tokens` (generated)."""

    input_tokens: int
    output_tokens: int


class UsageReader:
    """Fed an answer body chunk by chunk (JSON or server-sent events, any chunking), tells its
    usage once the body ends. Holds at most 2 x TAIL_BYTES."""

    __slots__ = ("tail", "done", "usage")

    def __init__(self) -> None:
        self.tail = bytearray()
        self.done = False
        self.usage: Usage | None = None

    def feed(self, chunk: bytes, end_of_stream: bool) -> bool:
        """Add a chunk. Returns True once the body has ended (then `usage` holds what it
        reported, None when it reported nothing readable); later chunks are ignored."""
        if self.done:
            return True
        self.tail += chunk
        if len(self.tail) > 2 * TAIL_BYTES:
            del self.tail[:-TAIL_BYTES]
        if not end_of_stream:
            return False
        self.done = True
        self.usage = find_usage(bytes(self.tail))
        self.tail = bytearray()
        return True


def find_usage(body: bytes) -> Usage | None:
    """The last usage object in `body` (a whole answer or its end), or None."""
    match = None
    for match in _USAGE_KEY.finditer(body):
        pass
    if match is None:
        return None
    end = _object_end(body, match.end() - 1)
    if end is None:
        return None
    try:
        usage = orjson.loads(body[match.end() - 1:end])
    except orjson.JSONDecodeError:
        return None
    return _tokens(usage)


def _object_end(body: bytes, start: int) -> int | None:
    """The index after the `}` closing the object that opens at `body[start]`, or None."""
    depth, in_string, escaped = 0, False, False
    for index in range(start, len(body)):
        char = body[index]
        if in_string:
            if escaped:
                escaped = False
            elif char == 0x5C:  # backslash
                escaped = True
            elif char == 0x22:  # quote
                in_string = False
        elif char == 0x22:
            in_string = True
        elif char == 0x7B:  # {
            depth += 1
        elif char == 0x7D:  # }
            depth -= 1
            if depth == 0:
                return index + 1
    return None


def _tokens(usage: object) -> Usage | None:
    if not isinstance(usage, dict):
        return None
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
    completion = usage.get("completion_tokens", usage.get("output_tokens", 0))
    if not (_count(prompt) and _count(completion)):
        return None
    return Usage(prompt, completion)


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < MAX_TOKENS
