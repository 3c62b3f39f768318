"""A multi-instance test harness: N Envoy + ext_proc pairs sharing one Redis and the simulated
providers (irislab.local_gateway), and a load generator of multi-turn chat sessions.

The load generator spreads sessions over the instances at random, mixes streamed and
non-streamed requests, aborts a share of streams after their first chunk, and records per
request the instance, provider, status and routing reason. Reusable by the benchmarks.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import defaultdict
from dataclasses import dataclass, field

import aiohttp

MODEL = "llama-3.1-70b"
SYSTEM = "You are the assistant of session {session}. Keep every answer short and factual."


@dataclass
class RequestRecord:
    """What one request saw. Times are time.monotonic() seconds of the load generator."""

    session: str
    turn: int
    instance: int
    stream: bool
    abort: bool
    started: float
    ended: float = 0.0
    headers_at: float | None = None  # when the response headers arrived
    status: int | None = None
    provider: str | None = None
    reason: str | None = None
    error_code: str | None = None
    transport_error: str | None = None


@dataclass
class LoadPlan:
    """How much load: `requests` over `sessions`, `concurrency` at once; shares in [0, 1]."""

    requests: int = 2000
    sessions: int = 200
    concurrency: int = 24
    stream_share: float = 0.5
    abort_share: float = 0.1
    max_tokens: int = 8
    seed: int = 7
    request_timeout_seconds: float = 30.0
    model: str = MODEL


@dataclass
class LoadResult:
    records: list[RequestRecord] = field(default_factory=list)

    def by_status(self) -> dict[int | None, int]:
        counts: dict[int | None, int] = defaultdict(int)
        for record in self.records:
            counts[record.status] += 1
        return dict(counts)

    def server_errors(self) -> list[RequestRecord]:
        return [r for r in self.records if r.status is not None and r.status >= 500]


def session_messages(session: str, turn: int) -> list[dict]:
    """Turn `turn` of a session: its stable opening plus one exchange per earlier turn."""
    messages = [
        {"role": "system", "content": SYSTEM.format(session=session)},
        {"role": "user", "content": f"Session {session} opens with a question about routing."},
    ]
    for i in range(turn):
        messages += [{"role": "assistant", "content": f"answer {i}"}, {"role": "user", "content": f"follow-up {i + 1}"}]
    return messages


async def run_load(urls: list[str], plan: LoadPlan, stop: asyncio.Event | None = None) -> LoadResult:
    """Send `plan.requests` requests to the instances at `urls` and record each. Sessions are
    numbered s0..s{n-1}, user id = session; turns of one session may run concurrently."""
    rng = random.Random(plan.seed)
    turns: dict[str, int] = defaultdict(int)
    queue: asyncio.Queue = asyncio.Queue()
    for _ in range(plan.requests):
        session = f"s{rng.randrange(plan.sessions)}"
        queue.put_nowait((session, turns[session], rng.random() < plan.stream_share, rng.random(), rng.randrange(len(urls))))
        turns[session] += 1
    result = LoadResult()
    timeout = aiohttp.ClientTimeout(total=plan.request_timeout_seconds)
    connector = aiohttp.TCPConnector(limit=plan.concurrency * 2)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        async def worker() -> None:
            while not queue.empty() and not (stop and stop.is_set()):
                session, turn, stream, draw, instance = queue.get_nowait()
                abort = stream and draw < plan.abort_share
                record = RequestRecord(session, turn, instance, stream, abort, time.monotonic())
                await _send(http, urls[instance], plan, record)
                result.records.append(record)

        await asyncio.gather(*(worker() for _ in range(plan.concurrency)))
    return result


async def _send(http: aiohttp.ClientSession, url: str, plan: LoadPlan, record: RequestRecord) -> None:
    body = {
        "model": plan.model,
        "messages": session_messages(record.session, record.turn),
        "max_tokens": plan.max_tokens,
        "stream": record.stream,
    }
    try:
        async with http.post(f"{url}/v1/chat/completions", json=body, headers={"x-user-id": record.session}) as response:
            record.headers_at = time.monotonic()
            record.status = response.status
            record.provider = response.headers.get("x-iris-provider")
            record.reason = response.headers.get("x-iris-route-reason")
            if response.status >= 400:
                record.error_code = _error_code(await response.read())
            elif record.abort:
                await response.content.readline()  # the first chunk, then hang up
                response.close()
            else:
                await response.read()
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        record.transport_error = type(exc).__name__
    finally:
        record.ended = time.monotonic()


def _error_code(body: bytes) -> str:
    """The OpenAI-style error's code, or "not-openai-error" for any other body."""
    try:
        return json.loads(body)["error"]["code"] or ""
    except (ValueError, KeyError, TypeError):
        return "not-openai-error"


def pinned_providers_per_session(records: list[RequestRecord]) -> dict[str, set[str]]:
    """For each session, the providers that served it on its pin (offloads excluded)."""
    providers: dict[str, set[str]] = defaultdict(set)
    for record in records:
        if record.status == 200 and record.reason in ("new_pin", "pinned", "repinned"):
            providers[record.session].add(record.provider)
    return providers


def provider_concurrency(records: list[RequestRecord], provider: str) -> int:
    """The most requests the load generator had open at once on `provider` (an upper bound of
    what the provider saw: client-side spans include the proxy's time)."""
    events = []
    for record in records:
        if record.provider == provider:
            events += [(record.started, 1), (record.ended, -1)]
    peak = current = 0
    for _, delta in sorted(events, key=lambda e: (e[0], e[1])):
        current += delta
        peak = max(peak, current)
    return peak
