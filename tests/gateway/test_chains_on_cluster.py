"""Responses chain records on a real 3-primary Redis Cluster (irislab.redis_topologies) with one
model's primary paused (`CLIENT PAUSE ALL`): review of issue 29's fixes, item 3.

A lookup by id names no model, so `ResponseChains.find` asks every model a response may belong
to; each model's records live in its own slot. One GET per model, each on its own: a record of a
model whose primary answers is found, and found at once, while another model's primary does not
answer (before: one pipeline of every model's GETs raised TimeoutError, so every lookup by id was
503 `routing_unavailable`); nothing found and some model unreadable raises ChainRecordsUnreadable
naming that model only. A Responses turn that switches model (the stream loop's fallback,
`ExternalProcessor._chain_of`) keeps its chain's binding, and a failure of the fallback counts
against the unreadable model, never against the requesting one (before: against the requesting
model, whose scope three such turns opened)."""

from __future__ import annotations

import time

import orjson
import pytest

from extproc.config import parse_config
from extproc.openai_api.chains import ChainLink, ChainRecordsUnreadable
from extproc.openai_api.request import parse_request
from extproc.protocol.live import build_live
from extproc.protocol.stream import ExternalProcessor, StreamState
from extproc.routing.degraded import DegradedFlags
from extproc.routing.outage import RedisBreaker
from extproc.storage.client import open_redis
from extproc.storage.keys import Keyspace
from irislab.redis_topologies import LocalCluster

PREFIX = "t"
PAUSE_MS = 20_000  # only bounds the pause: each test lifts it (CLIENT UNPAUSE) when done
SOCKET_TIMEOUT_SECONDS = 0.5  # redis.socket_timeout_seconds (the default): a GET to the paused primary fails after it


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalCluster(tmp_path_factory.mktemp("cluster"), primaries=3, replicas=0) as topology:
        yield topology


@pytest.fixture(scope="module")
def models(cluster) -> dict[str, str]:
    """{role: model name}: `asking` (the turn's model) and `storing` (where the response is
    recorded) on primaries other than `paused`'s."""
    keys = Keyspace(PREFIX)
    candidates = [f"model{i}" for i in range(64)]
    paused = candidates[0]
    port = cluster.primary_for(keys.tag(paused)).port
    others = [m for m in candidates if cluster.primary_for(keys.tag(m)).port != port]
    return {"paused": paused, "asking": others[0], "storing": others[1]}


def config(cluster, models: dict[str, str]):
    limits = {"max_pinned_sessions": 8, "max_global_in_flight_request_slots": 8,
              "global_in_flight_request_slots_reserved_for_pinned_sessions": 0, "max_per_session_in_flight_request_slots": 4}
    served = {m: {"features": ["chat", "responses"], "limits": limits} for m in models.values()}
    return parse_config({
        "providers": [{"name": "iris-1", "kind": "managed", "cluster": "iris-1", "models": served}],
        "redis": {"cluster": {"nodes": cluster.seeds}, "key_prefix": PREFIX},
    })


class Paused:
    """`CLIENT PAUSE ALL` on the primary of `model`'s slot, lifted on exit."""

    def __init__(self, cluster, model: str):
        self.client = cluster.client(cluster.primary_for(Keyspace(PREFIX).tag(model)))

    def __enter__(self):
        self.client.execute_command("CLIENT", "PAUSE", PAUSE_MS, "ALL")
        return self

    def __exit__(self, *exc) -> None:
        self.client.execute_command("CLIENT", "UNPAUSE")


async def test_find_answers_from_the_models_that_answer(cluster, models):
    settings = config(cluster, models)
    redis = open_redis(settings.redis)
    live = build_live(settings, redis, DegradedFlags(redis, settings), b"secret")
    chains = live.chains
    link = ChainLink("session", "iris-1")
    try:
        await chains.record(models["storing"], "alice", "resp_1", link)
        asked = [models["paused"], models["asking"], models["storing"]]  # the paused model first
        with Paused(cluster, models["paused"]):
            started = time.monotonic()
            found = await chains.find("alice", "resp_1", asked)
            took = time.monotonic() - started
            print(f"find with one primary paused: {found} in {took:.3f} s")
            assert found == (models["storing"], link)
            assert took < SOCKET_TIMEOUT_SECONDS  # not held up by the paused primary
            with pytest.raises(ChainRecordsUnreadable) as unreadable:
                await chains.find("alice", "resp_unknown", asked)
            assert set(unreadable.value.errors) == {models["paused"]}
        assert await chains.find("alice", "resp_unknown", asked) is None
    finally:
        await redis.aclose()


async def test_a_model_switching_turn_keeps_its_chain_and_charges_no_healthy_model(cluster, models):
    settings = config(cluster, models)
    redis = open_redis(settings.redis)
    live = build_live(settings, redis, DegradedFlags(redis, settings), b"secret")
    breaker = RedisBreaker(redis)
    processor = ExternalProcessor(live, None, breaker)

    def turn(previous: str):
        body = {"model": models["asking"], "input": "and then?", "previous_response_id": previous}
        return parse_request("responses", orjson.dumps(body), settings.session.completions_prefix_chars)

    identity = processor.sessions.identity(StreamState().signals, turn("resp_1"))
    await live.chains.record(models["storing"], identity, "resp_1", ChainLink("chain-session", "iris-1"))
    try:
        with Paused(cluster, models["paused"]):
            for _ in range(breaker.failures_in_a_row):
                request = await processor._routing_request(StreamState(), turn("resp_1"))
                assert request.required_provider == "iris-1"  # the chain's binding holds
                assert request.session_id is not None
                request = await processor._routing_request(StreamState(), turn("resp_unknown"))
                assert request.required_provider is None
            print(f"failure runs after {breaker.failures_in_a_row} turns of each kind: {dict(breaker.failures)}")
            assert breaker.failures[models["asking"]] == 0
            assert not breaker.open_for(models["asking"])
            assert breaker.open_for(models["paused"])  # its records could not be read, three times
    finally:
        await redis.aclose()
