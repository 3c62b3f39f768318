"""Trace replay: prefix-cache reuse, offloads and limit breaches of routing policies on the Mooncake
conversation trace.

The first `--limit` requests of `conversation_trace.jsonl` are replayed open loop at their trace
times divided by `--speedup`. Each request becomes a streamed chat completion built from its block
ids: block id -> a deterministic chunk of `block_tokens` words (512 x `--token-scale`), one
message per block (block 0, shared by every request, is the system message; block 1 the first user
message; then assistant and user turns alternate), so requests that share leading blocks share
leading messages and the simulated providers, with the same block size, count reuse exactly. A
conversation is the pair of the first two block ids; each conversation has its own user id
(`x-user-id`), which is also what the session is hashed from. `max_tokens` is the trace's output
length x `--token-scale`.

Providers: two own simulated providers (`iris-1`, `iris-2`; small in-flight limits, an LRU block
cache of `--cache-blocks` each, prefill time per uncached token, and a capacity: at most
`--max-num-seqs` generations at once, the others wait, and a decode slower by
`--decode-ms-per-running-seq` per token for every other generation running, so that overload
costs time to first token and latency) and one third party (`tensorx`, no limits and no capacity
limit, otherwise the same simulation). Policies, each on fresh providers (empty caches):

* `router`: the full gateway (Envoy + ext_proc + Redis), the limits in its routing config;
  `router_prefer_previous`: the same with `routing.prefer_previous_provider` on (a session that
  pins again tries the provider of its previous pin first); `router_queue`: the same with the
  admission queue on (`routing.queue`, docs/queue.md: a request that finds the own providers
  full waits up to `--queue-max-wait-ms` for an own slot before the third party);
* `round_robin`, `least_request`, `ring_hash`: Envoy without ext_proc, one cluster over the two own
  providers' endpoints with that load balancer (`ring_hash` hashes the `x-user-id` header). The
  third party is not in these clusters: Envoy's load balancers know no capacity limits, so they
  have no reason to offload, and an equal-weight third endpoint would only send it a fixed share;
* the peers of `bench.peers` (SGLang Model Gateway, vllm-router) over the two own providers, for
  the same reason without the third party; every request carries the user id in `X-Session-ID`
  too (vllm-router's sticky_least_loaded reads it). A peer that is not installed is skipped.

Reported per policy: prefix tokens reused (the providers' `cached_tokens`) as a share of the
oracle (one unbounded cache that sees every request in trace order, computed from the block ids),
for all providers and for the own ones; requests served by the third party, split into those a
routing decision sent there (new pin, offload) and those that followed an earlier pin there;
needless offloads (see `needless_offloads`); of the requests a decision sent to the third party,
those for which an own slot freed within 1 s and 2 s of their send (`slot_freed_within`: what a
queue that waits that long could have kept); limit breaches (the providers' `max_in_flight` over
the configured limit); latency and time-to-first-token percentiles (ms) and errors. With
`router_queue`, the queue's own counters too (offloads avoided, waits timed out, shed), scraped
from the ext_proc server's metrics. The "Queue on and off" table puts `router` and `router_queue`
side by side: third-party share, own-provider reuse, TTFT p99, breaches.

    python -m bench.replay --limit 2000 --speedup 10 --json out/replay.json --plot-dir docs
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import redis.asyncio as aioredis

from bench.common import (
    MODEL,
    Sample,
    check_local,
    default_trace_path,
    load_average,
    load_summary,
    machine_description,
    open_loop,
    plain_envoy_bootstrap,
    pool_cluster,
    print_figure,
    print_table,
    start_envoy,
    start_simulator,
    summarize_ms,
    wait_http_ready,
    write_json,
)
from bench.peers import BY_NAME as PEERS_BY_NAME
from bench.peers import PEERS, SESSION_HEADER, start_peer, unavailable
from extproc.storage.keys import Keyspace
from irislab.local_gateway import LocalGateway, ProviderSimulation
from irislab.processes import free_port

OWN = ("iris-1", "iris-2")
THIRD_PARTY = "tensorx"
ROUTER_POLICIES = ("router", "router_prefer_previous", "router_queue")
POLICIES = (*ROUTER_POLICIES, "round_robin", "least_request", "ring_hash", *(p.name for p in PEERS))

LB_POLICIES = {"round_robin": "ROUND_ROBIN", "least_request": "LEAST_REQUEST", "ring_hash": "RING_HASH"}
USER_HEADER = "x-user-id"
KEY_PREFIX = "replay"
# Router reasons that are a routing decision made for this request (not following a pin).
DECIDED_REASONS = ("new_pin", "repinned", "offloaded", "unpinned")


# ---------------------------------------------------------------------------------------------
# The trace as requests, and the oracle
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceRequest:
    """One replayed request: when (s after the start), who, its blocks, and its JSON body."""

    offset: float
    user: str
    blocks: tuple[int, ...]
    max_tokens: int
    body: bytes


def block_text(block_id: int, words: int) -> str:
    """The deterministic text of a block: `words` words unique to this block id."""
    return " ".join(f"b{block_id}w{i}" for i in range(words))


def messages_for(blocks: tuple[int, ...], words: int) -> list[dict[str, str]]:
    """One message per block: system, user, then assistant and user alternating."""
    messages = []
    for index, block in enumerate(blocks):
        role = "system" if index == 0 else ("user" if index % 2 == 1 else "assistant")
        messages.append({"role": role, "content": block_text(block, words)})
    return messages


def load_trace(path: Path, limit: int, speedup: float, token_scale: float, block_tokens: int) -> list[TraceRequest]:
    """The first `limit` requests of the trace as TraceRequests (times divided by `speedup`,
    output lengths multiplied by `token_scale`)."""
    conversations: dict[tuple[int, ...], str] = {}
    out = []
    with path.open() as lines:
        for line in lines:
            if len(out) >= limit:
                break
            row = json.loads(line)
            blocks = tuple(row["hash_ids"])
            user = conversations.setdefault(blocks[:2], f"conv-{len(conversations)}")
            max_tokens = max(1, round(row["output_length"] * token_scale))
            body = orjson.dumps({
                "model": MODEL,
                "messages": messages_for(blocks, block_tokens),
                "max_tokens": max_tokens,
                "stream": True,
                "stream_options": {"include_usage": True},
            })
            out.append(TraceRequest(row["timestamp"] / 1000 / speedup, user, blocks, max_tokens, body))
    return out


def oracle_reused_blocks(requests: list[TraceRequest]) -> int:
    """Blocks an unbounded cache that sees every request in order would hit, in all."""
    return sum(oracle_hits(requests))


def oracle_hits(requests: list[TraceRequest]) -> list[int]:
    """Per request, the blocks an unbounded cache that sees every request in order would hit:
    the leading blocks whose whole prefix was seen before (as the simulators count), after which
    all of the request's blocks are inserted."""
    seen: set[tuple[int, int]] = set()
    out = []
    for request in requests:
        keys, previous = [], 0
        for block in request.blocks:
            previous = hash((previous, block))
            keys.append((previous, block))
        hits = 0
        while hits < len(keys) and keys[hits] in seen:
            hits += 1
        out.append(hits)
        seen.update(keys)
    return out


# ---------------------------------------------------------------------------------------------
# Running one policy
# ---------------------------------------------------------------------------------------------


def simulation(args: argparse.Namespace, own: bool = True) -> ProviderSimulation:
    """An own provider's simulation (with its capacity), or the third party's (without)."""
    return ProviderSimulation(ttft_ms=args.ttft_ms, per_token_ms=args.per_token_ms,
                              prefill_ms_per_token=args.prefill_ms_per_token,
                              block_tokens=args.block_tokens, cache_blocks=args.cache_blocks,
                              max_num_seqs=args.max_num_seqs if own else 0,
                              decode_ms_per_running_seq=args.decode_ms_per_running_seq if own else 0)


def router_config(args: argparse.Namespace, prefer_previous: bool = False, queue: bool = False) -> dict[str, Any]:
    """Two own providers with small limits and a third party; the pin inactivity timeout is
    `--pin-timeout-seconds` of trace time (default 300 s, the config's default), compressed like it.
    `queue`: the admission queue on, every request of one class waiting up to
    `--queue-max-wait-ms` (real time: the providers' request times are not compressed)."""
    limits = {
        "max_pinned_sessions": args.max_pins,
        "max_global_in_flight_request_slots": args.max_in_flight,
        "global_in_flight_request_slots_reserved_for_pinned_sessions": args.reserved,
        "max_per_session_in_flight_request_slots": args.per_session,
    }
    own = [{"name": name, "kind": "managed", "cluster": name,
            "models": {MODEL: {"features": ["chat"], "limits": limits}}} for name in OWN]
    config: dict[str, Any] = {
        "pin_inactivity_timeout_seconds": args.pin_timeout_seconds / args.speedup,
        "lease_timeout_seconds": 30,
        "redis": {"key_prefix": KEY_PREFIX},
        "session": {"trusted_identity_headers": [USER_HEADER]},  # the replay stands in for an authenticating filter
        "server": {"expose_routing_headers": True},
        "providers": [*own, {"name": THIRD_PARTY, "kind": "unlimited", "cluster": THIRD_PARTY,
                             "models": {MODEL: {"features": ["chat"]}}}],
    }
    if prefer_previous:
        config["routing"] = {"prefer_previous_provider": {"enabled": True,
                                                          "remember_seconds": args.remember_seconds}}
    if queue:
        config["routing"] = {"queue": {"classes": [{"name": "interactive", "max_wait_ms": args.queue_max_wait_ms}],
                                       "default_class": "interactive"}}
    return config


class Sampler:
    """Every `period` s: each own provider's in-flight count from its /stats, and for the router
    the live pins per own provider from Redis. Lists of (t s since start, value)."""

    def __init__(
        self, http: aiohttp.ClientSession, provider_urls: dict[str, str], redis_url: str | None, period: float
    ):
        self.http, self.urls, self.period = http, provider_urls, period
        self.redis = aioredis.Redis.from_url(redis_url) if redis_url else None
        self.keys = Keyspace(KEY_PREFIX)
        self.in_flight: dict[str, list[tuple[float, int]]] = {name: [] for name in OWN}
        self.pins: dict[str, list[tuple[float, int]]] = {name: [] for name in OWN}

    async def run(self, start: float, until: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:  # at least one sample, however short the replay
                t = loop.time() - start
                for name in OWN:
                    async with self.http.get(self.urls[name] + "/stats") as response:
                        self.in_flight[name].append((t, (await response.json())["in_flight"]))
                if self.redis is not None:
                    seconds, micros = await self.redis.time()
                    now = seconds * 1000 + micros // 1000
                    for name in OWN:
                        count = await self.redis.zcount(self.keys.provider_pins(MODEL, name), f"({now}", "+inf")
                        self.pins[name].append((t, count))
                if until.is_set():
                    break
                await asyncio.sleep(self.period)
        finally:
            if self.redis is not None:
                await self.redis.aclose()


async def replay(url: str, provider_urls: dict[str, str], redis_url: str | None, requests: list[TraceRequest],
                 args: argparse.Namespace) -> tuple[list[Sample], Sampler, float]:
    """Send every request at its time (open loop), sampling the providers meanwhile."""
    url = check_local(url) + "/v1/chat/completions"
    connector = aiohttp.TCPConnector(limit=1024, limit_per_host=1024)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        loop = asyncio.get_running_loop()

        async def send(sample: Sample, start: float) -> None:
            request = requests[sample.index]
            headers = {USER_HEADER: request.user, SESSION_HEADER: request.user, "content-type": "application/json"}
            sample.sent = loop.time() - start
            try:
                async with http.post(url, data=request.body, headers=headers) as response:
                    sample.headers = loop.time() - start
                    sample.status = response.status
                    sample.info["provider"] = response.headers.get("x-simulator-name", "")
                    sample.info["reason"] = response.headers.get("x-iris-route-reason", "")
                    async for line in response.content:
                        if math.isnan(sample.first) and line.startswith(b"data: {"):
                            sample.first = loop.time() - start
                        if line.startswith(b"data: {") and b'"usage"' in line:
                            usage = orjson.loads(line[6:]).get("usage") or {}
                            details = usage.get("prompt_tokens_details") or {}
                            sample.info["cached_tokens"] = details.get("cached_tokens", 0)
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                sample.error = type(exc).__name__
            sample.done = loop.time() - start

        sampler = Sampler(http, provider_urls, redis_url, args.sample_seconds)
        stop = asyncio.Event()
        began = time.monotonic()
        sampling = asyncio.create_task(sampler.run(loop.time() + 0.05, stop))
        try:
            samples = await open_loop([r.offset for r in requests], send, args.max_seconds)
        finally:
            stop.set()
            await sampling
        wall = time.monotonic() - began
    return samples, sampler, wall


def provider_stats(provider_urls: dict[str, str]) -> dict[str, dict]:
    import httpx

    return {name: httpx.get(check_local(url) + "/stats", timeout=5).json() for name, url in provider_urls.items()}


def run_policy(policy: str, requests: list[TraceRequest], args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Start fresh providers (and the router, a plain Envoy or a peer), replay, and collect."""
    sim = simulation(args)
    if policy in ROUTER_POLICIES:
        sims = {name: sim for name in OWN} | {THIRD_PARTY: simulation(args, own=False)}
        config = router_config(args, prefer_previous=policy == "router_prefer_previous", queue=policy == "router_queue")
        with LocalGateway(config_data=config, simulations=sims, work_dir=work / policy) as gateway:
            urls = {name: gateway.provider_url(name) for name in (*OWN, THIRD_PARTY)}
            samples, sampler, wall = asyncio.run(replay(gateway.url, urls, gateway.redis_url, requests, args))
            stats = provider_stats(urls)
            queue = queue_counters([i.metrics_url for i in gateway.running]) if policy == "router_queue" else None
        return {"policy": policy, "samples": samples, "sampler": sampler, "wall": wall, "stats": stats, "queue": queue}
    else:
        folder = work / policy
        providers = {name: start_simulator(name, sim, folder) for name in OWN}
        envoy = None
        try:
            urls = {name: f"http://127.0.0.1:{providers[name].port}" for name in OWN}
            if policy in PEERS_BY_NAME:
                envoy = start_peer(PEERS_BY_NAME[policy], list(urls.values()), folder)
            else:
                cluster = pool_cluster("own-pool", [providers[name].port for name in OWN], LB_POLICIES[policy])
                bootstrap = plain_envoy_bootstrap(
                    free_port(), free_port(), {}, target_cluster="own-pool", extra_clusters=[cluster],
                    hash_header=USER_HEADER if policy == "ring_hash" else None)
                envoy = start_envoy(bootstrap, folder, f"envoy-{policy}")
            url = f"http://127.0.0.1:{envoy.port}"
            wait_http_ready(url + "/health")
            for name in OWN:  # start every counter from zero
                reset_stats(urls[name])
            samples, sampler, wall = asyncio.run(replay(url, urls, None, requests, args))
            stats = provider_stats(urls)
        finally:
            if envoy is not None:
                envoy.stop()
            for process in providers.values():
                process.stop()
    return {"policy": policy, "samples": samples, "sampler": sampler, "wall": wall, "stats": stats}


QUEUE_COUNTERS = {
    "iris_queue_offloads_avoided": "offloads_avoided",
    "iris_queue_timeouts": "timed_out",
    "iris_queue_shed": "shed",
}


def queue_counters(metrics_urls: list[str]) -> dict[str, float]:
    """The admission queue's counters summed over the ext_proc servers' metrics endpoints:
    requests served by an own provider after waiting, waits that timed out, requests shed."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out = dict.fromkeys(QUEUE_COUNTERS.values(), 0.0)
    for url in metrics_urls:
        for family in text_string_to_metric_families(httpx.get(url, timeout=5).text):
            if family.name in QUEUE_COUNTERS:
                out[QUEUE_COUNTERS[family.name]] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return out


def reset_stats(url: str) -> None:
    """POST /stats/reset on a simulator."""
    import httpx

    httpx.post(check_local(url) + "/stats/reset", timeout=5)


# ---------------------------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------------------------


def pin_providers(samples: list[Sample], requests: list[TraceRequest]) -> dict[int, str]:
    """For each request index, the provider its session was pinned to when it was sent, as far
    as the earlier answers' reasons tell (router only)."""
    pinned: dict[str, str] = {}
    out: dict[int, str] = {}
    for sample in sorted(samples, key=lambda s: s.sent):
        user = requests[sample.index].user
        if user in pinned:
            out[sample.index] = pinned[user]
        if sample.info.get("reason") in ("new_pin", "pinned", "repinned"):
            pinned[user] = sample.info["provider"]
    return out


def decided_offloads(samples: list[Sample]) -> list[Sample]:
    """The samples a routing decision sent to the third party (reasons in DECIDED_REASONS)."""
    return [s for s in samples if s.info.get("provider") == THIRD_PARTY and s.info.get("reason") in DECIDED_REASONS]


def needless_offloads(samples: list[Sample], requests: list[TraceRequest], sampler: Sampler,
                      args: argparse.Namespace) -> list[int]:
    """Indexes of requests a routing decision sent to the third party while an own provider that
    could have taken them had unreserved room.

    A request counts when it was served by the third party with reason new_pin, repinned,
    offloaded or unpinned (requests that merely follow an earlier pin there are not a decision),
    and some own provider P, other than the session's pin for an offload (the router may not
    offload to the full pin's provider), had room during the whole decision window, from the
    client's send to the response headers:

    * in flight: fewer than `max_in_flight - reserved` requests on P whose interval
      [sent, done + margin] overlaps the window. This over-counts P's leases (a lease starts
      after the send and is released within `margin` of the end), so "room" is conservative;
    * pins (for a new pin or repin only): every Redis sample of P's live pins from one sample
      period before the window to one after was below `max_pins`.
    """
    unreserved = args.max_in_flight - args.reserved
    margin = args.release_margin_ms / 1000
    by_provider = {name: [s for s in samples if s.info.get("provider") == name and not math.isnan(s.done)]
                   for name in OWN}
    pins_of = pin_providers(samples, requests)
    out = []
    for sample in decided_offloads(samples):
        reason = sample.info["reason"]
        start, end = sample.sent, sample.headers
        for name in OWN:
            if reason == "offloaded" and pins_of.get(sample.index) == name:
                continue
            busy = sum(1 for q in by_provider[name] if q.sent <= end and q.done + margin >= start)
            if busy >= unreserved:
                continue
            if reason in ("new_pin", "repinned"):
                period = args.sample_seconds
                window = [c for t, c in sampler.pins[name] if start - period <= t <= end + period]
                if not window or max(window) >= args.max_pins:
                    continue
            out.append(sample.index)
            break
    return out


def slot_freed_within(samples: list[Sample], requests: list[TraceRequest], sampler: Sampler,
                      args: argparse.Namespace, seconds: float) -> list[int]:
    """Indexes of requests a routing decision sent to the third party (reasons as in
    `needless_offloads`) for which some own provider had a slot the request could use at some
    moment within `seconds` of its send: what an admission queue waiting that long could have
    served on an own provider. A slot is counted busy over [sent, done + margin] of each request
    the provider served (conservative: a lease starts after the send); a new pin or repin also
    needs the provider's pins below `max_pins` (every Redis sample from one sample period before
    the send to one after that moment); an offload counts its pin's provider too, whose reserved
    slots it may use."""
    margin = args.release_margin_ms / 1000
    by_provider = {}
    for name in OWN:
        served = [s for s in samples if s.info.get("provider") == name and not math.isnan(s.done)]
        by_provider[name] = (sorted(s.sent for s in served), sorted(s.done + margin for s in served))
    pins_of = pin_providers(samples, requests)
    out = []
    for sample in decided_offloads(samples):
        reason = sample.info["reason"]
        start, end = sample.sent, sample.sent + seconds
        for name in OWN:
            starts, ends = by_provider[name]
            limit = args.max_in_flight if reason == "offloaded" and pins_of.get(sample.index) == name else args.max_in_flight - args.reserved
            moments = [start, *ends[bisect.bisect_right(ends, start):bisect.bisect_right(ends, end)]]
            free = [t for t in moments if bisect.bisect_right(starts, t) - bisect.bisect_right(ends, t) < limit]
            if free and reason in ("new_pin", "repinned"):
                period = args.sample_seconds
                window = [c for t, c in sampler.pins[name] if start - period <= t <= free[0] + period]
                free = free if window and max(window) < args.max_pins else []
            if free:
                out.append(sample.index)
                break
    return out


def moved_losses(ok: list[Sample], requests: list[TraceRequest], hits: list[int],
                 block_tokens: int) -> tuple[int, int, dict[str, int]]:
    """Reuse lost (oracle hits minus cached tokens, in tokens) by requests served on another
    provider than their conversation's previous request: (all of them, those a new pin sent
    there, i.e. the session's pin had expired and it pinned elsewhere, and the count of the
    latter by move, "previous->new" provider)."""
    last: dict[str, str] = {}
    moved = repinned = 0
    moves: dict[str, int] = {}
    for sample in sorted(ok, key=lambda s: s.sent):
        user, provider = requests[sample.index].user, sample.info.get("provider", "")
        previous = last.get(user)
        last[user] = provider
        if previous is None or previous == provider:
            continue
        missed = max(0, hits[sample.index] * block_tokens - sample.info.get("cached_tokens", 0))
        moved += missed
        if sample.info.get("reason") == "new_pin":
            repinned += missed
            moves[f"{previous}->{provider}"] = moves.get(f"{previous}->{provider}", 0) + 1
    return moved, repinned, moves


def policy_figures(run: dict[str, Any], requests: list[TraceRequest], oracle_tokens: int,
                   args: argparse.Namespace) -> dict[str, Any]:
    samples: list[Sample] = run["samples"]
    stats = run["stats"]
    summary = load_summary(samples, run["wall"])
    ok = [s for s in samples if s.ok]
    cached_all = sum(s["cached_tokens"] for s in stats.values())
    cached_own = sum(stats[name]["cached_tokens"] for name in OWN)
    third = [s for s in samples if s.info.get("provider") == THIRD_PARTY]
    by_reason: dict[str, int] = {}
    for s in third:
        by_reason[s.info.get("reason") or "-"] = by_reason.get(s.info.get("reason") or "-", 0) + 1
    needless = needless_offloads(samples, requests, run["sampler"], args) if run["policy"] == "router" else []
    router = run["policy"] in ROUTER_POLICIES
    freed = {w: len(slot_freed_within(samples, requests, run["sampler"], args, w)) if router else 0 for w in (1.0, 2.0)}
    # Where reuse was lost: the oracle's hits minus the tokens the provider found cached, per
    # request, summed by where the request went (and why, for the router).
    hits = oracle_hits(requests)
    lost: dict[str, int] = {}
    for s in ok:
        where = s.info.get("provider", "?") + (f" ({s.info['reason']})" if s.info.get("reason") else "")
        missed = hits[s.index] * args.block_tokens - s.info.get("cached_tokens", 0)
        lost[where] = lost.get(where, 0) + missed
    moved_lost, repinned_elsewhere_lost, repinned_elsewhere = moved_losses(ok, requests, hits, args.block_tokens)
    ttft = summarize_ms([(s.first - s.sent) * 1000 for s in ok if not math.isnan(s.first)])
    max_in_flight = {name: stats[name]["max_in_flight"] for name in OWN}
    over_samples = sum(1 for name in OWN for _, c in run["sampler"].in_flight[name] if c > args.max_in_flight)
    all_samples = sum(len(run["sampler"].in_flight[name]) for name in OWN)
    return {
        "policy": run["policy"],
        "sent": summary["sent"],
        "ok": summary["ok"],
        "errors": summary["errors"],
        "statuses": summary["statuses"],
        "reuse_share_of_oracle": cached_all / oracle_tokens if oracle_tokens else math.nan,
        "own_reuse_share_of_oracle": cached_own / oracle_tokens if oracle_tokens else math.nan,
        "cached_tokens": {name: s["cached_tokens"] for name, s in stats.items()},
        "prompt_tokens": {name: s["prompt_tokens"] for name, s in stats.items()},
        "requests_by_provider": {name: sum(1 for s in samples if s.info.get("provider") == name)
                                 for name in (*OWN, THIRD_PARTY)},
        "third_party_requests": len(third),
        "third_party_share": len(third) / summary["sent"] if summary["sent"] else math.nan,
        "third_party_decided": sum(v for k, v in by_reason.items() if k in DECIDED_REASONS),
        "third_party_with_own_slot_within_1s": freed[1.0],
        "third_party_with_own_slot_within_2s": freed[2.0],
        "queue": run.get("queue"),
        "third_party_by_reason": by_reason,
        "reuse_lost_share_of_oracle_by_destination": {k: v / oracle_tokens for k, v in sorted(lost.items())}
        if oracle_tokens else {},
        "needless_offloads": len(needless),
        "reuse_lost_share_of_oracle": 1 - cached_all / oracle_tokens if oracle_tokens else math.nan,
        "reuse_lost_moved_share_of_oracle": moved_lost / oracle_tokens if oracle_tokens else math.nan,
        "reuse_lost_repinned_elsewhere_share_of_oracle": repinned_elsewhere_lost / oracle_tokens
        if oracle_tokens else math.nan,
        "repinned_elsewhere_requests": sum(repinned_elsewhere.values()),
        "repinned_elsewhere_by_move": repinned_elsewhere,
        "queued_requests": sum(stats[name].get("queued_requests", 0) for name in OWN),
        "max_waiting": max(stats[name].get("max_waiting", 0) for name in OWN),
        "max_in_flight": max_in_flight,
        "limit": args.max_in_flight,
        "breaches": sum(1 for v in max_in_flight.values() if v > args.max_in_flight),
        "worst_excess": max(0, max(max_in_flight.values()) - args.max_in_flight),
        "samples_over_limit_share": over_samples / all_samples if all_samples else math.nan,
        **{f"latency_{k}": v for k, v in summarize_ms([s.latency_ms for s in ok]).items()},
        **{f"ttft_{k}": v for k, v in ttft.items()},
        "in_flight_samples": {name: run["sampler"].in_flight[name] for name in OWN},
    }


def report(result: dict[str, Any]) -> None:
    rows = []
    for p in result["policies"]:
        rows.append([p["policy"], p["ok"], p["errors"], p["reuse_share_of_oracle"], p["own_reuse_share_of_oracle"],
                     p["third_party_requests"], p["third_party_decided"], p["needless_offloads"],
                     f"{max(p['max_in_flight'].values())}/{p['limit']}", p["breaches"], p.get("queued_requests", "-"),
                     p["latency_p50_ms"], p["latency_p90_ms"], p["latency_p99_ms"], p["ttft_p50_ms"], p["ttft_p99_ms"]])
    for name, reason in result.get("skipped_policies", {}).items():
        print(f"policy {name} skipped: {reason}")
    print_table(
        f"Replay of {result['requests']} requests (oracle reuse {result['oracle_share']:.3f} of prompt tokens)",
        ["policy", "ok", "errors", "reuse/oracle", "own reuse/oracle", "3rd-party reqs", "3rd-party decided",
         "needless offloads", "max in flight/limit", "providers breached", "requests queued (own)", "p50 ms",
         "p90 ms", "p99 ms", "TTFT p50 ms", "TTFT p99 ms"], rows)
    print_table("Reuse lost against the oracle (share of the oracle's reused tokens)",
                ["policy", "lost in all", "on another provider than the previous turn",
                 "of which a new pin elsewhere (pin expired)", "requests re-pinned elsewhere", "by move"],
                [[p["policy"], p.get("reuse_lost_share_of_oracle", "-"), p.get("reuse_lost_moved_share_of_oracle", "-"),
                  p.get("reuse_lost_repinned_elsewhere_share_of_oracle", "-"), p.get("repinned_elsewhere_requests", "-"),
                  ", ".join(f"{k} {v}" for k, v in sorted(p.get("repinned_elsewhere_by_move", {}).items())) or "-"]
                 for p in result["policies"]])
    print_table("Third-party requests a decision sent there, and an own slot free within 1 s / 2 s of their send",
                ["policy", "3rd-party decided", "own slot within 1 s", "own slot within 2 s"],
                [[p["policy"], p["third_party_decided"], p.get("third_party_with_own_slot_within_1s", "-"),
                  p.get("third_party_with_own_slot_within_2s", "-")] for p in result["policies"] if p["policy"] in ROUTER_POLICIES])
    compared = {p["policy"]: p for p in result["policies"] if p["policy"] in ("router", "router_queue")}
    if compared:
        print_table(f"Queue on and off (router_queue: max_wait_ms {result['args'].get('queue_max_wait_ms')})",
                    ["policy", "3rd-party share", "own reuse/oracle", "TTFT p99 ms", "providers breached", "max in flight/limit",
                     "offloads avoided", "waits timed out", "shed"],
                    [[name, p["third_party_share"], p["own_reuse_share_of_oracle"], p["ttft_p99_ms"], p["breaches"],
                      f"{max(p['max_in_flight'].values())}/{p['limit']}",
                      *((p["queue"] or {}).get(k, "-") for k in ("offloads_avoided", "timed_out", "shed"))]
                     for name, p in compared.items()])
    lost_rows = [[p["policy"], where, share] for p in result["policies"]
            for where, share in p.get("reuse_lost_share_of_oracle_by_destination", {}).items() if share]
    print_table("Reuse lost against the oracle (share of the oracle's reused tokens), by destination",
                ["policy", "served by (reason)", "lost share"], lost_rows)
    print()
    print_figure("oracle_reused_tokens", result["oracle_reused_tokens"])
    print_figure("oracle_share_of_prompt_tokens", result["oracle_share"])
    for p in result["policies"]:
        name = p["policy"]
        for key in ("reuse_share_of_oracle", "own_reuse_share_of_oracle", "third_party_requests", "third_party_share",
                    "third_party_decided", "third_party_with_own_slot_within_1s", "third_party_with_own_slot_within_2s",
                    "needless_offloads", "breaches", "worst_excess", "errors",
                    "queued_requests", "reuse_lost_moved_share_of_oracle",
                    "reuse_lost_repinned_elsewhere_share_of_oracle", "latency_p50_ms",
                    "latency_p90_ms", "latency_p99_ms", "ttft_p50_ms", "ttft_p99_ms"):
            print_figure(f"{key}@{name}", p.get(key, math.nan))
        for key, value in (p.get("queue") or {}).items():
            print_figure(f"queue_{key}@{name}", value)


def plot(result: dict[str, Any], plot_dir: Path) -> list[Path]:
    """replay_reuse.png (reuse share of the oracle and latency per policy) and
    replay_inflight.png (iris-1's in-flight requests over time against its limit, per policy)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plot_dir.mkdir(parents=True, exist_ok=True)
    policies = result["policies"]
    names = [p["policy"] for p in policies]
    fig, (left, right) = plt.subplots(1, 2, figsize=(15, 4.8))
    xs = range(len(names))
    left.bar([x - 0.2 for x in xs], [p["reuse_share_of_oracle"] for p in policies], 0.4, label="all providers")
    left.bar([x + 0.2 for x in xs], [p["own_reuse_share_of_oracle"] for p in policies], 0.4, label="own providers")
    left.axhline(0.98, color="grey", linestyle=":", label="target 0.98")
    left.set_xticks(list(xs), names, rotation=30, ha="right", fontsize=8)
    left.set_ylabel("prefix tokens reused / oracle")
    left.set_ylim(0, 1.05)
    left.legend(loc="lower right", fontsize=8)
    left.set_title("Prefix-cache reuse")
    for key, offset, label in (("latency_p50_ms", -0.27, "latency p50"), ("latency_p99_ms", 0, "latency p99"),
                               ("ttft_p99_ms", 0.27, "TTFT p99")):
        right.bar([x + offset for x in xs], [p[key] for p in policies], 0.27, label=label)
    right.set_xticks(list(xs), names, rotation=30, ha="right", fontsize=8)
    right.set_ylabel("ms")
    right.legend(fontsize=8)
    right.set_title("Request latency and time to first token (own providers' capacity on)")
    fig.suptitle(f"Mooncake trace replay, {result['requests']} requests")
    fig.tight_layout()
    reuse = plot_dir / "replay_reuse.png"
    fig.savefig(reuse, dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(len(policies), 1, figsize=(11, 1.9 * len(policies)), sharex=True, squeeze=False)
    for ax, p in zip(axes[:, 0], policies):
        samples = p["in_flight_samples"]["iris-1"]
        ax.plot([t for t, _ in samples], [c for _, c in samples], linewidth=0.8, label="iris-1 in flight")
        ax.axhline(p["limit"], color="red", linestyle="--", linewidth=1, label="limit")
        ax.set_ylabel(p["policy"], fontsize=9)
    axes[0, 0].legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("replay time (s)")
    fig.suptitle("Own provider iris-1: requests in flight (sampled from /stats) against its limit")
    fig.tight_layout()
    inflight = plot_dir / "replay_inflight.png"
    fig.savefig(inflight, dpi=110)
    plt.close(fig)
    return [reuse, inflight]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.replay", description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=default_trace_path(), help="conversation_trace.jsonl")
    parser.add_argument("--limit", type=int, default=2000, help="replay the first N requests")
    parser.add_argument("--speedup", type=float, default=10.0, help="time compression factor")
    parser.add_argument("--token-scale", type=float, default=1 / 32, help="token counts multiplied by this")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help=f"comma-separated, from {','.join(POLICIES)}")
    parser.add_argument("--cache-blocks", type=int, default=16384, help="LRU blocks per provider")
    parser.add_argument("--max-in-flight", type=int, default=6, help="own providers' global in-flight limit")
    parser.add_argument("--reserved", type=int, default=2, help="slots reserved for pinned sessions")
    parser.add_argument("--per-session", type=int, default=2, help="in-flight slots per session")
    parser.add_argument("--max-pins", type=int, default=400, help="pinned sessions per own provider")
    parser.add_argument("--pin-timeout-seconds", type=float, default=300.0,
                        help="the router's pin inactivity timeout, in trace time (s; compressed like it)")
    parser.add_argument("--max-num-seqs", type=int, default=6,
                        help="own providers' capacity: generations at once, the others wait (0: no limit)")
    parser.add_argument("--decode-ms-per-running-seq", type=float, default=1.0,
                        help="own providers: extra ms per token for every other generation running")
    parser.add_argument("--queue-max-wait-ms", type=int, default=2000,
                        help="router_queue: how long a request may wait for an own slot (ms, real time; "
                             "below Envoy's ext_proc message timeout minus the decision timeout)")
    parser.add_argument("--remember-seconds", type=float,
                        help="router_prefer_previous: how long a previous provider is remembered (s); "
                             "default 3600 s of trace time, compressed like it")
    parser.add_argument("--ttft-ms", type=float, default=20.0)
    parser.add_argument("--per-token-ms", type=float, default=10.0)
    parser.add_argument("--prefill-ms-per-token", type=float, default=0.4, help="per uncached (scaled) token")
    parser.add_argument("--sample-seconds", type=float, default=0.05, help="provider sampling period (s)")
    parser.add_argument("--release-margin-ms", type=float, default=20.0,
                        help="a lease may outlive the client's view of its request by this much (ms)")
    parser.add_argument("--max-seconds", type=float, help="stop sending after this long (s); default: trace span + 30")
    parser.add_argument("--tiny", action="store_true", help="a few seconds per policy (for the smoke test)")
    parser.add_argument("--json", type=Path, help="write the full result here")
    parser.add_argument("--plot-dir", type=Path, help="write replay_reuse.png and replay_inflight.png here")
    parser.add_argument("--from-json", type=Path, help="report (and plot) a result saved with --json; no run")
    args = parser.parse_args(argv)
    if args.tiny:
        args.limit, args.speedup, args.cache_blocks = 40, 40.0, 2048
    args.policies = [p for p in args.policies.split(",") if p]
    unknown = set(args.policies) - set(POLICIES)
    if unknown:
        parser.error(f"unknown policies {sorted(unknown)}; choose from {list(POLICIES)}")
    args.block_tokens = max(1, round(512 * args.token_scale))
    if args.remember_seconds is None:
        args.remember_seconds = 3600 / args.speedup
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.from_json:
        result = json.loads(args.from_json.read_text())
    else:
        result = measure(args)
        write_json(args.json, result)
    print(f"machine: {result['machine']}; 1-min load average before {result.get('load_average_before')}, after "
          f"{result['machine']['load_average_1min']}")
    report(result)
    if args.plot_dir:
        for path in plot(result, args.plot_dir):
            print(f"plot: {path}")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Replay the trace with every policy of `args.policies`; returns the result document."""
    requests = load_trace(args.trace, args.limit, args.speedup, args.token_scale, args.block_tokens)
    if args.max_seconds is None:
        args.max_seconds = (requests[-1].offset if requests else 0) + 30
    oracle_blocks = oracle_reused_blocks(requests)
    total_blocks = sum(len(r.blocks) for r in requests)
    result: dict[str, Any] = {
        "load_average_before": load_average(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "requests": len(requests),
        "trace_seconds": requests[-1].offset * args.speedup if requests else 0,
        "oracle_reused_tokens": oracle_blocks * args.block_tokens,
        "oracle_share": oracle_blocks / total_blocks if total_blocks else math.nan,
        "policies": [],
    }
    result["skipped_policies"] = {}
    with tempfile.TemporaryDirectory(prefix="iris-bench-replay-") as tmp:
        for policy in args.policies:
            reason = unavailable(PEERS_BY_NAME[policy]) if policy in PEERS_BY_NAME else None
            if reason is not None:
                print(f"skipping {policy}: {reason}", flush=True)
                result["skipped_policies"][policy] = reason
                continue
            print(f"replaying {len(requests)} requests with {policy} ...", flush=True)
            run = run_policy(policy, requests, args, Path(tmp))
            result["policies"].append(policy_figures(run, requests, result["oracle_reused_tokens"], args))
    result["machine"] = machine_description()
    return result


if __name__ == "__main__":
    main()
