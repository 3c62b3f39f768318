"""The load generator of the overhead and cost benchmarks, run in its own process so that its CPU
is not the gateway's: short non-streamed chat requests, open loop at a fixed rate or closed loop
(saturation), every request from one of `--users` users (the `x-user-id` header; each user is one
session), or from a new user every request with `--new-users`; with `--session-header` the user id
also goes in `X-Session-ID` (the session header of vllm-router's sticky policy).

    python -m bench.loadgen --url http://127.0.0.1:10000 --rate 200 --requests 2000 \
        --max-seconds 15 --users 100 --out result.json

Writes a JSON object: the `load_summary` figures (latencies in ms, rates in requests/s), plus
`latencies_ms` of every OK request in send order. Only 127.0.0.1 is accepted as a target.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from pathlib import Path

import aiohttp
import orjson

from bench.common import Sample, check_local, closed_loop, fixed_rate_offsets, load_summary, open_loop, write_json

CHAT_PATH = "/v1/chat/completions"
USER_HEADER = "x-user-id"
SESSION_HEADER = "X-Session-ID"


def request_body(model: str) -> bytes:
    """The request every user sends: a short chat prompt, one completion token, not streamed.
    The session id then differs only by user (the gateway hashes the user id into it)."""
    return orjson.dumps({
        "model": model,
        "messages": [
            {"role": "system", "content": "You are a load test. Answer in one word."},
            {"role": "user", "content": "Say hello."},
        ],
        "max_tokens": 1,
        "stream": False,
    })


def user_name(prefix: str, index: int) -> str:
    """The user id of user number `index`."""
    return f"{prefix}{index}"


async def run(args: argparse.Namespace) -> dict:
    url = check_local(args.url.rstrip("/") + CHAT_PATH)
    body = request_body(args.model)
    rng = random.Random(args.seed)
    connector = aiohttp.TCPConnector(limit=args.max_connections, limit_per_host=args.max_connections)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        loop = asyncio.get_running_loop()

        async def send(sample: Sample, start: float) -> None:
            if args.new_users:
                user = user_name(args.user_prefix, args.user_offset + sample.index)
            else:
                user = user_name(args.user_prefix, rng.randrange(args.users))
            headers = {USER_HEADER: user, "content-type": "application/json"}
            if args.session_header:
                headers[SESSION_HEADER] = user
            sample.sent = loop.time() - start
            try:
                async with http.post(url, data=body, headers=headers) as response:
                    sample.headers = loop.time() - start
                    await response.read()
                    sample.status = response.status
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                sample.error = type(exc).__name__
            sample.done = loop.time() - start

        began = time.monotonic()
        if args.concurrency:
            samples = await closed_loop(args.concurrency, send, args.max_seconds, args.requests)
        else:
            samples = await open_loop(fixed_rate_offsets(args.rate, args.requests), send, args.max_seconds)
        wall = time.monotonic() - began
    summary = load_summary(samples, wall)
    summary["mode"] = "closed" if args.concurrency else "open"
    summary["rate"] = args.rate
    summary["concurrency"] = args.concurrency
    summary["latencies_ms"] = [s.latency_ms for s in samples if s.ok]
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.loadgen", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="gateway or Envoy base URL on 127.0.0.1")
    parser.add_argument("--rate", type=float, default=100.0, help="open loop: requests per second")
    parser.add_argument("--concurrency", type=int, default=0, help="closed loop with this many workers (saturation)")
    parser.add_argument("--requests", type=int, default=1000, help="at most this many requests")
    parser.add_argument("--max-seconds", type=float, default=10.0, help="send for at most this long (s)")
    parser.add_argument("--users", type=int, default=100, help="distinct users (sessions) to draw from")
    parser.add_argument("--new-users", action="store_true", help="a new user (session) for every request")
    parser.add_argument("--session-header", action="store_true", help="send the user id as X-Session-ID too")
    parser.add_argument("--user-prefix", default="user-")
    parser.add_argument("--user-offset", type=int, default=0, help="first user number with --new-users")
    parser.add_argument("--model", default="llama-3.1-70b")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-connections", type=int, default=256)
    parser.add_argument("--request-timeout", type=float, default=30.0, help="per request (s)")
    parser.add_argument("--out", type=Path, required=True, help="JSON result file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    write_json(args.out, asyncio.run(run(args)))


if __name__ == "__main__":
    main()
