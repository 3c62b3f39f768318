"""The cost of putting the client's model name back into answers (adaptation.restore_model_name).

One gateway (Envoy, one ext_proc server, Redis, a simulated provider streaming a token every 2 ms) serves two
model names on the same provider and pair kind: `plain`, whose provider name is the client's
(the answer passes untouched: 3 ext_proc messages), and `renamed`, whose `upstream_model`
differs (the server asks for the answer's body and rewrites its `"model"` fields: one more
message for a JSON answer, one per chunk for a stream). For each of JSON answers and streams of
`--tokens` chunks it sends `--requests` chat requests per model, `--concurrency` at once, and
reads around each phase the CPU time (/proc/<pid>/stat) of the ext_proc server and of Envoy and
Envoy's count of ext_proc messages. Every answer is checked to name the client's model.

Prints per phase: ext_proc messages, ext_proc CPU and Envoy CPU per request (ms); then the extra
cost of the rewrite per request and per streamed chunk.

    python -m bench.model_rename [--requests 400] [--tokens 32] [--concurrency 8] [--json out/rename.json]
    python -m bench.model_rename --from-json out/rename.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path
from typing import Any

import httpx

from bench.common import cpu_seconds, load_average, machine_description, print_figure, print_table, write_json
from irislab.local_gateway import LocalGateway, ProviderSimulation

MODELS = ("plain", "renamed")
UPSTREAM = "vendor/renamed-model-instruct"


def config(tokens: int) -> dict[str, Any]:
    models = {"plain": {"features": ["chat"]}, "renamed": {"features": ["chat"], "upstream_model": UPSTREAM}}
    return {
        "redis": {"key_prefix": "rename"},
        "providers": [
            {"name": "iris-1", "kind": "managed", "cluster": "iris-1", "models": models},
            {"name": "iris-2", "kind": "managed", "cluster": "iris-2", "models": {"plain": {"features": ["chat"]}}},
            {"name": "tensorx", "kind": "unlimited", "cluster": "tensorx", "models": {"plain": {"features": ["chat"]}}},
        ],
    }


def ext_proc_messages(gateway: LocalGateway) -> int:
    admin = f"http://127.0.0.1:{gateway.running[0].admin_port}/stats?filter=ext_proc.stream_msgs_sent$"
    return int(httpx.get(admin, timeout=5).text.split(":")[1])


async def send_all(url: str, model: str, stream: bool, tokens: int, requests: int, concurrency: int) -> None:
    """`requests` chat requests for `model`; raises when one fails or names another model."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        async def one(i: int) -> None:
            body = {"model": model, "max_tokens": tokens, "stream": stream,
                    "messages": [{"role": "user", "content": f"request {i}"}]}
            async with gate:
                answer = await http.post("/v1/chat/completions", json=body, headers={"x-session-id": f"s{i}"})
            if answer.status_code != 200 or f'"model":"{model}"' not in answer.text or UPSTREAM in answer.text:
                raise RuntimeError(f"{model}: {answer.status_code} {answer.text[:300]}")

        await asyncio.gather(*(one(i) for i in range(requests)))


def measure(gateway: LocalGateway, model: str, stream: bool, tokens: int, requests: int, concurrency: int) -> dict[str, float]:
    instance = gateway.running[0]
    asyncio.run(send_all(instance.url, model, stream, tokens, max(4, requests // 10), concurrency))  # warm up
    messages, extproc, envoy = ext_proc_messages(gateway), cpu_seconds(instance.extproc.pid), cpu_seconds(instance.envoy.pid)
    asyncio.run(send_all(instance.url, model, stream, tokens, requests, concurrency))
    return {
        "messages_per_request": (ext_proc_messages(gateway) - messages) / requests,
        "extproc_ms": (cpu_seconds(instance.extproc.pid) - extproc) / requests * 1000,
        "envoy_ms": (cpu_seconds(instance.envoy.pid) - envoy) / requests * 1000,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    # One chunk per token, 2 ms apart, as an engine streams: Envoy hands each to ext_proc alone.
    sims = {name: ProviderSimulation(ttft_ms=0, per_token_ms=2) for name in ("iris-1", "iris-2", "tensorx")}
    phases = {}
    with tempfile.TemporaryDirectory() as work, LocalGateway(config_data=config(args.tokens), simulations=sims, work_dir=Path(work)) as gateway:
        for stream in (False, True):
            for model in MODELS:
                phases[f"{'stream' if stream else 'json'}_{model}"] = measure(
                    gateway, model, stream, args.tokens, args.requests, args.concurrency)
    return {"requests": args.requests, "tokens": args.tokens, "concurrency": args.concurrency,
            "load_average": load_average(), "machine": machine_description(), "phases": phases}


def report(result: dict[str, Any]) -> None:
    phases = result["phases"]
    rows = [[name, p["messages_per_request"], p["extproc_ms"], p["envoy_ms"]] for name, p in phases.items()]
    print_table(f"Per request ({result['requests']} requests per phase, streams of {result['tokens']} tokens, "
                f"concurrency {result['concurrency']}, load average {result['load_average']:.2f})",
                ["phase", "ext_proc messages", "ext_proc CPU ms", "Envoy CPU ms"], rows)
    for kind in ("json", "stream"):
        plain, renamed = phases[f"{kind}_plain"], phases[f"{kind}_renamed"]
        extra = renamed["extproc_ms"] - plain["extproc_ms"]
        extra_messages = renamed["messages_per_request"] - plain["messages_per_request"]
        print_figure(f"rename_{kind}_extproc_ms_per_request", extra)
        print_figure(f"rename_{kind}_envoy_ms_per_request", renamed["envoy_ms"] - plain["envoy_ms"])
        print_figure(f"rename_{kind}_extra_messages", extra_messages)
        if kind == "stream" and extra_messages > 0:
            print_figure("rename_stream_extproc_us_per_message", extra / extra_messages * 1000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400, help="requests per phase")
    parser.add_argument("--tokens", type=int, default=32, help="tokens (chunks) per answer")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--tiny", action="store_true", help="a smoke run: 20 requests of 4 tokens")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--from-json", type=Path, help="print a saved result again, run nothing")
    args = parser.parse_args()
    if args.from_json:
        report(json.loads(args.from_json.read_text()))
        return
    if args.tiny:
        args.requests, args.tokens = 20, 4
    result = run(args)
    write_json(args.json, result)
    report(result)


if __name__ == "__main__":
    main()
