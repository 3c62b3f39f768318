"""Routers in front of real engines: a pool of llama.cpp `llama-server` processes (SmolLM2-135M,
irislab.engines, one thread each), two workloads, every front end on fresh engines, one run.

    python -m bench.real_engines --workload groups [--engines 3] [--parallel 2] [--groups 6] [--users 6] [--turns 4]
    python -m bench.real_engines --workload chat [--engines 3] [--sessions 24] [--turns 4]

Workloads (deterministic from `--seed`; text from the Mooncake conversation trace, each 512-token
block id turned into `--words-per-block` ordinary words):
- `chat` (a): multi-turn chat, the first `--sessions` conversations of the trace with at least
  `--turns` requests (block 0, shared by every request, is a common system prompt; a later turn
  repeats its conversation's earlier blocks);
- `groups` (b): `--groups` groups, each with a shared prefix of `--prefix-blocks` blocks (a system
  prompt or document), `--users` users per group, `--turns` turns each (a user message of
  `--user-words` words; a turn repeats the user's earlier turns, as a chat does). Users are
  interleaved: the sessions are queued user-major (the first user of every group, in a seeded
  order, then the second, ...).
`--clients` clients (default: 4/3 x the pool's slots for chat, 2 x for groups: more requests in
flight than slots) each run whole sessions, turn after turn, streamed, `--max-tokens` each.

Front ends (`--fronts`), each in front of fresh engines (empty caches):
- `iris_hash`: this gateway (Envoy + ext_proc + Redis), the pool alone as one managed provider,
  `affinity: session_hash` (Envoy's MAGLEV on the session key, bounded load), limits that never
  bind and no third party: comparable with the peers;
- `iris_hash_operator`: the same as an operator runs it: the pool's limits (its slots), the
  admission queue (`--queue-wait-ms`) and a simulated third party that answers at once;
- `iris_pick`, `iris_pick_operator`: the same two with `affinity: pick` (the router picks the
  engine; the operator's also caps each engine at its slots, `max_in_flight_per_endpoint`),
  skipped with the reason when the installed config schema does not know `pick`;
- `smg_cache_aware`: the SGLang Model Gateway, its radix-tree policy over the request text;
- `vllm_cache_aware`, `vllm_sticky_least_loaded`: vllm-router (X-Session-ID sticky);
- `round_robin`: plain Envoy, round robin over the pool.
A peer whose program is not installed (`pip install -e '.[bench]'`) is reported and skipped.

Printed per front end: requests, errors, the share sent to the third party, and over the requests
the pool served (home): requests/s and output tokens/s (per second of the run's wall time), TTFT
p50/p90/p99 (ms, first chunk with content); the engines' cached share (their own counters,
`llamacpp:prompt_tokens_cached_total` over it plus `llamacpp:prompt_tokens_total`) and that share
over the oracle's; cold prompts: the requests that computed more than half of their prompt (the
answers' `usage`), against the oracle's count (a group's users that arrive together all compute
its prefix: only one of them is cold in the oracle); the peak concurrency per engine (sampled
every 50 ms from `requests_processing + requests_deferred`) against `--parallel`; how sessions
and groups spread over the engines (bench.engine_tap notes which engine carried each request;
"generations carried" counts what the engines received, a router's retries included, against
the requests the pool served);
where the machine's CPU went during the run, in cores: the engines' processes, and the rest (the
front end, the clients, the relays; without accelerators what a front end spends is taken from
the engines).

The oracle (`oracle_share`): the cached share if every request met the longest prefix already
cached anywhere in the pool, an unbounded cache that sees every earlier request. Each message is
one block, identified by the chain of the messages up to it; a request's blocks already seen are
cached, the rest computed. It is counted in characters of message text (the words stand for
tokens at a near-constant ratio; the chat template's few tokens per message are not counted), and
it ignores time: requests in flight together would not see each other's prefix, so it is an upper
bound no router reaches exactly.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import queue
import random
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench import engine_tap, peers
from bench.common import (
    cpu_seconds,
    default_trace_path,
    machine_busy_seconds,
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
from irislab.processes import ManagedProcess, free_port, spawn, wait_for_port

WORKLOADS = ("chat", "groups")
IRIS_FRONTS = ("iris_hash", "iris_hash_operator", "iris_pick", "iris_pick_operator")
FRONTS = (*IRIS_FRONTS, "smg_cache_aware", "vllm_cache_aware", "vllm_sticky_least_loaded", "round_robin")
HOME = "iris-1"  # the pool's provider name in the gateway's config
THIRD_PARTY = "tensorx"
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
    group: str | None = None


@dataclass
class Result:
    """One request: time to its first token (ms), its status, cached, prompt and output tokens,
    and the provider the gateway chose (`x-iris-provider`; None through the other front ends)."""

    session: str
    ttft_ms: float | None
    status: int
    cached: int = 0
    prompt: int = 0
    output: int = 0
    provider: str | None = None


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


# ---------------------------------------------------------------------------------------------
# Workloads
# ---------------------------------------------------------------------------------------------


def block_text(block: int, words: int) -> str:
    """`words` ordinary words, the same for the same block id (about one token each)."""
    digest = hashlib.blake2b(str(block).encode(), digest_size=64).digest()
    picks = [VOCABULARY[(digest[i % 64] + i * 7) % len(VOCABULARY)] for i in range(words)]
    return f"Part {block}: " + " ".join(picks) + "."


def _tag_first_user_message(messages: list[dict[str, str]], session: str) -> list[dict[str, str]]:
    """The messages with the session's tag (bench.engine_tap) at the start of the first user message."""
    out = [dict(m) for m in messages]
    first = next(m for m in out if m["role"] == "user")
    first["content"] = f"{engine_tap.session_tag(session)} {first['content']}"
    return out


def sessions_from_trace(path: Path, sessions: int, turns: int, words: int, max_blocks: int) -> list[list[Turn]]:
    """Workload `chat`: the first `sessions` conversations (first two blocks) with at least
    `turns` requests, as their first `turns` turns; each request's blocks (at most `max_blocks`)
    become its messages."""
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
            session.append(Turn(name, _tag_first_user_message(messages, name)))
        out.append(session)
    return out


def trace_block_ids(path: Path) -> list[int]:
    """The distinct block ids of the trace, sorted (0..182,789 in the Mooncake file); without
    the file, the same range."""
    if not path.exists():
        return list(range(182_790))
    ids: set[int] = set()
    with path.open() as lines:
        for line in lines:
            ids.update(json.loads(line)["hash_ids"])
    return sorted(ids)


def shared_prefix_groups(block_ids: list[int], groups: int, users: int, turns: int, prefix_blocks: int, words: int,
                         user_words: int, seed: int) -> list[list[Turn]]:
    """Workload `groups`: `groups` x `users` sessions of `turns` turns. Group g's system message
    is `prefix_blocks` blocks of `words` words (its shared prefix); each turn of a user adds a
    user message of `user_words` words (after the earlier turns and a short fixed assistant
    reply to each). Block ids are drawn from `block_ids` with `seed` (no id used twice). Sessions
    come user-major: every group's first user (groups in a seeded order), then every group's
    second, ..."""
    rng = random.Random(seed)
    drawn = iter(rng.sample(block_ids, groups * prefix_blocks + groups * users * turns))
    prefixes = [" ".join(block_text(next(drawn), words) for _ in range(prefix_blocks)) for _ in range(groups)]
    sessions: dict[tuple[int, int], list[Turn]] = {}
    for g in range(groups):
        for u in range(users):
            name = f"group{g}-user{u}"
            history: list[dict[str, str]] = [{"role": "system", "content": prefixes[g]}]
            session = []
            for t in range(turns):
                history.append({"role": "user", "content": block_text(next(drawn), user_words)})
                session.append(Turn(name, _tag_first_user_message(history, name), group=f"group{g}"))
                history.append({"role": "assistant", "content": f"Understood, part {t + 1}."})
            sessions[(g, u)] = session
    order = list(range(groups))
    rng.shuffle(order)
    return [sessions[(g, u)] for u in range(users) for g in order]


def oracle_share(sessions: list[list[Turn]], block_chars: int | None = None) -> dict[str, float]:
    """The oracle's cached share of prompt characters (module docstring): each message a block
    (or, with `block_chars`, the request's messages run together and cut every `block_chars`
    characters, for text whose shared prefix does not end at a message's end, as aiperf's),
    keyed by the chain of blocks up to it; a block seen in any earlier request is cached.
    Order-independent (the seen blocks are closed under prefixes, so every distinct chain is
    computed once). Returns the share, the characters in all and computed, and `cold_requests`:
    the requests that compute more than half of their prompt, taken in the sessions' order (for
    groups, one per group: the first to carry its prefix)."""
    seen: set[bytes] = set()
    total = computed = cold = 0
    for session in sessions:
        for turn in session:
            chain = hashlib.blake2b(digest_size=16)
            request_total = request_computed = 0
            for block, size in _blocks(turn.messages, block_chars):
                chain.update(block.encode() + b"\0")
                key = chain.copy().digest()
                request_total += size
                if key not in seen:
                    seen.add(key)
                    request_computed += size
            total += request_total
            computed += request_computed
            cold += 2 * request_computed > request_total
    return {"share": 1 - computed / total if total else 0.0, "chars": total, "computed_chars": computed,
            "cold_requests": cold}


def _blocks(messages: list[dict[str, str]], block_chars: int | None) -> list[tuple[str, int]]:
    """(block, characters of message text in it) of one request."""
    if block_chars is None:
        return [(f"{m['role']}\0{m['content']}", len(m["content"])) for m in messages]
    text = "".join(f"{m['role']}\0{m['content']}\0" for m in messages)
    return [(text[i:i + block_chars], len(text[i:i + block_chars])) for i in range(0, len(text), block_chars)]


def build_workload(args: argparse.Namespace) -> list[list[Turn]]:
    """The sessions of `args.workload`."""
    if args.workload == "chat":
        return sessions_from_trace(args.trace, args.sessions, args.turns, args.words_per_block, args.max_blocks)
    return shared_prefix_groups(trace_block_ids(args.trace), args.groups, args.users, args.turns, args.prefix_blocks,
                                args.words_per_block, args.user_words, args.seed)


# ---------------------------------------------------------------------------------------------
# The client
# ---------------------------------------------------------------------------------------------


def stream_one(client: httpx.Client, url: str, turn: Turn, max_tokens: int) -> Result:
    """One streamed chat request; TTFT is the first chunk with content."""
    body = {"model": MODEL_NAME, "messages": turn.messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    headers = {"x-session-id": turn.session, peers.SESSION_HEADER: turn.session}
    started = time.perf_counter()
    ttft = None
    usage: dict[str, Any] = {}
    with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as response:
        provider = response.headers.get("x-iris-provider")
        if response.status_code != 200:
            response.read()
            print(f"{turn.session}: {response.status_code} {response.text[:300]}", flush=True)
            return Result(turn.session, None, response.status_code, provider=provider)
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
                ttft = (time.perf_counter() - started) * 1000
            usage = chunk.get("usage") or usage
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return Result(turn.session, ttft, 200, cached, usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0), provider)


def drive(url: str, sessions: list[list[Turn]], clients: int, max_tokens: int) -> tuple[list[Result], float]:
    """`clients` threads, each taking whole sessions from a queue in order; returns the results
    and the wall time (seconds)."""
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


# ---------------------------------------------------------------------------------------------
# Front ends
# ---------------------------------------------------------------------------------------------


def pick_unavailable() -> str | None:
    """Why `affinity: pick` cannot run here (None: the installed config schema knows it)."""
    from extproc.config.schema import Affinity

    if "pick" not in {member.value for member in Affinity}:
        return "the installed config schema has no `affinity: pick` (extproc.config.schema.Affinity)"
    return None


def front_unavailable(front: str) -> str | None:
    """Why front end `front` cannot run here (None: it can)."""
    if front.startswith("iris_pick"):
        return pick_unavailable()
    peer = peers.BY_NAME.get(front)
    return peers.unavailable(peer) if peer else None


def iris_config(front: str, urls: list[str], parallel: int, queue_wait_ms: int, prefix_weight: float | None = None) -> dict[str, Any]:
    """The gateway's config for `front` over the pool `urls`: the pool alone (limits that never
    bind, no third party), or as an operator runs it (`*_operator`: the pool's slots as its
    limit, the admission queue waiting `queue_wait_ms`, a third party; with pick, each engine
    capped at its slots). `prefix_weight`: pick's `routing.placement.prefix_weight` (None: the
    config's default)."""
    operator = front.endswith("_operator")
    slots = len(urls) * parallel
    model: dict[str, Any] = {"features": ["chat"],
                             "limits": {"max_global_in_flight_request_slots": slots if operator else 100_000,
                                        "max_pinned_sessions": 100_000}}
    provider: dict[str, Any] = {"name": HOME, "kind": "managed", "cluster": HOME, "models": {MODEL_NAME: model}}
    if front.startswith("iris_pick"):
        provider |= {"affinity": "pick", "endpoints": urls}
        if operator:
            model["max_in_flight_per_endpoint"] = parallel
    else:  # the pool behind Envoy's MAGLEV cluster, which knows the URLs (bench.common)
        provider["affinity"] = "session_hash"
    config: dict[str, Any] = {"redis": {"key_prefix": "real"}, "server": {"expose_routing_headers": True},
                              "providers": [provider]}
    if operator:
        config["providers"].append({"name": THIRD_PARTY, "kind": "unlimited", "cluster": THIRD_PARTY,
                                    "models": {MODEL_NAME: {"features": ["chat"]}}})
        if queue_wait_ms > 0:
            config["routing"] = {"queue": {"classes": [{"name": "interactive", "max_wait_ms": queue_wait_ms}]}}
    if prefix_weight is not None and front.startswith("iris_pick"):
        config.setdefault("routing", {})["placement"] = {"prefix_weight": prefix_weight}
    return config


def start_front(front: str, urls: list[str], work: Path, args: argparse.Namespace) -> tuple[str, Callable[[], None]]:
    """Start front end `front` over engine `urls`; returns its base URL and how to stop it."""
    if front in IRIS_FRONTS:
        config = iris_config(front, urls, args.parallel, args.queue_wait_ms, args.prefix_weight)
        gateway = LocalGateway(config_data=config, engines={HOME: urls}, work_dir=work / "iris")
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


def start_taps(engines: list[LlamaServer], work: Path) -> tuple[ManagedProcess, list[str], Path]:
    """One bench.engine_tap process relaying a free port to each engine; returns it, the
    relays' URLs (what the front end is given as the pool) and its log of requests."""
    import sys

    listen = [free_port() for _ in engines]
    log = work / "taps.txt"
    argv = [sys.executable, "-m", "bench.engine_tap", "--log", str(log)]
    for port, engine in zip(listen, engines, strict=True):
        argv += ["--pair", f"{port}:{engine.port}"]
    process = spawn("engine-tap", argv, work)
    try:
        for port in listen:
            wait_for_port(port, process=process.popen)
    except BaseException:
        process.stop()
        raise
    return process, [f"http://127.0.0.1:{port}" for port in listen], log


# ---------------------------------------------------------------------------------------------
# A second client nobody here wrote: aiperf (PyPI), offline
# ---------------------------------------------------------------------------------------------

AIPERF_TOKENIZER = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the name bench.gguf_tokenizer's snapshot carries
AIPERF_ORACLE_BLOCK_CHARS = 64  # aiperf puts its prefix and the user's text in one message: the oracle cuts blocks of text


def aiperf_unavailable(args: argparse.Namespace) -> str | None:
    """Why `--client aiperf` cannot run (None: it can)."""
    import shutil

    if not (Path(args.aiperf).exists() or shutil.which(args.aiperf)):
        return f"`{args.aiperf}` not found: pip install aiperf==0.13.0 (in a virtualenv of its own; see docs/benchmarks.md)"
    if not (args.hf_home / "hub" / f"models--{AIPERF_TOKENIZER.replace('/', '--')}").exists():
        return f"no tokenizer under {args.hf_home}: python -m bench.gguf_tokenizer --hf-home {args.hf_home}"
    return None


def aiperf_argv(args: argparse.Namespace, url: str, out: Path) -> list[str]:
    """aiperf's multi-turn synthetic conversations with a pool of prefixes, sized as the
    `groups` workload: `--groups` prefixes of about `--prefix-blocks` x `--words-per-block`
    tokens, `--groups` x `--users` conversations of `--turns` turns, `--clients` at once."""
    return [args.aiperf, "profile", "--model", MODEL_NAME, "--url", url, "--endpoint-type", "chat", "--streaming",
            "--tokenizer", AIPERF_TOKENIZER, "--num-prefix-prompts", str(args.groups),
            "--prefix-prompt-length", str(args.prefix_blocks * args.words_per_block),
            "--conversation-num", str(args.groups * args.users), "--conversation-turn-mean", str(args.turns),
            "--prompt-input-tokens-mean", str(args.user_words), "--prompt-output-tokens-mean", str(args.max_tokens),
            "--concurrency", str(args.clients), "--session-header", peers.SESSION_HEADER, "--ui-type", "none",
            "--random-seed", str(args.seed), "--output-artifact-dir", str(out)]


def run_aiperf(args: argparse.Namespace, url: str, out: Path) -> tuple[dict[str, Any], list[list[Turn]], float]:
    """Run aiperf against `url` (HF_HOME=`--hf-home`, HF_HUB_OFFLINE=1); returns its summary
    (profile_export_aiperf.json), the conversations it sent (inputs.json, for the oracle) and
    the wall time (s). Raises subprocess.CalledProcessError when it fails."""
    import os
    import subprocess

    env = dict(os.environ, HF_HOME=str(args.hf_home), HF_HUB_OFFLINE="1")
    started = time.perf_counter()
    subprocess.run(aiperf_argv(args, url, out), env=env, check=True, capture_output=True, timeout=3600)
    wall = time.perf_counter() - started
    summary = json.loads((out / "profile_export_aiperf.json").read_text())
    sent = [[Turn(entry["session_id"], payload["messages"]) for payload in entry["payloads"]]
            for entry in json.loads((out / "inputs.json").read_text())["data"]]
    return summary, sent, wall


def aiperf_figures(front: str, summary: dict[str, Any], sent: list[list[Turn]], wall: float, peaks: list[float],
                   counters: list[dict[str, float]], args: argparse.Namespace) -> dict[str, Any]:
    """One front end's figures from aiperf's own measurements (requests, errors, rates, TTFT),
    the engines' counters and the sampler; the oracle from the conversations aiperf sent."""
    def metric(name: str, key: str = "avg") -> float:
        value = (summary.get(name) or {}).get(key)
        return math.nan if value is None else float(value)

    cached = sum(c.get("llamacpp:prompt_tokens_cached_total", 0) for c in counters)
    processed = sum(c.get("llamacpp:prompt_tokens_total", 0) for c in counters)
    share = cached / (cached + processed) if cached + processed else 0.0
    oracle = oracle_share(sent, block_chars=AIPERF_ORACLE_BLOCK_CHARS)["share"]
    requests = int(metric("request_count")) if not math.isnan(metric("request_count")) else 0
    error_summary = summary.get("error_summary") or []
    errors = sum(int(e.get("count", 0)) for e in error_summary if isinstance(e, dict)) if isinstance(error_summary, list) else 0
    return {
        "front": front, "client": "aiperf", "requests": requests + errors, "errors": errors, "errors_by_status": {},
        "answers_without_content": 0, "third_party_requests": 0, "third_party_share": 0.0, "third_party_ttft_ms": {},
        "requests_per_second": metric("request_throughput"), "output_tokens_per_second": metric("output_token_throughput"),
        "ttft_ms": {f"p{p}_ms": metric("time_to_first_token", f"p{p}") for p in (50, 90, 99)},
        "engine_cache_share": share, "oracle_of_what_aiperf_sent": oracle,
        "engine_cache_share_of_oracle": share / oracle if oracle else math.nan,
        "client_cached_share": metric("overall_usage_prompt_cache_read_pct") / 100,
        "peak_concurrency_per_engine": peaks, "parallel": args.parallel,
        "spread": {"requests_per_engine": {}, "other_calls_with_prompt": {}, "sessions_seen": 0, "sessions_moved": 0,
                   "engine_changes": 0, "engines_per_group": {}, "engines_per_group_mean": math.nan},
        "wall_seconds": wall,
    }


# ---------------------------------------------------------------------------------------------
# One front end, and its figures
# ---------------------------------------------------------------------------------------------


def spread(carried: list[tuple[int, str, str]], sessions: list[list[Turn]]) -> dict[str, Any]:
    """How sessions and groups spread over the engines, from the relays' notes (engine index,
    session, path) in order: generations per engine (a router's retry counts again), sessions
    whose turns went to more than one engine, engine changes between consecutive turns, per group
    the engines its users touched; and the router's other calls that carried a prompt, by path."""
    group_of = {session[0].session: session[0].group for session in sessions if session}
    other_calls = Counter(path for _, _, path in carried if path not in engine_tap.GENERATION_PATHS)
    carried = [(engine, session) for engine, session, path in carried if path in engine_tap.GENERATION_PATHS]
    by_session: dict[str, list[int]] = defaultdict(list)
    for engine, session in carried:
        by_session[session].append(engine)
    moved = sum(1 for engines in by_session.values() if len(set(engines)) > 1)
    changes = sum(sum(1 for a, b in zip(engines, engines[1:], strict=False) if a != b) for engines in by_session.values())
    by_group: dict[str, set[int]] = defaultdict(set)
    for session, engines in by_session.items():
        if group_of.get(session):
            by_group[group_of[session]].update(engines)
    touched = [len(engines) for engines in by_group.values()]
    return {
        "requests_per_engine": dict(sorted(Counter(engine for engine, _ in carried).items())),
        "other_calls_with_prompt": dict(sorted(other_calls.items())),
        "sessions_seen": len(by_session),
        "sessions_moved": moved,
        "engine_changes": changes,
        "engines_per_group": {group: sorted(engines) for group, engines in sorted(by_group.items())},
        "engines_per_group_mean": sum(touched) / len(touched) if touched else math.nan,
    }


def run_front(front: str, sessions: list[list[Turn]], args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Fresh engines behind relays, the front end, the workload; the figures of one front end."""
    engines = [LlamaServer(work / "engines", parallel=args.parallel, context_per_slot=args.context, name=f"{front}-llama-{i}")
               for i in range(args.engines)]
    stop_front = taps = None
    try:
        for engine in engines:
            engine.start()
        taps, urls, tap_log = start_taps(engines, work)
        url, stop_front = start_front(front, urls, work, args)
        sampler = Sampler(engines)
        cpu = CpuSplit(engines)
        if args.client == "aiperf":
            summary, sent, wall = run_aiperf(args, url, work / "aiperf")
        else:
            results, wall = drive(url, sessions, args.clients, args.max_tokens)
        cores = cpu.stop()
        peaks = sampler.stop()
        counters = [engine.metrics() for engine in engines]
    finally:
        if stop_front is not None:
            stop_front()
        if taps is not None:
            taps.stop()
        for engine in engines:
            engine.stop()
    if args.client == "aiperf":
        return aiperf_figures(front, summary, sent, wall, peaks, counters, args) | cores
    return figures(front, results, wall, peaks, counters, spread(engine_tap.read_log(tap_log), sessions), args) | cores


class CpuSplit:
    """Where the machine's CPU went while the workload ran: the engines' processes, and the rest
    (the front end, the clients, the relays: on a machine without accelerators, what a front
    end spends is taken from the engines). In cores (CPU seconds per second of the run)."""

    def __init__(self, engines: list[LlamaServer]):
        self.pids = [engine.process.pid for engine in engines]
        self.started = time.monotonic()
        self.engines_before = sum(cpu_seconds(pid) for pid in self.pids)
        self.busy_before = machine_busy_seconds()

    def stop(self) -> dict[str, float]:
        """{"engines_cpu_cores", "other_cpu_cores"} since construction."""
        wall = time.monotonic() - self.started
        engines = sum(cpu_seconds(pid) for pid in self.pids) - self.engines_before
        busy = machine_busy_seconds() - self.busy_before
        return {"engines_cpu_cores": engines / wall, "other_cpu_cores": max(0.0, busy - engines) / wall}


def figures(front: str, results: list[Result], wall: float, peaks: list[float], counters: list[dict[str, float]],
            spread_figures: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """One front end's figures (module docstring); the rates and TTFT over the requests the
    pool served (`home`), the third party's apart."""
    ok = [r for r in results if r.status == 200]
    away = [r for r in ok if r.provider == THIRD_PARTY]
    home = [r for r in ok if r.provider != THIRD_PARTY]
    timed = [r for r in home if r.ttft_ms is not None]  # an answer of no content (the model ended at once) has no first token
    cached = sum(c.get("llamacpp:prompt_tokens_cached_total", 0) for c in counters)
    processed = sum(c.get("llamacpp:prompt_tokens_total", 0) for c in counters)
    share = cached / (cached + processed) if cached + processed else 0.0
    return {
        "front": front,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "errors_by_status": dict(sorted(Counter(str(r.status) for r in results if r.status != 200).items())),
        "answers_without_content": len(home) - len(timed),
        "third_party_requests": len(away),
        "third_party_share": len(away) / len(results) if results else 0.0,
        "third_party_ttft_ms": summarize_ms([r.ttft_ms for r in away if r.ttft_ms is not None]),
        "requests_per_second": len(home) / wall if wall else 0.0,
        "output_tokens_per_second": sum(r.output for r in home) / wall if wall else 0.0,
        "ttft_ms": summarize_ms([r.ttft_ms for r in timed]),
        "engine_cache_share": share,
        "engine_cache_share_of_oracle": share / args.oracle["share"] if args.oracle["share"] else math.nan,
        "client_cached_share": sum(r.cached for r in home) / max(1, sum(r.prompt for r in home)),
        "cold_requests": sum(1 for r in home if r.prompt and 2 * r.cached < r.prompt),
        "peak_concurrency_per_engine": peaks,
        "parallel": args.parallel,
        "spread": spread_figures,
        "wall_seconds": wall,
    }


def report(runs: list[dict[str, Any]], skipped: dict[str, str], oracle: dict[str, float], workload: str) -> None:
    rows = []
    for run in runs:
        ttft, where = run["ttft_ms"], run["spread"]
        rows.append([
            run["front"], run["requests"], run["errors"], f"{100 * run['third_party_share']:.0f} %",
            f"{run['requests_per_second']:.2f}", f"{run['output_tokens_per_second']:.1f}",
            " / ".join(f"{ttft.get(f'p{p}_ms', 0):.0f}" for p in (50, 90, 99)),
            f"{100 * run['engine_cache_share']:.1f} %", f"{100 * run['engine_cache_share_of_oracle']:.0f} %",
            f"{run.get('cold_requests', '-')} ({oracle.get('cold_requests', '-')})",
            " / ".join(f"{peak:g}" for peak in run["peak_concurrency_per_engine"]) + f" (of {run['parallel']})",
            f"{where['engines_per_group_mean']:.2f}" if not math.isnan(where["engines_per_group_mean"]) else "-",
            f"{where['sessions_moved']} of {where['sessions_seen']}", sum(where["requests_per_engine"].values()),
            f"{run['engines_cpu_cores']:.2f} / {run['other_cpu_cores']:.2f}",
        ])
    print_table(f"Real engines, workload {workload}: one pool of llama-server, oracle {100 * oracle['share']:.1f} %",
                ["front end", "requests", "errors", "to third party", "req/s (home)", "output tok/s (home)",
                 "TTFT p50 / p90 / p99 ms (home)", "engine cache share", "of oracle", "cold prompts (oracle)",
                 "peak per engine",
                 "engines per group", "sessions moved", "generations carried", "CPU cores: engines / rest"], rows)
    for run in runs:
        if run["spread"]["other_calls_with_prompt"]:
            print(f"{run['front']}: the router's own calls that carried a prompt, by path: {run['spread']['other_calls_with_prompt']}")
    print_figure("oracle_share", oracle["share"])
    for run in runs:
        front = run["front"]
        for p in (50, 90, 99):
            print_figure(f"ttft_p{p}_ms:{front}", run["ttft_ms"][f"p{p}_ms"])
        print_figure(f"errors:{front}", run["errors"])
        print_figure(f"third_party_share:{front}", run["third_party_share"])
        print_figure(f"engine_cache_share:{front}", run["engine_cache_share"])
        print_figure(f"engine_cache_share_of_oracle:{front}", run["engine_cache_share_of_oracle"])
        if "cold_requests" in run:  # aiperf's answers are not read one by one
            print_figure(f"cold_requests:{front}", run["cold_requests"])
        print_figure(f"requests_per_second:{front}", run["requests_per_second"])
        print_figure(f"output_tokens_per_second:{front}", run["output_tokens_per_second"])
        print_figure(f"peak_per_engine:{front}", max(run["peak_concurrency_per_engine"]))
        print_figure(f"sessions_moved:{front}", run["spread"]["sessions_moved"])
        print_figure(f"engines_per_group:{front}", run["spread"]["engines_per_group_mean"])
        print_figure(f"engines_cpu_cores:{front}", run["engines_cpu_cores"])
        print_figure(f"other_cpu_cores:{front}", run["other_cpu_cores"])
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
    parser.add_argument("--workload", choices=WORKLOADS, default="chat", help="chat (a) or groups (b): the module docstring")
    parser.add_argument("--engines", type=int, default=3, help="llama-server processes in the pool")
    parser.add_argument("--parallel", type=int, default=2, help="slots per engine (its --parallel)")
    parser.add_argument("--context", type=int, default=4096, help="context tokens per slot")
    parser.add_argument("--sessions", type=int, default=24, help="chat: conversations of the trace")
    parser.add_argument("--groups", type=int, default=6, help="groups: groups sharing a prefix")
    parser.add_argument("--users", type=int, default=6, help="groups: users per group")
    parser.add_argument("--prefix-blocks", type=int, default=16, help="groups: blocks of the shared prefix")
    parser.add_argument("--user-words", type=int, default=24, help="groups: words of a user's message")
    parser.add_argument("--turns", type=int, default=4, help="turns per session")
    parser.add_argument("--seed", type=int, default=30, help="groups: the draw of blocks and the order of groups")
    parser.add_argument("--words-per-block", type=int, default=48, help="words standing for one 512-token block of the trace")
    parser.add_argument("--max-blocks", type=int, default=12, help="chat: blocks per request at most")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request")
    parser.add_argument("--clients", type=int, default=0,
                        help="concurrent clients (0: 4/3 x the pool's slots for chat, 2 x for groups)")
    parser.add_argument("--queue-wait-ms", type=int, default=2000, help="the *_operator fronts' admission queue wait")
    parser.add_argument("--prefix-weight", type=float, default=None,
                        help="the pick fronts' routing.placement.prefix_weight (default: the config's)")
    parser.add_argument("--fronts", nargs="+", default=list(FRONTS), choices=FRONTS)
    parser.add_argument("--client", choices=("own", "aiperf"), default="own",
                        help="own: this module's driver; aiperf: aiperf's conversations with a prefix pool, sized as groups "
                             "(the fronts without a third party only)")
    parser.add_argument("--aiperf", default="aiperf", help="the aiperf program (its own virtualenv)")
    parser.add_argument("--hf-home", type=Path, default=Path("/tmp/bench-hf"), help="where bench.gguf_tokenizer put the tokenizer")
    parser.add_argument("--trace", type=Path, default=default_trace_path())
    parser.add_argument("--tiny", action="store_true", help="a few short sessions on 2 engines (for the smoke test)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--plot", type=Path, help="write the plot (PNG) here")
    args = parser.parse_args(argv)
    if args.tiny:
        args.engines, args.sessions, args.turns, args.words_per_block, args.max_blocks, args.max_tokens = 2, 2, 2, 12, 4, 2
        args.groups, args.users, args.prefix_blocks, args.user_words = 2, 2, 3, 6
    if not args.clients:
        slots = args.engines * args.parallel
        args.clients = 2 * slots if args.workload == "groups" else math.ceil(4 * slots / 3)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    sessions = build_workload(args)
    args.oracle = oracle_share(sessions)
    runs, skipped = [], {}
    with tempfile.TemporaryDirectory(prefix="bench-real-engines-") as work:
        for front in args.fronts:
            why = front_unavailable(front)
            if not why and args.client == "aiperf":
                why = aiperf_unavailable(args) or (
                    "aiperf cannot tell the third party's answers apart" if front.endswith("_operator") else None)
            if why:
                skipped[front] = why
                continue
            print(f"running {front}...", flush=True)
            runs.append(run_front(front, sessions, args, Path(work) / front))
    if args.client == "aiperf" and runs:  # aiperf sends its own conversations (the same for one seed)
        args.oracle = {"share": runs[0]["oracle_of_what_aiperf_sent"], "of": "the conversations aiperf sent"}
    report(runs, skipped, args.oracle, args.workload)
    result = {"machine": machine_description(), "workload": args.workload, "client": args.client, "oracle": args.oracle,
              "requests": sum(len(s) for s in sessions), "sessions": len(sessions),
              "args": {k: str(v) for k, v in vars(args).items() if k != "oracle"}, "runs": runs, "skipped": skipped}
    write_json(args.json, result)
    if args.plot:
        plot(runs, args.plot)
    return result


if __name__ == "__main__":
    main()
