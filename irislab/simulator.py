"""A simulated OpenAI-compatible provider (an "inference deployment") built on aiohttp.web.

Integration tests, the demo (``iris-lab up``) and the trace-replay benchmarks put it behind
the gateway. It serves ``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings`` and
``/v1/responses`` with a deterministic answer, a configurable latency and a prefix cache, and it
counts what it sees: its ``in_flight`` / ``max_in_flight`` counters are the outside check of the
gateway's capacity limits, so a request counts from the moment its handler starts until the
handler ends for any reason (answer sent, client gone, connection dropped).

Model of the work:

* A token is a whitespace-separated word of the prompt text (``text.split()``).
* The prompt's words are cut into blocks of ``block_tokens``; block *i*'s key is a blake2b hash
  chained over block *i - 1*'s key and block *i*'s words, so two prompts share block *i* exactly
  when they share the whole prefix up to the end of block *i*. Only full blocks are cached, in an
  LRU of ``cache_blocks`` keys. ``cached_tokens`` is the number of leading blocks found, times
  ``block_tokens``.
* ``/v1/responses`` keeps stored responses in process memory, as vLLM and SGLang do: a turn
  with a ``previous_response_id`` this deployment did not produce (or did not store: ``store:
  false``) gets a 404 ``previous_response_not_found``, so a gateway that sends a chained turn to
  the wrong provider fails visibly. A chained turn's prompt is the stored transcript (prompts and
  answers so far) followed by its new input; a ``conversation`` id keeps a transcript the same
  way, made on first use. A stored response is served by id as OpenAI's API does (``GET`` and
  ``DELETE /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``, ``POST
  /v1/responses/{id}/cancel``), and ``background: true`` answers at once with status
  ``queued`` and generates afterwards (poll it by id); an id this deployment does not hold gets
  a 404 ``response_not_found``.
* vLLM's endpoints beyond OpenAI's: ``POST /tokenize`` and ``/detokenize`` (a word is a token;
  ids are given in order of first sight, so they round-trip), ``/v1/rerank`` and ``/v1/score``
  (a document's score is the share of the query's words it holds).
* The answer has ``max_tokens`` words ``tok0 tok1 ...``, ready after ``ttft_ms + prefill +
  n * per_token_ms`` milliseconds, where ``prefill = uncached prompt tokens * prefill_ms_per_token``
  (0 by default: prefix-cache hits then cost nothing extra); a streamed answer sends its first
  chunk after ``ttft_ms + prefill`` and one chunk per token every ``per_token_ms`` after that.
* Capacity (off by default), as vLLM's scheduler has it: at most ``max_num_seqs`` generations run
  at once (vLLM's ``--max-num-seqs``); the others wait in arrival order, before their prefill,
  and count as ``waiting``. Every token of a generation takes ``per_token_ms +
  decode_ms_per_running_seq * (running - 1)``, ``running`` being the generations running when
  the token starts (a batch decodes more slowly the larger it is), so overload shows as time to
  first token (the wait) and as latency (the slower decode).

Control and observation endpoints: ``GET /stats``, ``POST /stats/reset``, ``POST /control/fail``,
``POST /control/clear``, ``GET /health``, ``POST /control/health``, ``GET /metrics`` and
``POST /control/load`` (see `build_app`). With ``--tls-cert``/``--tls-key`` it serves HTTPS.

Run it with ``python -m irislab.simulator --name iris-1 --port 8001`` (see `main`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import hashlib
import hmac
import logging
import os
import signal
import socket
import ssl
import struct
import sys
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

_log = logging.getLogger("irislab.simulator")

RECENT_REQUESTS = 50
EMBEDDING_DIM = 8  # the vectors' length unless a request asks for `dimensions`
MAX_EMBEDDING_DIM = 4096
_MAX_BODY_BYTES = 64 * 1024 * 1024
_SHUTDOWN_TIMEOUT_S = 2.0
_LISTEN_BACKLOG = 1024

# requests_by_status keys of requests that got no complete answer.
OUTCOME_CLIENT_GONE = "499"  # the client went away (or timed out) before the answer was complete
OUTCOME_RESET = "reset"  # the connection was dropped on purpose by failure injection


@dataclass
class SimulatorConfig:
    """How one simulated deployment behaves.

    name: reported in the ``x-simulator-name`` response header and in ``/stats``.
    ttft_ms: time to first token, in milliseconds.
    per_token_ms: time per generated token after the first, in milliseconds.
    prefill_ms_per_token: extra time to first token per prompt token not found in the prefix
        cache, in milliseconds (0: the cache does not change latency).
    block_tokens: tokens (words) per prefix-cache block.
    cache_blocks: prefix-cache capacity in blocks (LRU); 0 disables the cache.
    required_api_key: when set, requests must carry ``authorization: Bearer <key>`` or
        ``api-key: <key>``, else they get a 401 OpenAI-style error.
    served_model_names: when set, a request for another model gets a 404 ``model_not_found``.
    default_max_tokens: completion tokens when the request names no limit.
    max_num_seqs: generations served at once, like vLLM's ``--max-num-seqs``; the others wait
        (first come, first served). 0: no limit, nothing ever waits.
    decode_ms_per_running_seq: extra time per generated token for every other generation
        running at once, in milliseconds (0: the batch size does not change the decode time).
    gzip: answer with a gzip (or deflate) body when the request's ``accept-encoding`` allows it,
        JSON and streams alike, as public APIs do (the openai SDK accepts ``gzip, deflate``).
    """

    name: str
    ttft_ms: float = 0
    per_token_ms: float = 0
    prefill_ms_per_token: float = 0
    block_tokens: int = 512
    cache_blocks: int = 4096
    required_api_key: str | None = None
    served_model_names: list[str] | None = None
    default_max_tokens: int = 16
    max_num_seqs: int = 0
    decode_ms_per_running_seq: float = 0
    gzip: bool = False


@dataclass
class _Exchange:
    """One inference request as the counters see it: its model (once known) and its outcome."""

    model: str | None = None
    outcome: str = "500"


@dataclass
class SimulatorState:
    """The simulator's counters; `snapshot` is what ``GET /stats`` answers.

    in_flight / max_in_flight: inference requests whose handler is running, and the most ever
        seen at once (since start or the last reset).
    in_flight_by_model / max_in_flight_by_model: the same per requested ``model`` value.
    requests: inference requests finished; requests_by_status: the same by outcome, an HTTP
        status as a string, ``"499"`` when the client went away first, ``"reset"`` when failure
        injection dropped the connection.
    prompt_tokens / cached_tokens / completion_tokens: token totals (cached tokens are part of
        the prompt tokens; completion tokens count what was actually sent).
    last_request_headers: headers (lowercase name -> value) of the last 50 inference requests and
        lookups of a stored response by id.
    last_request_models: the ``model`` values of the last 50 inference requests, as received.
    last_request_fields: the top-level field names of the JSON bodies of the last 50 inference
        requests, as received (names only: what a body carried, never its content).
    health_checks / health_checks_failed: ``GET /health`` requests, and those answered 503;
    health_checks_failed_by_client: the same per ``client`` query parameter (``/health?client=x``).
    response_lookups: requests for a stored response by id, by action (``retrieve``, ``delete``,
        ``input_items``, ``cancel``), found or not; not counted in `requests`.
    running / waiting: generations running now, and those waiting for one of the
        ``max_num_seqs`` places (always 0 without that limit); max_waiting: the most ever seen
        waiting at once; queued_requests: generations that had to wait at all.
    """

    in_flight: int = 0
    max_in_flight: int = 0
    in_flight_by_model: dict[str, int] = field(default_factory=dict)
    max_in_flight_by_model: dict[str, int] = field(default_factory=dict)
    requests: int = 0
    requests_by_status: dict[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    last_request_headers: deque[dict[str, str]] = field(
        default_factory=lambda: deque(maxlen=RECENT_REQUESTS)
    )
    last_request_models: deque[Any] = field(default_factory=lambda: deque(maxlen=RECENT_REQUESTS))
    last_request_fields: deque[list[str]] = field(default_factory=lambda: deque(maxlen=RECENT_REQUESTS))
    health_checks: int = 0
    health_checks_failed: int = 0
    health_checks_failed_by_client: dict[str, int] = field(default_factory=dict)
    responses_stored: int = 0
    response_lookups: dict[str, int] = field(default_factory=dict)
    running: int = 0
    waiting: int = 0
    max_waiting: int = 0
    queued_requests: int = 0

    def request_started(self, headers: Iterable[tuple[str, str]]) -> _Exchange:
        """Count a request whose handler starts, remembering its headers."""
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.last_request_headers.append({name.lower(): value for name, value in headers})
        return _Exchange()

    def model_started(self, exchange: _Exchange, model: str) -> None:
        """Count the request in flight for `model` too."""
        exchange.model = model
        count = self.in_flight_by_model.get(model, 0) + 1
        self.in_flight_by_model[model] = count
        self.max_in_flight_by_model[model] = max(self.max_in_flight_by_model.get(model, 0), count)

    def request_finished(self, exchange: _Exchange) -> None:
        """Uncount a request whose handler ends, and record its outcome."""
        self.in_flight -= 1
        if exchange.model is not None:
            self.in_flight_by_model[exchange.model] -= 1
        self.requests += 1
        self.requests_by_status[exchange.outcome] = (
            self.requests_by_status.get(exchange.outcome, 0) + 1
        )

    def reset(self) -> None:
        """Restart the maxima from the current in-flight counts and clear the totals."""
        self.max_in_flight = self.in_flight
        self.max_in_flight_by_model = dict(self.in_flight_by_model)
        self.max_waiting = self.waiting
        self.queued_requests = 0
        self.requests = self.prompt_tokens = self.cached_tokens = self.completion_tokens = 0
        self.health_checks = self.health_checks_failed = 0
        self.health_checks_failed_by_client.clear()
        self.response_lookups.clear()
        self.requests_by_status.clear()
        self.last_request_headers.clear()
        self.last_request_models.clear()
        self.last_request_fields.clear()

    def snapshot(self) -> dict[str, Any]:
        """All counters as a JSON-ready dict."""
        return {
            "in_flight": self.in_flight,
            "max_in_flight": self.max_in_flight,
            "in_flight_by_model": dict(self.in_flight_by_model),
            "max_in_flight_by_model": dict(self.max_in_flight_by_model),
            "requests": self.requests,
            "requests_by_status": dict(self.requests_by_status),
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "last_request_headers": list(self.last_request_headers),
            "last_request_models": list(self.last_request_models),
            "last_request_fields": list(self.last_request_fields),
            "health_checks": self.health_checks,
            "health_checks_failed": self.health_checks_failed,
            "health_checks_failed_by_client": dict(self.health_checks_failed_by_client),
            "responses_stored": self.responses_stored,
            "response_lookups": dict(self.response_lookups),
            "running": self.running,
            "waiting": self.waiting,
            "max_waiting": self.max_waiting,
            "queued_requests": self.queued_requests,
        }


STATE_KEY = web.AppKey("simulator_state", SimulatorState)


class PrefixCache:
    """An LRU of prompt blocks keyed by chained hashes (see the module docstring).

    block_tokens: words per block; capacity: blocks held, 0 = no cache.
    """

    def __init__(self, block_tokens: int, capacity: int):
        if block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")
        self._block_tokens = block_tokens
        self._capacity = capacity
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def lookup_and_insert(self, words: list[str]) -> int:
        """Return the prompt's cached tokens, then insert/refresh all its full blocks."""
        if self._capacity <= 0:
            return 0
        keys = self._block_keys(words)
        hits = 0
        while hits < len(keys) and keys[hits] in self._blocks:
            hits += 1
        for key in keys:
            self._blocks[key] = None
            self._blocks.move_to_end(key)
        while len(self._blocks) > self._capacity:
            self._blocks.popitem(last=False)
        return hits * self._block_tokens

    def _block_keys(self, words: list[str]) -> list[bytes]:
        size = self._block_tokens
        keys: list[bytes] = []
        previous = b""
        for start in range(0, len(words) - size + 1, size):
            block = " ".join(words[start : start + size]).encode()
            previous = hashlib.blake2b(previous + b"\0" + block, digest_size=16).digest()
            keys.append(previous)
        return keys


class _Batch:
    """The generations running at once: at most `max_seqs` (0: any number), the others wait
    first come, first served. Counts into `state` (running, waiting, max_waiting,
    queued_requests)."""

    def __init__(self, max_seqs: int, state: SimulatorState):
        self._slots = asyncio.Semaphore(max_seqs) if max_seqs > 0 else None
        self._state = state

    @contextlib.asynccontextmanager
    async def seat(self) -> AsyncIterator[None]:
        """Hold a place in the batch for the body of the ``async with``, waiting for one first
        when all are taken (a cancelled wait leaves the queue)."""
        state = self._state
        if self._slots is not None and self._slots.locked():  # every place taken: wait in line
            state.queued_requests += 1
            state.waiting += 1
            state.max_waiting = max(state.max_waiting, state.waiting)
            try:
                await self._slots.acquire()
            finally:
                state.waiting -= 1
        elif self._slots is not None:
            await self._slots.acquire()  # a place is free: taken at once, without yielding
        state.running += 1
        try:
            yield
        finally:
            state.running -= 1
            if self._slots is not None:
                self._slots.release()


@dataclass(frozen=True)
class _Fault:
    """An injected failure: ``mode`` "status" answers `status`; "reset" drops the connection."""

    mode: str
    status: int


class _FaultInjector:
    """Hands the armed fault to the next `count` requests (-1: until cleared)."""

    def __init__(self) -> None:
        self._fault: _Fault | None = None
        self._remaining = 0

    def arm(self, fault: _Fault, count: int) -> None:
        self._fault, self._remaining = fault, count

    def clear(self) -> None:
        self._fault, self._remaining = None, 0

    def take(self) -> _Fault | None:
        fault = self._fault
        if fault is not None and self._remaining > 0:
            self._remaining -= 1
            if self._remaining == 0:
                self.clear()
        return fault


class _ApiError(Exception):
    """An OpenAI-style error answer."""

    def __init__(self, status: int, message: str, type_: str, code: str):
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type_, code

    def response(self) -> web.Response:
        body = {"error": {"message": self.message, "type": self.type, "code": self.code}}
        return _json_response(body, status=self.status)


def _invalid(message: str) -> _ApiError:
    return _ApiError(400, message, "invalid_request_error", "invalid_request")


def _json_response(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


async def _read_json(request: web.Request) -> Any:
    try:
        return orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise _invalid(f"request body is not valid JSON: {exc}") from None
    except web.HTTPRequestEntityTooLarge:
        raise _ApiError(
            413, "request body too large", "invalid_request_error", "request_too_large"
        ) from None


async def _read_json_object(request: web.Request) -> dict[str, Any]:
    body = await _read_json(request)
    if not isinstance(body, dict):
        raise _invalid("request body must be a JSON object")
    return body


# ---------------------------------------------------------------------------------------------
# Prompts and answers
# ---------------------------------------------------------------------------------------------


def _content_text(content: Any) -> str:
    """A message's text: a string, or the ``text`` of its parts (images and the like ignored)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def _messages_text(messages: Any, field_name: str) -> str:
    if not isinstance(messages, list):
        raise _invalid(f"'{field_name}' must be a list of messages")
    return "\n".join(
        _content_text(message.get("content")) for message in messages if isinstance(message, dict)
    )


def _strings(value: Any, field_name: str) -> list[str]:
    """A string or a non-empty list of strings, as a list."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(item, str) for item in value):
        return value
    raise _invalid(f"'{field_name}' must be a string or a non-empty list of strings")


def _max_tokens(body: dict[str, Any], fields: tuple[str, ...], default: int) -> int:
    for name in fields:
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise _invalid(f"'{name}' must be an integer >= 1")
        return value
    return default


@dataclass(frozen=True)
class _Generation:
    """One generated answer: `completion_tokens` words ``tok0 tok1 ...``."""

    id: str
    created: int
    model: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    include_usage: bool

    def text(self) -> str:
        return " ".join(f"tok{i}" for i in range(self.completion_tokens))

    def delta(self, i: int) -> str:
        """Token `i` as streamed: the deltas concatenate to `text`."""
        return f"tok{i}" if i == 0 else f" tok{i}"

    def finish_reason(self, i: int) -> str | None:
        return "length" if i == self.completion_tokens - 1 else None

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


def _sse(data: Any, event: str | None = None) -> bytes:
    head = b"" if event is None else b"event: " + event.encode() + b"\n"
    return head + b"data: " + orjson.dumps(data) + b"\n\n"


_SSE_DONE = b"data: [DONE]\n\n"


class _ChatApi:
    """``POST /v1/chat/completions``."""

    id_prefix = "chatcmpl-"
    max_token_fields = ("max_completion_tokens", "max_tokens")

    def prompt(self, body: dict[str, Any]) -> str:
        return _messages_text(body.get("messages"), "messages")

    def answer(self, gen: _Generation) -> dict[str, Any]:
        message = {"role": "assistant", "content": gen.text()}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": "length"}
        return self._envelope(gen, "chat.completion", [choice], usage=gen.usage())

    def stream_start(self, gen: _Generation) -> bytes:
        return b""

    def stream_token(self, gen: _Generation, i: int) -> bytes:
        delta = {"content": gen.delta(i)}
        if i == 0:
            delta = {"role": "assistant", **delta}
        choice = {
            "index": 0,
            "delta": delta,
            "logprobs": None,
            "finish_reason": gen.finish_reason(i),
        }
        return _sse(self._envelope(gen, "chat.completion.chunk", [choice]))

    def stream_end(self, gen: _Generation) -> bytes:
        if not gen.include_usage:
            return _SSE_DONE
        usage = self._envelope(gen, "chat.completion.chunk", [], usage=gen.usage())
        return _sse(usage) + _SSE_DONE

    @staticmethod
    def _envelope(gen: _Generation, object_: str, choices: list[Any], **extra: Any) -> dict:
        return {
            "id": gen.id,
            "object": object_,
            "created": gen.created,
            "model": gen.model,
            "choices": choices,
            **extra,
        }


class _CompletionsApi:
    """``POST /v1/completions``; a list of prompts is served as one prompt, one choice."""

    id_prefix = "cmpl-"
    max_token_fields = ("max_tokens",)

    def prompt(self, body: dict[str, Any]) -> str:
        return "\n".join(_strings(body.get("prompt"), "prompt"))

    def answer(self, gen: _Generation) -> dict[str, Any]:
        choice = {"text": gen.text(), "index": 0, "logprobs": None, "finish_reason": "length"}
        return self._envelope(gen, [choice], usage=gen.usage())

    def stream_start(self, gen: _Generation) -> bytes:
        return b""

    def stream_token(self, gen: _Generation, i: int) -> bytes:
        choice = {
            "text": gen.delta(i),
            "index": 0,
            "logprobs": None,
            "finish_reason": gen.finish_reason(i),
        }
        return _sse(self._envelope(gen, [choice]))

    def stream_end(self, gen: _Generation) -> bytes:
        if not gen.include_usage:
            return _SSE_DONE
        return _sse(self._envelope(gen, [], usage=gen.usage())) + _SSE_DONE

    @staticmethod
    def _envelope(gen: _Generation, choices: list[Any], **extra: Any) -> dict:
        return {
            "id": gen.id,
            "object": "text_completion",
            "created": gen.created,
            "model": gen.model,
            "choices": choices,
            **extra,
        }


@dataclass
class StoredResponse:
    """A stored response as ``GET /v1/responses/{id}`` serves it: its generation, its input items
    (as ``input_items`` lists them), its status (``queued``, ``in_progress``, ``completed``,
    ``cancelled``) and, for a background response, the task generating it."""

    gen: _Generation
    input_items: list[dict[str, Any]]
    status: str = "completed"
    background: bool = False
    task: asyncio.Task | None = None


class ResponseStore:
    """The Responses-API state of one deployment: the transcript (prompt and answer text) and the
    `StoredResponse` of each stored response, and the transcript of each conversation, the oldest
    dropped beyond `capacity` entries."""

    def __init__(self, capacity: int = 100_000):
        self.capacity = capacity
        self.responses: OrderedDict[str, str] = OrderedDict()
        self.stored: OrderedDict[str, StoredResponse] = OrderedDict()
        self.conversations: OrderedDict[str, str] = OrderedDict()

    def get(self, response_id: str) -> StoredResponse:
        """The stored response `response_id`. Raises _ApiError (404 response_not_found)."""
        entry = self.stored.get(response_id)
        if entry is None:
            raise _ApiError(404, f"Response with id '{response_id[:100]}' not found.", "invalid_request_error", "response_not_found")
        return entry

    def forget(self, response_id: str) -> None:
        """Delete the stored response `response_id`: it can no longer be chained or read."""
        self.stored.pop(response_id, None)
        self.responses.pop(response_id, None)

    def context(self, body: dict[str, Any]) -> str:
        """The transcript a request continues ("" for none). Raises _ApiError (404) for a
        previous response this deployment does not hold."""
        previous = body.get("previous_response_id")
        if previous is not None:
            if not isinstance(previous, str) or previous not in self.responses:
                raise _ApiError(
                    404, f"Previous response with id '{str(previous)[:100]}' not found.",
                    "invalid_request_error", "previous_response_not_found",
                )
            return self.responses[previous]
        conversation = _conversation_id(body)
        return self.conversations.get(conversation, "") if conversation else ""

    def keep(self, body: dict[str, Any], response_id: str, transcript: str, entry: StoredResponse) -> bool:
        """Store the response (`transcript` and `entry`) unless `store` is false, and the
        conversation's transcript. Returns whether the response was stored."""
        conversation = _conversation_id(body)
        if conversation:
            self._put(self.conversations, conversation, transcript)
        if body.get("store") is False:
            return False
        self._put(self.responses, response_id, transcript)
        self._put(self.stored, response_id, entry)
        return True

    def _put(self, entries: OrderedDict[str, Any], key: str, value: Any) -> None:
        entries[key] = value
        entries.move_to_end(key)
        while len(entries) > self.capacity:
            entries.popitem(last=False)


def _input_items(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The request's `input` as the input items OpenAI lists: messages with an id and their
    content as `input_text` parts (other items as they were sent, with an id)."""
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    listed = []
    for item in items if isinstance(items, list) else []:
        if not isinstance(item, dict):
            continue
        content = item.get("content")
        if isinstance(content, str):
            content = [{"type": "input_text", "text": content}]
        listed.append({"type": "message", "status": "completed", **item, "id": "msg_" + uuid.uuid4().hex, "content": content})
    return listed


def _conversation_id(body: dict[str, Any]) -> str | None:
    value = body.get("conversation")
    if isinstance(value, dict):
        value = value.get("id")
    return value if isinstance(value, str) and value else None


class _ResponsesApi:
    """``POST /v1/responses``: a minimal Responses-API answer, with its own usage shape and
    (when streamed) OpenAI's event sequence: ``response.created``, ``response.in_progress``,
    ``response.output_item.added``, ``response.content_part.added``, one
    ``response.output_text.delta`` per token, ``response.output_text.done``,
    ``response.content_part.done``, ``response.output_item.done``, ``response.completed``."""

    id_prefix = "resp_"
    max_token_fields = ("max_output_tokens",)

    def prompt(self, body: dict[str, Any]) -> str:
        items = body.get("input")
        return items if isinstance(items, str) else _messages_text(items, "input")

    def answer(self, gen: _Generation) -> dict[str, Any]:
        content = {"type": "output_text", "text": gen.text(), "annotations": []}
        return self._response(gen, "completed", [self._message(gen, "completed", [content])], self._usage(gen))

    def _message(self, gen: _Generation, status: str, content: list[Any]) -> dict[str, Any]:
        return {"type": "message", "id": self._message_id(gen), "status": status, "role": "assistant", "content": content}

    # The event sequence of OpenAI's streamed Responses (the openai SDK's `responses.stream`
    # needs every item and content part announced before its deltas): 4 events before the
    # deltas, one per token, 4 after them; `sequence_number` counts them from 0.
    _events_before_deltas = 4

    def stream_start(self, gen: _Generation) -> bytes:
        in_progress = self._response(gen, "in_progress", [], None)
        item = self._message(gen, "in_progress", [])
        part = {"type": "output_text", "text": "", "annotations": []}
        return b"".join((
            self._event("response.created", 0, response=in_progress),
            self._event("response.in_progress", 1, response=in_progress),
            self._event("response.output_item.added", 2, output_index=0, item=item),
            self._event("response.content_part.added", 3, item_id=item["id"], output_index=0, content_index=0, part=part),
        ))

    def stream_token(self, gen: _Generation, i: int) -> bytes:
        return self._event(
            "response.output_text.delta", self._events_before_deltas + i,
            item_id=self._message_id(gen), output_index=0, content_index=0, delta=gen.delta(i), logprobs=[],
        )

    def stream_end(self, gen: _Generation) -> bytes:
        seq = self._events_before_deltas + gen.completion_tokens
        completed = self.answer(gen)
        item = completed["output"][0]
        part = item["content"][0]
        return b"".join((
            self._event("response.output_text.done", seq, item_id=item["id"], output_index=0, content_index=0, text=part["text"], logprobs=[]),
            self._event("response.content_part.done", seq + 1, item_id=item["id"], output_index=0, content_index=0, part=part),
            self._event("response.output_item.done", seq + 2, output_index=0, item=item),
            self._event("response.completed", seq + 3, response=completed),
        ))

    @staticmethod
    def _event(event_type: str, sequence_number: int, **fields: Any) -> bytes:
        return _sse({"type": event_type, "sequence_number": sequence_number, **fields}, event_type)

    @staticmethod
    def _message_id(gen: _Generation) -> str:
        return "msg_" + gen.id.removeprefix("resp_")

    @staticmethod
    def _usage(gen: _Generation) -> dict[str, Any]:
        return {
            "input_tokens": gen.prompt_tokens,
            "input_tokens_details": {"cached_tokens": gen.cached_tokens},
            "output_tokens": gen.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": gen.prompt_tokens + gen.completion_tokens,
        }

    def stored(self, entry: StoredResponse) -> dict[str, Any]:
        """A stored response as ``GET /v1/responses/{id}`` answers it: whole once completed."""
        answer = self.answer(entry.gen) if entry.status == "completed" else self._response(entry.gen, entry.status, [], None)
        return {**answer, "background": entry.background}

    @staticmethod
    def _response(gen: _Generation, status: str, output: list[Any], usage: Any) -> dict:
        return {
            "id": gen.id,
            "object": "response",
            "created_at": gen.created,
            "status": status,
            "model": gen.model,
            "output": output,
            "usage": usage,
        }


_GenerationApi = _ChatApi | _CompletionsApi | _ResponsesApi


def _embedding(text: str, dimensions: int = EMBEDDING_DIM) -> list[float]:
    """A deterministic vector of `dimensions` floats in [-1, 1) derived from the text's hash."""
    digest = hashlib.shake_256(text.encode()).digest(4 * dimensions)
    return [value / 2**31 - 1.0 for value in struct.unpack(f"<{dimensions}I", digest)]


# ---------------------------------------------------------------------------------------------
# The service
# ---------------------------------------------------------------------------------------------


def _authorized(headers: Any, key: str) -> bool:
    authorization = headers.get("authorization", "")
    scheme, _, bearer = authorization.partition(" ")
    offered = [headers.get("api-key")]
    if scheme.lower() == "bearer":
        offered.append(bearer.strip())
    expected = key.encode()
    return any(
        value is not None and hmac.compare_digest(value.encode(), expected) for value in offered
    )


def _drop_connection(request: web.Request) -> None:
    """Abort the client connection with a TCP reset (SO_LINGER 0), without an answer."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


async def _sleep_until(deadline: float) -> None:
    delay = deadline - asyncio.get_running_loop().time()
    if delay > 0:
        await asyncio.sleep(delay)


def decode_token_ms(config: SimulatorConfig, running: int) -> float:
    """Time to generate one token with `running` generations in the batch (this one included),
    in milliseconds: per_token_ms plus decode_ms_per_running_seq for every other one."""
    return config.per_token_ms + config.decode_ms_per_running_seq * max(0, running - 1)


_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_Answer = Callable[[web.Request, dict[str, Any], _Exchange, bool], Awaitable[web.StreamResponse]]


class _Service:
    """The request handlers of one simulated deployment and everything they share."""

    def __init__(self, config: SimulatorConfig):
        self.config = config
        self.state = SimulatorState()
        self.cache = PrefixCache(config.block_tokens, config.cache_blocks)
        self.faults = _FaultInjector()
        self.batch = _Batch(config.max_num_seqs, self.state)
        self.healthy = True
        self.waiting: dict[str, float] = {}
        self.store = ResponseStore()
        self.background: set[asyncio.Task] = set()
        self.vocabulary: dict[str, int] = {}  # /tokenize: a word's id, in order of first sight
        self.words: list[str] = []

    # -- inference --------------------------------------------------------------------------

    def generation_handler(self, api: _GenerationApi) -> _Handler:
        async def handler(request: web.Request) -> web.StreamResponse:
            return await self._serve(request, functools.partial(self._generate, api))

        return handler

    async def embeddings_handler(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, self._embed)

    async def _serve(self, request: web.Request, answer: _Answer) -> web.StreamResponse:
        """The bookkeeping and checks every inference request goes through, around `answer`."""
        exchange = self.state.request_started(request.headers.items())
        try:
            body = await _read_json_object(request)
            model = body.get("model")
            self.state.last_request_models.append(model)
            self.state.last_request_fields.append(list(body))
            if not isinstance(model, str):
                raise _invalid("'model' must be a string")
            self.state.model_started(exchange, model)
            fault = self.faults.take()
            if fault is not None and fault.mode == "status":
                raise self._injected_error(fault.status)
            self._check_access(request, model)
            return await answer(request, body, exchange, fault is not None)
        except _ApiError as error:
            exchange.outcome = str(error.status)
            return error.response()
        except asyncio.CancelledError:
            exchange.outcome = OUTCOME_CLIENT_GONE
            raise
        finally:
            self.state.request_finished(exchange)

    def _check_access(self, request: web.Request, model: str) -> None:
        key = self.config.required_api_key
        if key is not None and not _authorized(request.headers, key):
            raise _ApiError(
                401, "Incorrect API key provided.", "invalid_request_error", "invalid_api_key"
            )
        served = self.config.served_model_names
        if served is not None and model not in served:
            raise _ApiError(
                404,
                f"The model `{model}` does not exist or you do not have access to it.",
                "invalid_request_error",
                "model_not_found",
            )

    @staticmethod
    def _injected_error(status: int) -> _ApiError:
        type_ = "server_error" if status >= 500 else "invalid_request_error"
        return _ApiError(status, f"simulated failure (status {status})", type_, "simulated_failure")

    @staticmethod
    def _drop(request: web.Request, exchange: _Exchange) -> web.StreamResponse:
        """Drop the connection; the returned placeholder response can never be delivered."""
        exchange.outcome = OUTCOME_RESET
        _drop_connection(request)
        return web.Response()

    async def _generate(
        self,
        api: _GenerationApi,
        request: web.Request,
        body: dict[str, Any],
        exchange: _Exchange,
        drop: bool,
    ) -> web.StreamResponse:
        context = self.store.context(body) if isinstance(api, _ResponsesApi) else ""
        words = context.split() + api.prompt(body).split()  # a bad request is answered at once, without waiting
        max_tokens = _max_tokens(body, api.max_token_fields, self.config.default_max_tokens)
        if isinstance(api, _ResponsesApi) and body.get("background") is True:
            return self._start_background(api, body, words, max_tokens, context, exchange)
        async with self.batch.seat():
            gen = self._start_generation(api, body, words, max_tokens)
            if isinstance(api, _ResponsesApi):
                self._keep_response(api, body, gen, context, StoredResponse(gen, _input_items(body)))
            if body.get("stream") is True:
                return await self._stream(api, gen, request, exchange, drop)
            if drop:
                return self._drop(request, exchange)
            await self._decode(gen)
        self.state.completion_tokens += gen.completion_tokens
        exchange.outcome = "200"
        return _json_response(api.answer(gen))

    def _keep_response(self, api: _ResponsesApi, body: dict[str, Any], gen: _Generation, context: str, entry: StoredResponse) -> None:
        prompt = (context + "\n" + api.prompt(body)) if context else api.prompt(body)
        if self.store.keep(body, gen.id, prompt + "\n" + gen.text(), entry):
            self.state.responses_stored += 1

    def _start_background(
        self, api: _ResponsesApi, body: dict[str, Any], words: list[str], max_tokens: int, context: str, exchange: _Exchange
    ) -> web.Response:
        """``background: true``: stored with status ``queued`` and answered at once; the generation
        runs afterwards (waiting for a place like any), and its status follows."""
        if body.get("store") is False or body.get("stream") is True:
            raise _invalid("a background response must be stored and not streamed here")
        gen = self._start_generation(api, body, words, max_tokens)
        entry = StoredResponse(gen, _input_items(body), status="queued", background=True)
        self._keep_response(api, body, gen, context, entry)
        entry.task = asyncio.get_running_loop().create_task(self._run_background(entry))
        self.background.add(entry.task)
        entry.task.add_done_callback(self.background.discard)
        exchange.outcome = "200"
        return _json_response(api.stored(entry))

    async def _run_background(self, entry: StoredResponse) -> None:
        async with self.batch.seat():
            entry.status = "in_progress"
            await self._decode(entry.gen)
        self.state.completion_tokens += entry.gen.completion_tokens
        entry.status = "completed"

    # -- stored responses by id -------------------------------------------------------------

    def _stored(self, request: web.Request, action: str) -> tuple[str, StoredResponse]:
        """Count a lookup by id, check the key; the id and its stored response. Raises _ApiError."""
        self.state.response_lookups[action] = self.state.response_lookups.get(action, 0) + 1
        self.state.last_request_headers.append({name.lower(): value for name, value in request.headers.items()})
        key = self.config.required_api_key
        if key is not None and not _authorized(request.headers, key):
            raise _ApiError(401, "Incorrect API key provided.", "invalid_request_error", "invalid_api_key")
        response_id = request.match_info["response_id"]
        return response_id, self.store.get(response_id)

    async def retrieve_response(self, request: web.Request) -> web.Response:
        try:
            _, entry = self._stored(request, "retrieve")
        except _ApiError as error:
            return error.response()
        return _json_response(_ResponsesApi().stored(entry))

    async def delete_response(self, request: web.Request) -> web.Response:
        try:
            response_id, entry = self._stored(request, "delete")
        except _ApiError as error:
            return error.response()
        if entry.task is not None:
            entry.task.cancel()
        self.store.forget(response_id)
        return _json_response({"id": response_id, "object": "response.deleted", "deleted": True})

    async def response_input_items(self, request: web.Request) -> web.Response:
        """The stored response's input items, newest first unless ``order=asc`` (OpenAI's default)."""
        try:
            _, entry = self._stored(request, "input_items")
        except _ApiError as error:
            return error.response()
        items = entry.input_items if request.query.get("order") == "asc" else entry.input_items[::-1]
        first, last = (items[0]["id"], items[-1]["id"]) if items else (None, None)
        return _json_response({"object": "list", "data": items, "first_id": first, "last_id": last, "has_more": False})

    async def cancel_response(self, request: web.Request) -> web.Response:
        """Cancel a background response still queued or in progress; any other gets a 400."""
        try:
            _, entry = self._stored(request, "cancel")
            if not entry.background:
                raise _invalid("Cannot cancel a synchronous response.")
        except _ApiError as error:
            return error.response()
        if entry.status in ("queued", "in_progress") and entry.task is not None:
            entry.task.cancel()
            entry.status = "cancelled"
        return _json_response(_ResponsesApi().stored(entry))

    async def stop_background(self, app: web.Application) -> None:
        for task in list(self.background):
            task.cancel()

    # -- vLLM's endpoints beyond OpenAI's ----------------------------------------------------

    def engine_handler(self, answer: Callable[[dict[str, Any]], dict[str, Any]]) -> _Handler:
        """An engine endpoint answered at once by `answer(body)`, counted like any inference request."""
        async def answer_now(request: web.Request, body: dict[str, Any], exchange: _Exchange, drop: bool) -> web.StreamResponse:
            if drop:
                return self._drop(request, exchange)
            reply = answer(body)
            exchange.outcome = "200"
            return _json_response(reply)

        async def handler(request: web.Request) -> web.StreamResponse:
            return await self._serve(request, answer_now)

        return handler

    def _token_ids(self, text: str) -> list[int]:
        ids = []
        for word in text.split():
            if word not in self.vocabulary:
                self.vocabulary[word] = len(self.words)
                self.words.append(word)
            ids.append(self.vocabulary[word])
        return ids

    def tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        """vLLM's ``/tokenize``: ``prompt`` or ``messages`` -> ``{"count", "max_model_len", "tokens"}``."""
        prompt = body.get("prompt")
        text = prompt if isinstance(prompt, str) else _messages_text(body.get("messages"), "messages")
        tokens = self._token_ids(text)
        return {"count": len(tokens), "max_model_len": 8192, "tokens": tokens}

    def detokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        """vLLM's ``/detokenize``: ``tokens`` -> ``{"prompt"}``."""
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and 0 <= t < len(self.words) for t in tokens):
            raise _invalid("'tokens' must be a list of known token ids")
        return {"prompt": " ".join(self.words[t] for t in tokens)}

    def rerank(self, body: dict[str, Any]) -> dict[str, Any]:
        """vLLM's (Jina's and Cohere's) ``/v1/rerank``: ``query``, ``documents`` [, ``top_n``]."""
        query = body.get("query")
        if not isinstance(query, str):
            raise _invalid("'query' must be a string")
        documents = _strings(body.get("documents"), "documents")
        top_n = body.get("top_n") or len(documents)
        scored = sorted(((_overlap(query, d), i, d) for i, d in enumerate(documents)), key=lambda x: (-x[0], x[1]))
        results = [{"index": i, "document": {"text": d}, "relevance_score": score} for score, i, d in scored[:top_n]]
        tokens = len(query.split()) + sum(len(d.split()) for d in documents)
        return {"id": "rerank-" + uuid.uuid4().hex, "model": body["model"], "usage": {"total_tokens": tokens}, "results": results}

    def score(self, body: dict[str, Any]) -> dict[str, Any]:
        """vLLM's ``/v1/score``: ``text_1`` against each of ``text_2``."""
        first = body.get("text_1")
        if not isinstance(first, str):
            raise _invalid("'text_1' must be a string")
        seconds = _strings(body.get("text_2"), "text_2")
        data = [{"index": i, "object": "score", "score": _overlap(first, text)} for i, text in enumerate(seconds)]
        tokens = len(first.split()) * len(seconds) + sum(len(t.split()) for t in seconds)
        return {"id": "score-" + uuid.uuid4().hex, "object": "list", "created": int(time.time()), "model": body["model"],
                "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    def token_ms(self) -> float:
        """Time to generate one token now, in milliseconds (`decode_token_ms`)."""
        return decode_token_ms(self.config, self.state.running)

    async def _decode(self, gen: _Generation) -> None:
        """Wait until a non-streamed `gen` is ready: its first token, then every token at the
        batch's speed when that token starts."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._first_token_ms(gen) / 1000
        if self.config.decode_ms_per_running_seq == 0:  # one sleep: the speed never changes
            await _sleep_until(deadline + gen.completion_tokens * self.config.per_token_ms / 1000)
            return
        for _ in range(gen.completion_tokens):
            await _sleep_until(deadline)
            deadline += self.token_ms() / 1000
        await _sleep_until(deadline)

    def _first_token_ms(self, gen: _Generation) -> float:
        """Time to first token of `gen`, in milliseconds: ttft_ms plus the prefill of its
        uncached prompt tokens."""
        uncached = gen.prompt_tokens - gen.cached_tokens
        return self.config.ttft_ms + uncached * self.config.prefill_ms_per_token

    def _start_generation(self, api: _GenerationApi, body: dict[str, Any], words: list[str], max_tokens: int) -> _Generation:
        """Look the prompt's `words` (after the transcript a Responses turn continues, if any) up
        in the prefix cache and count its tokens."""
        cached = self.cache.lookup_and_insert(words)
        self.state.prompt_tokens += len(words)
        self.state.cached_tokens += cached
        options = body.get("stream_options")
        return _Generation(
            id=api.id_prefix + uuid.uuid4().hex,
            created=int(time.time()),
            model=body["model"],
            prompt_tokens=len(words),
            cached_tokens=cached,
            completion_tokens=max_tokens,
            include_usage=isinstance(options, dict) and options.get("include_usage") is True,
        )

    async def _stream(
        self,
        api: _GenerationApi,
        gen: _Generation,
        request: web.Request,
        exchange: _Exchange,
        drop: bool,
    ) -> web.StreamResponse:
        """Send `gen` as server-sent events: the first token after ttft_ms plus prefill, then one
        token every `token_ms` (paced against a deadline so the delays do not drift)."""
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        if self.config.gzip:
            response.enable_compression()
        deadline = asyncio.get_running_loop().time() + self._first_token_ms(gen) / 1000
        try:
            await response.prepare(request)
            start = api.stream_start(gen)
            if start:
                await response.write(start)
            for i in range(gen.completion_tokens):
                await _sleep_until(deadline)
                await response.write(api.stream_token(gen, i))
                self.state.completion_tokens += 1
                if drop:
                    self._drop(request, exchange)
                    return response
                deadline += self.token_ms() / 1000
            await response.write(api.stream_end(gen))
            await response.write_eof()
        except ConnectionResetError:
            exchange.outcome = OUTCOME_CLIENT_GONE
            return response
        exchange.outcome = "200"
        return response

    async def _embed(
        self, request: web.Request, body: dict[str, Any], exchange: _Exchange, drop: bool
    ) -> web.StreamResponse:
        texts = _strings(body.get("input"), "input")
        dimensions = body.get("dimensions", EMBEDDING_DIM)  # OpenAI's parameter: the vectors' length
        if isinstance(dimensions, bool) or not isinstance(dimensions, int) or not 1 <= dimensions <= MAX_EMBEDDING_DIM:
            raise _invalid(f"'dimensions' must be an integer from 1 to {MAX_EMBEDDING_DIM}")
        prompt_tokens = sum(len(text.split()) for text in texts)
        self.state.prompt_tokens += prompt_tokens
        if drop:
            return self._drop(request, exchange)
        await asyncio.sleep(self.config.ttft_ms / 1000)
        data = [
            {"object": "embedding", "index": index, "embedding": _embedding(text, dimensions)}
            for index, text in enumerate(texts)
        ]
        exchange.outcome = "200"
        return _json_response(
            {
                "object": "list",
                "data": data,
                "model": body["model"],
                "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
            }
        )

    # -- observation and control ------------------------------------------------------------

    async def stats(self, request: web.Request) -> web.Response:
        return _json_response({"name": self.config.name, **self.state.snapshot()})

    async def reset_stats(self, request: web.Request) -> web.Response:
        self.state.reset()
        return await self.stats(request)

    async def health(self, request: web.Request) -> web.Response:
        self.state.health_checks += 1
        if self.healthy:
            return _json_response({"status": "ok"})
        self.state.health_checks_failed += 1
        client = request.query.get("client", "")
        by_client = self.state.health_checks_failed_by_client
        by_client[client] = by_client.get(client, 0) + 1
        return _json_response({"status": "unhealthy"}, status=503)

    async def metrics(self, request: web.Request) -> web.Response:
        """Prometheus text, vLLM's names: requests running (in flight) and waiting (as set by
        ``POST /control/load``) per ``model_name``."""
        lines = ["# TYPE vllm:num_requests_running gauge"]
        for model, count in sorted(self.state.in_flight_by_model.items()):
            lines.append(f'vllm:num_requests_running{{model_name="{_label(model)}"}} {count}')
        lines.append("# TYPE vllm:num_requests_waiting gauge")
        for model, count in sorted(self.waiting.items()):
            lines.append(f'vllm:num_requests_waiting{{model_name="{_label(model)}"}} {count:g}')
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def set_load(self, request: web.Request) -> web.Response:
        """``{"waiting": 12, "model": "m"}``: the waiting-queue gauge of ``model`` (default: the
        first served model name, else ``default``)."""
        try:
            body = await _read_json_object(request)
            waiting = body.get("waiting")
            if isinstance(waiting, bool) or not isinstance(waiting, (int, float)) or waiting < 0:
                raise _invalid("'waiting' must be a number >= 0")
            default = (self.config.served_model_names or ["default"])[0]
            model = body.get("model", default)
            if not isinstance(model, str):
                raise _invalid("'model' must be a string")
        except _ApiError as error:
            return error.response()
        self.waiting[model] = float(waiting)
        return _json_response({"model": model, "waiting": waiting})

    async def set_health(self, request: web.Request) -> web.Response:
        try:
            healthy = (await _read_json_object(request)).get("healthy")
            if not isinstance(healthy, bool):
                raise _invalid("'healthy' must be true or false")
        except _ApiError as error:
            return error.response()
        self.healthy = healthy
        return _json_response({"healthy": healthy})

    async def arm_fault(self, request: web.Request) -> web.Response:
        try:
            fault, count = _parse_fault(await _read_json_object(request))
        except _ApiError as error:
            return error.response()
        self.faults.arm(fault, count)
        return _json_response({"mode": fault.mode, "status": fault.status, "count": count})

    async def clear_faults(self, request: web.Request) -> web.Response:
        self.faults.clear()
        return _json_response({"status": "ok"})


def _overlap(query: str, text: str) -> float:
    """The share of `query`'s distinct words that `text` holds, in [0, 1]."""
    wanted = set(query.split())
    return len(wanted & set(text.split())) / len(wanted) if wanted else 0.0


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _parse_fault(body: dict[str, Any]) -> tuple[_Fault, int]:
    """``{"status": 503, "count": 5}`` or ``{"mode": "reset", "count": N}``; count defaults to
    1, -1 means until cleared; status defaults to 503."""
    mode = body.get("mode", "status")
    status = body.get("status", 503)
    count = body.get("count", 1)
    if mode not in ("status", "reset"):
        raise _invalid("'mode' must be 'status' or 'reset'")
    if isinstance(status, bool) or not isinstance(status, int) or not 400 <= status <= 599:
        raise _invalid("'status' must be an integer from 400 to 599")
    if isinstance(count, bool) or not isinstance(count, int) or not (count == -1 or count >= 1):
        raise _invalid("'count' must be an integer >= 1, or -1 for until cleared")
    return _Fault(mode, status), count


def build_app(config: SimulatorConfig) -> web.Application:
    """The simulator as an aiohttp application; its counters are ``app[STATE_KEY]``.

    Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/embeddings``,
    ``POST /v1/responses``; ``GET`` and ``DELETE /v1/responses/{id}``, ``GET
    /v1/responses/{id}/input_items``, ``POST /v1/responses/{id}/cancel``; ``POST /tokenize``,
    ``/detokenize``, ``/v1/rerank``, ``/v1/score``; ``GET /stats`` (the `SimulatorState` snapshot plus ``name``),
    ``POST /stats/reset``; ``POST /control/fail`` with ``{"status": 503, "count": 5}`` or
    ``{"mode": "reset", "count": N}`` (count -1: until cleared), ``POST /control/clear``;
    ``GET /health`` (200, or 503 after ``POST /control/health {"healthy": false}``);
    ``GET /metrics`` (Prometheus text) and ``POST /control/load {"waiting": N}``.

    Run it with ``handler_cancellation=True`` (as `start_simulator` does) so that a client
    disconnect ends a waiting request at once rather than when its answer would be due.
    """
    service = _Service(config)

    @web.middleware
    async def compress(request: web.Request, handler: _Handler) -> web.StreamResponse:
        response = await handler(request)
        if not response.prepared and request.path.startswith("/v1/"):  # a stream compresses itself
            response.enable_compression()  # by the request's accept-encoding: gzip or deflate, else none
        return response

    app = web.Application(client_max_size=_MAX_BODY_BYTES, middlewares=[compress] if config.gzip else [])
    app[STATE_KEY] = service.state

    async def add_name_header(request: web.Request, response: web.StreamResponse) -> None:
        response.headers["x-simulator-name"] = config.name

    app.on_response_prepare.append(add_name_header)
    app.on_cleanup.append(service.stop_background)
    app.add_routes(
        [
            web.post("/v1/chat/completions", service.generation_handler(_ChatApi())),
            web.post("/v1/completions", service.generation_handler(_CompletionsApi())),
            web.post("/v1/responses", service.generation_handler(_ResponsesApi())),
            web.post("/v1/embeddings", service.embeddings_handler),
            web.get("/v1/responses/{response_id}", service.retrieve_response),
            web.delete("/v1/responses/{response_id}", service.delete_response),
            web.get("/v1/responses/{response_id}/input_items", service.response_input_items),
            web.post("/v1/responses/{response_id}/cancel", service.cancel_response),
            web.post("/tokenize", service.engine_handler(service.tokenize)),
            web.post("/detokenize", service.engine_handler(service.detokenize)),
            web.post("/v1/rerank", service.engine_handler(service.rerank)),
            web.post("/v1/score", service.engine_handler(service.score)),
            web.get("/stats", service.stats),
            web.post("/stats/reset", service.reset_stats),
            web.get("/health", service.health),
            web.post("/control/health", service.set_health),
            web.post("/control/fail", service.arm_fault),
            web.post("/control/clear", service.clear_faults),
            web.get("/metrics", service.metrics),
            web.post("/control/load", service.set_load),
        ]
    )
    return app


class RunningSimulator:
    """A simulator serving in this process: `port` (int), `url` (``http://host:port``, no
    trailing slash), `state` (its live `SimulatorState`); `stop` shuts it down."""

    def __init__(self, runner: web.AppRunner, host: str, port: int, state: SimulatorState, scheme: str = "http"):
        self._runner = runner
        self.port = port
        self.url = f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"
        self.state = state

    async def stop(self) -> None:
        """Stop listening and end the requests still running (after at most 2 seconds)."""
        await self._runner.cleanup()


async def start_simulator(
    config: SimulatorConfig, host: str = "127.0.0.1", port: int = 0, ssl_context: ssl.SSLContext | None = None
) -> RunningSimulator:
    """Serve a simulator on `host`:`port` (0: a free port) in the running event loop; over TLS
    (HTTPS) with `ssl_context`."""
    app = build_app(config)
    runner = web.AppRunner(
        app, access_log=None, handler_cancellation=True, shutdown_timeout=_SHUTDOWN_TIMEOUT_S
    )
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, backlog=_LISTEN_BACKLOG, ssl_context=ssl_context).start()
    except BaseException:
        await runner.cleanup()
        raise
    scheme = "https" if ssl_context is not None else "http"
    return RunningSimulator(runner, host, runner.addresses[0][1], app[STATE_KEY], scheme)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def _parse_args(argv: list[str] | None) -> tuple[SimulatorConfig, str, int, ssl.SSLContext | None]:
    parser = argparse.ArgumentParser(
        prog="python -m irislab.simulator",
        description="A simulated OpenAI-compatible inference deployment.",
    )
    parser.add_argument("--name", required=True, help="name reported in x-simulator-name")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True, help="0 picks a free port")
    parser.add_argument("--ttft-ms", type=float, default=0, help="time to first token, ms")
    parser.add_argument("--per-token-ms", type=float, default=0, help="time per token, ms")
    parser.add_argument(
        "--prefill-ms-per-token", type=float, default=0,
        help="extra time to first token per uncached prompt token, ms",
    )
    parser.add_argument("--block-tokens", type=int, default=512, help="tokens per cache block")
    parser.add_argument("--cache-blocks", type=int, default=4096, help="cache capacity, blocks")
    parser.add_argument(
        "--max-num-seqs", type=int, default=0,
        help="generations served at once (like vLLM's), the others wait; 0: no limit",
    )
    parser.add_argument(
        "--decode-ms-per-running-seq", type=float, default=0,
        help="extra time per token for every other generation running at once, ms",
    )
    parser.add_argument(
        "--api-key-env", metavar="VAR", help="environment variable holding the required API key"
    )
    parser.add_argument(
        "--model", dest="models", action="extend", nargs="+", metavar="NAME",
        help="model name served (repeatable); default: any",
    )
    parser.add_argument(
        "--gzip", action="store_true", help="compress answers when the request's accept-encoding allows it"
    )
    parser.add_argument("--tls-cert", metavar="PEM", help="serve HTTPS with this certificate (chain)")
    parser.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")
    args = parser.parse_args(argv)
    if (args.tls_cert is None) != (args.tls_key is None):
        parser.error("--tls-cert and --tls-key go together")
    ssl_context = None
    if args.tls_cert is not None:
        ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ssl_context.load_cert_chain(args.tls_cert, args.tls_key)
    api_key = None
    if args.api_key_env is not None:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            parser.error(f"environment variable {args.api_key_env} is not set")
    if args.block_tokens < 1:
        parser.error("--block-tokens must be >= 1")
    if args.max_num_seqs < 0 or args.decode_ms_per_running_seq < 0:
        parser.error("--max-num-seqs and --decode-ms-per-running-seq must be >= 0")
    config = SimulatorConfig(
        name=args.name,
        ttft_ms=args.ttft_ms,
        per_token_ms=args.per_token_ms,
        prefill_ms_per_token=args.prefill_ms_per_token,
        block_tokens=args.block_tokens,
        cache_blocks=args.cache_blocks,
        max_num_seqs=args.max_num_seqs,
        decode_ms_per_running_seq=args.decode_ms_per_running_seq,
        required_api_key=api_key,
        served_model_names=args.models,
        gzip=args.gzip,
    )
    return config, args.host, args.port, ssl_context


async def _serve_until_signalled(
    config: SimulatorConfig, host: str, port: int, ssl_context: ssl.SSLContext | None = None
) -> None:
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    simulator = await start_simulator(config, host, port, ssl_context)
    _log.info("%s listening on %s", config.name, simulator.url)
    try:
        await stopping.wait()
    finally:
        await simulator.stop()


def main(argv: list[str] | None = None) -> None:
    """CLI: ``python -m irislab.simulator --name iris-1 --port 8001 [--host 127.0.0.1]
    [--ttft-ms 50] [--per-token-ms 5] [--prefill-ms-per-token 0.1] [--block-tokens 512]
    [--cache-blocks 4096] [--max-num-seqs 0] [--decode-ms-per-running-seq 0] [--api-key-env VAR] [--model NAME ...] [--tls-cert PEM --tls-key PEM]``.
    Serves until SIGTERM or SIGINT, then exits 0."""
    config, host, port, ssl_context = _parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(name)s %(message)s"
    )
    asyncio.run(_serve_until_signalled(config, host, port, ssl_context))


if __name__ == "__main__":
    main()
