"""Routers in front of real engines: a pool of llama.cpp `llama-server` processes (SmolLM2-135M,
irislab.engines), one multi-turn workload, four front ends, one run.

    python -m bench.real_engines [--engines 2] [--parallel 2] [--sessions 16] [--turns 4]

The workload is the Mooncake conversation trace scaled to the tiny model: the first `--sessions`
conversations with at least `--turns` requests, each request's 512-token blocks turned into
`--words-per-block` words (block 0, shared by every request, is a common system prompt; a later
turn repeats its conversation's earlier blocks, as a chat does). `--clients` clients (default: the
pool's slots, engines x parallel) each run whole sessions, turn after turn, streamed.

Front ends, each in front of fresh engines (empty caches):
- `iris`: this gateway (Envoy + ext_proc + Redis), the pool as one provider hashed by session;
- `smg_cache_aware`: the SGLang Model Gateway, its radix-tree policy over the request text;
- `vllm_sticky_least_loaded`: vllm-router, a session (X-Session-ID) stays where it started;
- `round_robin`: plain Envoy, round robin over the pool.
A peer whose program is not installed (`pip install -e '.[bench]'`) is reported and skipped.

Printed per front end: requests, errors, requests/s, TTFT p50 and p99 (ms), the share of prompt
tokens the engines served from their cache (their own counters, `llamacpp:prompt_tokens_cached_total`
over it plus `llamacpp:prompt_tokens_total`), and the peak concurrency per engine (sampled every
50 ms from `requests_processing + requests_deferred`) against `--parallel`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import queue
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench import peers
from bench.common import (
    default_trace_path,
    machine_description,
    plain_envoy_bootstrap,
    pool_cluster,
    print_figure,
    print_table,
    start_envoy,
    summarize_ms,
    wait_http_ready,
    write_json,
)
from irislab.engines import MODEL_NAME, LlamaServer
from irislab.local_gateway import LocalGateway
from irislab.processes import ManagedProcess, free_port

FRONTS = ("iris", "smg_cache_aware", "vllm_sticky_least_loaded", "round_robin")
VOCABULARY = (
    "river stone garden window morning paper silver orange market winter engine forest candle letter bridge "
    "summer valley ocean planet animal doctor teacher yellow kitchen mountain holiday picture station village "
    "number button pocket circle family history friend harbor island jacket ladder marble needle pencil rabbit "
    "saddle tunnel velvet wallet basket camera dinner feather gravel hammer"
).split()


@dataclass(frozen=True)
class Turn:
    session: str
    messages: list[dict[str, str]]


@dataclass
class Result:
    """One request: time to its first token (ms), its status, cached and prompt tokens."""

    session: str
    ttft_ms: float | None
    status: int
    cached: int = 0
    prompt: int = 0


@dataclass
class Sampler:
    """Peak `requests_processing + requests_deferred` of each engine, sampled every 50 ms."""

    engines: list[LlamaServer]
    peaks: list[float] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self):
        self.peaks = [0.0] * len(self.engines)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            for index, engine in enumerate(self.engines):
                try:
                    sample = engine.metrics()
                except (OSError, ValueError):
                    continue
                busy = sample.get("llamacpp:requests_processing", 0) + sample.get("llamacpp:requests_deferred", 0)
                self.peaks[index] = max(self.peaks[index], busy)

    def stop(self) -> list[float]:
        self._stop.set()
        self._thread.join()
        return self.peaks


def block_text(block: int, words: int) -> str:
    """`words` ordinary words, the same for the same block id (about one token each)."""
    digest = hashlib.blake2b(str(block).encode(), digest_size=64).digest()
    picks = [VOCABULARY[(digest[i % 64] + i * 7) % len(VOCABULARY)] for i in range(words)]
    return f"Part {block}: " + " ".join(picks) + "."


def sessions_from_trace(path: Path, sessions: int, turns: int, words: int, max_blocks: int) -> list[list[Turn]]:
    """The first `sessions` conversations (first two blocks) with at least `turns` requests, as
    their first `turns` turns; each request's blocks (at most `max_blocks`) become its messages."""
    conversations: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    with path.open() as lines:
        for line in lines:
            blocks = tuple(json.loads(line)["hash_ids"])
            conversations.setdefault(blocks[:2], []).append(blocks)
    chosen = [requests for requests in conversations.values() if len(requests) >= turns][:sessions]
    out = []
    for number, requests in enumerate(chosen):
        name = f"conversation-{number}"
        session = []
        for blocks in requests[:turns]:
            blocks = blocks[:max_blocks]
            messages = [{"role": "system", "content": block_text(blocks[0], words)}]
            for index, block in enumerate(blocks[1:], start=1):
                messages.append({"role": "user" if index % 2 else "assistant", "content": block_text(block, words)})
            if messages[-1]["role"] != "user":
                messages.append({"role": "user", "content": "Go on."})
            session.append(Turn(name, messages))
        out.append(session)
    return out


def stream_one(client: httpx.Client, url: str, turn: Turn, max_tokens: int) -> Result:
    """One streamed chat request; TTFT is the first chunk with content."""
    body = {"model": MODEL_NAME, "messages": turn.messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    headers = {"x-session-id": turn.session, peers.SESSION_HEADER: turn.session}
    started = time.perf_counter()
    ttft = None
    usage: dict[str, Any] = {}
    with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as response:
        if response.status_code != 200:
            response.read()
            print(f"{turn.session}: {response.status_code} {response.text[:300]}", flush=True)
            return Result(turn.session, None, response.status_code)
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
                ttft = (time.perf_counter() - started) * 1000
            usage = chunk.get("usage") or usage
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return Result(turn.session, ttft, 200, cached, usage.get("prompt_tokens", 0))


def drive(url: str, sessions: list[list[Turn]], clients: int, max_tokens: int) -> tuple[list[Result], float]:
    """`clients` threads, each taking whole sessions from a queue; returns the results and the
    wall time (seconds)."""
    work: queue.Queue[list[Turn]] = queue.Queue()
    for session in sessions:
        work.put(session)
    results: list[Result] = []
    lock = threading.Lock()

    def client_loop() -> None:
        with httpx.Client(timeout=600) as client:
            while True:
                try:
                    session = work.get_nowait()
                except queue.Empty:
                    return
                for turn in session:
                    try:
                        result = stream_one(client, url, turn, max_tokens)
                    except httpx.HTTPError:
                        result = Result(turn.session, None, 0)
                    with lock:
                        results.append(result)

    started = time.perf_counter()
    threads = [threading.Thread(target=client_loop) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, time.perf_counter() - started


def start_front(front: str, urls: list[str], work: Path, parallel: int) -> tuple[str, Callable[[], None]]:
    """Start front end `front` over engine `urls`; returns its base URL and how to stop it."""
    if front == "iris":
        config = {
            "redis": {"key_prefix": "real"},
            "providers": [{"name": "iris-1", "kind": "managed", "cluster": "iris-1",
                           "models": {MODEL_NAME: {"features": ["chat"],
                                                   "limits": {"max_global_in_flight_request_slots": len(urls) * parallel}}}},
                          {"name": "tensorx", "kind": "unlimited", "cluster": "tensorx", "models": {MODEL_NAME: {"features": ["chat"]}}}],
        }
        gateway = LocalGateway(config_data=config, engines={"iris-1": urls}, work_dir=work / "iris")
        gateway.__enter__()
        return gateway.url, gateway.stop
    if front == "round_robin":
        ports = [int(url.rsplit(":", 1)[1]) for url in urls]
        bootstrap = plain_envoy_bootstrap(free_port(), free_port(), {"extproc": free_port()}, "pool",
                                          extra_clusters=[pool_cluster("pool", ports, "ROUND_ROBIN")])
        envoy = start_envoy(bootstrap, work, "envoy-round-robin")
        url = f"http://127.0.0.1:{envoy.port}"
        wait_http_ready(f"{url}/health")
        return url, envoy.stop
    peer = peers.BY_NAME[front]
    process: ManagedProcess = peers.start_peer(peer, urls, work)
    return f"http://127.0.0.1:{process.port}", process.stop


def run_front(front: str, sessions: list[list[Turn]], args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Fresh engines, the front end, the workload; the figures of one front end."""
    engines = [LlamaServer(work / "engines", parallel=args.parallel, context_per_slot=args.context, name=f"{front}-llama-{i}")
               for i in range(args.engines)]
    stop_front = None
    try:
        for engine in engines:
            engine.start()
        url, stop_front = start_front(front, [engine.url for engine in engines], work, args.parallel)
        sampler = Sampler(engines)
        results, wall = drive(url, sessions, args.clients or args.engines * args.parallel, args.max_tokens)
        peaks = sampler.stop()
        counters = [engine.metrics() for engine in engines]
    finally:
        if stop_front is not None:
            stop_front()
        for engine in engines:
            engine.stop()
    ok = [r for r in results if r.status == 200]
    timed = [r for r in ok if r.ttft_ms is not None]  # an answer of no content (the model ended at once) has no first token
    cached = sum(c.get("llamacpp:prompt_tokens_cached_total", 0) for c in counters)
    processed = sum(c.get("llamacpp:prompt_tokens_total", 0) for c in counters)
    later = [r for r in ok if r.prompt]
    return {
        "front": front,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "errors_by_status": dict(sorted(Counter(str(r.status) for r in results if r.status != 200).items())),
        "answers_without_content": len(ok) - len(timed),
        "requests_per_second": len(ok) / wall if wall else 0.0,
        "ttft_ms": summarize_ms([r.ttft_ms for r in timed]),
        "engine_cache_share": cached / (cached + processed) if cached + processed else 0.0,
        "client_cached_share": sum(r.cached for r in later) / max(1, sum(r.prompt for r in later)),
        "peak_concurrency_per_engine": peaks,
        "parallel": args.parallel,
        "wall_seconds": wall,
    }


def report(runs: list[dict[str, Any]], skipped: dict[str, str]) -> None:
    rows = []
    for run in runs:
        ttft = run["ttft_ms"]
        rows.append([
            run["front"], run["requests"], run["errors"], f"{run['requests_per_second']:.2f}", f"{ttft.get('p50_ms', 0):.0f}",
            f"{ttft.get('p99_ms', 0):.0f}", f"{100 * run['engine_cache_share']:.1f} %",
            " / ".join(f"{peak:g}" for peak in run["peak_concurrency_per_engine"]) + f" (of {run['parallel']})",
        ])
    print_table("Real engines: one pool of llama-server, four front ends",
                ["front end", "requests", "errors", "req/s", "TTFT p50 ms", "TTFT p99 ms", "engine cache share", "peak per engine"], rows)
    for run in runs:
        front = run["front"]
        print_figure(f"ttft_p50_ms:{front}", run["ttft_ms"]["p50_ms"])
        print_figure(f"ttft_p99_ms:{front}", run["ttft_ms"]["p99_ms"])
        print_figure(f"engine_cache_share:{front}", run["engine_cache_share"])
        print_figure(f"requests_per_second:{front}", run["requests_per_second"])
        print_figure(f"peak_per_engine:{front}", max(run["peak_concurrency_per_engine"]))
    for front, why in skipped.items():
        print(f"skipped {front}: {why}")


def plot(runs: list[dict[str, Any]], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fronts = [run["front"] for run in runs]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    p50 = [run["ttft_ms"].get("p50_ms", 0) for run in runs]
    p99 = [run["ttft_ms"].get("p99_ms", 0) for run in runs]
    positions = range(len(fronts))
    left.bar([p - 0.2 for p in positions], p50, width=0.4, label="p50")
    left.bar([p + 0.2 for p in positions], p99, width=0.4, label="p99")
    left.set_xticks(list(positions), fronts, rotation=20, ha="right")
    left.set_ylabel("time to first token (ms)")
    left.legend()
    right.bar(list(positions), [100 * run["engine_cache_share"] for run in runs])
    right.set_xticks(list(positions), fronts, rotation=20, ha="right")
    right.set_ylabel("prompt tokens from the engines' cache (%)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--engines", type=int, default=2, help="llama-server processes in the pool")
    parser.add_argument("--parallel", type=int, default=2, help="slots per engine (its --parallel)")
    parser.add_argument("--context", type=int, default=4096, help="context tokens per slot")
    parser.add_argument("--sessions", type=int, default=16, help="conversations of the trace")
    parser.add_argument("--turns", type=int, default=4, help="turns per conversation")
    parser.add_argument("--words-per-block", type=int, default=48, help="words standing for one 512-token block of the trace")
    parser.add_argument("--max-blocks", type=int, default=12, help="blocks per request at most")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request")
    parser.add_argument("--clients", type=int, default=0, help="concurrent clients (0: engines x parallel)")
    parser.add_argument("--fronts", nargs="+", default=list(FRONTS), choices=FRONTS)
    parser.add_argument("--trace", type=Path, default=default_trace_path())
    parser.add_argument("--tiny", action="store_true", help="2 sessions x 2 turns, short prompts (for the smoke test)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--plot", type=Path, help="write the plot (PNG) here")
    args = parser.parse_args(argv)
    if args.tiny:
        args.sessions, args.turns, args.words_per_block, args.max_blocks, args.max_tokens = 2, 2, 12, 4, 2
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    sessions = sessions_from_trace(args.trace, args.sessions, args.turns, args.words_per_block, args.max_blocks)
    runs, skipped = [], {}
    with tempfile.TemporaryDirectory(prefix="bench-real-engines-") as work:
        for front in args.fronts:
            peer = peers.BY_NAME.get(front)
            why = peers.unavailable(peer) if peer else None
            if why:
                skipped[front] = why
                continue
            print(f"running {front}...", flush=True)
            runs.append(run_front(front, sessions, args, Path(work) / front))
    report(runs, skipped)
    result = {"machine": machine_description(), "args": {k: str(v) for k, v in vars(args).items()}, "runs": runs, "skipped": skipped}
    write_json(args.json, result)
    if args.plot:
        plot(runs, args.plot)
    return result


if __name__ == "__main__":
    main()
