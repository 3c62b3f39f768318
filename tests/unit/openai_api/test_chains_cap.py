"""Responses chain records are bounded per model (session.max_response_chains), as pins are: a
response beyond the cap is not recorded; one whose record expired frees its place; a refresh
keeps a record's place without counting twice."""

from __future__ import annotations

import asyncio

from extproc.config import parse_config
from extproc.openai_api.chains import ChainLink, ResponseChains
from tests.support.configs import small_config_data


def chains(redis_client, redis_url, cap: int, pin_seconds: float = 300.0) -> ResponseChains:
    data = small_config_data(redis_url, pin_inactivity_timeout_seconds=pin_seconds, lease_timeout_seconds=0.05)
    data["session"] = {"max_response_chains": cap}
    return ResponseChains(redis_client, parse_config(data), b"secret")


async def test_records_beyond_the_cap_are_refused_until_one_expires(redis_client, redis_url):
    bounded = chains(redis_client, redis_url, cap=2, pin_seconds=0.2)
    link = ChainLink("session", "iris-1")
    assert await bounded.record("m", "alice", "resp_1", link)
    assert await bounded.record("m", "alice", "resp_2", link)
    assert await bounded.record("m", "alice", "resp_1", link)  # the same record again takes no new place
    assert not await bounded.record("m", "bob", "resp_3", link)
    assert await bounded.lookup("m", "bob", "resp_3") is None
    assert await bounded.record("e", "bob", "resp_3", link)  # another model has its own cap
    await asyncio.sleep(0.35)  # resp_1 and resp_2 expire (TTL 0.25 s)
    assert await bounded.record("m", "bob", "resp_3", link)
    assert await bounded.lookup("m", "bob", "resp_3") == link


async def test_a_refresh_keeps_the_record_and_a_gone_one_stays_gone(redis_client, redis_url):
    bounded = chains(redis_client, redis_url, cap=10, pin_seconds=0.2)
    link = ChainLink("session", None)
    assert await bounded.record("m", "alice", "resp_1", link)
    for _ in range(4):  # 0.4 s in all, past the 0.25 s TTL, refreshed every 0.1 s
        await asyncio.sleep(0.1)
        await bounded.refresh("m", "alice", "resp_1")
    assert await bounded.lookup("m", "alice", "resp_1") == link
    await bounded.refresh("m", "alice", "never_recorded")
    assert await bounded.lookup("m", "alice", "never_recorded") is None
    assert await redis_client.zcard(bounded.keys.response_chains("m")) == 1


async def test_find_looks_under_every_model_and_forget_frees_the_place(redis_client, redis_url):
    """A request by id names no model: `find` asks every model at once; `forget` (after a
    delete) removes the record and its place under the cap."""
    bounded = chains(redis_client, redis_url, cap=1)
    link = ChainLink("session", "iris-2")
    assert await bounded.record("e", "alice", "resp_1", link)
    assert await bounded.find("alice", "resp_1", ["m", "e"]) == ("e", link)
    assert await bounded.find("bob", "resp_1", ["m", "e"]) is None  # another identity finds nothing
    assert await bounded.find("alice", "resp_1", ["m"]) is None and await bounded.find("alice", "resp_1", []) is None
    assert not await bounded.record("e", "alice", "resp_2", link)  # the cap of 1 is taken
    await bounded.forget("e", "alice", "resp_1")
    assert await bounded.find("alice", "resp_1", ["m", "e"]) is None
    assert await bounded.record("e", "alice", "resp_2", link)  # its place is free again


async def test_a_running_response_keeps_its_longer_ttl_until_an_answer_says_it_ended(redis_client, redis_url):
    """A background response's record lives the background TTL (here 60 s against a chain TTL of
    0.25 s); a refresh never shortens it, nor the record's place under the cap; `ended` does."""
    data = small_config_data(redis_url, pin_inactivity_timeout_seconds=0.2, lease_timeout_seconds=0.05)
    data["session"] = {"max_response_chains": 10, "background_response_ttl_seconds": 60}
    bounded = ResponseChains(redis_client, parse_config(data), b"secret")
    key, places = bounded.key("m", "alice", "resp_1"), bounded.keys.response_chains("m")
    assert await bounded.record("m", "alice", "resp_1", ChainLink("session", "iris-1"), running=True)
    assert 59_000 < await redis_client.pttl(key) <= 60_000
    assert await bounded.refresh("m", "alice", "resp_1")  # a poll whose status was not read
    assert 59_000 < await redis_client.pttl(key) <= 60_000
    await asyncio.sleep(0.35)  # past the chain TTL: the record and its place stay
    assert await bounded.lookup("m", "alice", "resp_1") is not None and await redis_client.zcard(places) == 1
    assert await bounded.refresh("m", "alice", "resp_1", running=False, ended=True)  # completed
    assert await redis_client.pttl(key) <= 250
    await asyncio.sleep(0.35)
    assert await bounded.lookup("m", "alice", "resp_1") is None
    assert not await bounded.refresh("m", "alice", "resp_1", running=True)  # gone stays gone


async def test_a_record_keeps_the_endpoint_that_stores_the_response(redis_client, redis_url):
    """Affinity pick: the record keeps the replica (`ip:port`) the response was generated on,
    for lookups by id and chained turns; a refresh keeps it; an older release's two-element
    record reads without one."""
    bounded = chains(redis_client, redis_url, cap=10)
    link = ChainLink("session", "iris-1", "10.0.0.7:8000")
    assert await bounded.record("m", "alice", "resp_1", link)
    assert await bounded.refresh("m", "alice", "resp_1")
    assert await bounded.lookup("m", "alice", "resp_1") == link
    assert await bounded.find("alice", "resp_1", ["e", "m"]) == ("m", link)
    await redis_client.set(bounded.key("m", "alice", "resp_old"), b'["session","iris-1"]')
    assert await bounded.lookup("m", "alice", "resp_old") == ChainLink("session", "iris-1", None)
    for unreadable in (b'"ab"', b'["session"]', b'["s","p","e","x"]', b'{"a":1}', b'[1,2]'):
        await redis_client.set(bounded.key("m", "alice", "resp_bad"), unreadable)
        assert await bounded.lookup("m", "alice", "resp_bad") is None
