"""Issue 24: the routing scripts also return the routing state's epoch when called inside
extproc.routing.state.watching_epoch (lua/lib.lua `with_epoch`), read atomically with what they
admit, under every layout of their keys (the third-party share's and the admission queue's keys
before the epoch key, the compare-and-swap's own key after it), and answer exactly as the same
calls outside it. Over a Redis Cluster (RoutingState.epoch_in_script false) they read nothing."""

from __future__ import annotations

import pytest

from extproc.config import parse_config
from extproc.routing.state import EpochSeen, QueueArgs, RoutingState, watching_epoch
from tests.support.configs import small_config_data

QUEUE = {"classes": [{"name": "interactive", "max_wait_ms": 1000}], "poll_ms": 100, "ticket_lease_ms": 1000}
SHARE = {"window_seconds": 3600, "max_share": 0.5, "burst": 5}
ROUTING = {
    "plain": {},
    "share": {"third_party_share": SHARE},
    "queue": {"queue": QUEUE},
    "share+queue": {"queue": QUEUE, "third_party_share": SHARE},
}
EPOCH = "0123abcd@1700000000000"


async def every_decision_call(state: RoutingState) -> list[object]:
    """One of each script a decision may run, on session "s" (the share's identity "k"): their
    answers, without ids and times."""
    share = "k"
    pin, first = await state.get_pin_and_try_admit("m", "s", ["iris-1", "iris-2"], share=share)
    answers: list[object] = [pin, first.result, first.pin.provider]
    answers.append((await state.get_pin("m", "s")).provider)
    answers.append((await state.try_admit_pinned_session_request("m", "s", share=share)).result)
    cas = await state.try_compare_and_swap_pin_and_admit_request(first.pin, "m", "s", "iris-2", share=share)
    answers += [cas.pin_match, cas.admission.result, cas.admission.pin.provider]
    answers.append((await state.try_admit_unpinned_session_request("iris-1", "m", "s", share=share)).result)
    temporary = await state.try_admit_request_without_pin("iris-1", "m", share=share)
    answers.append(temporary.result)
    answers.append(await state.try_admit_share("tensorx", "m", share, lease_id="l1"))
    answers.append((await state.release_request_lease(temporary.lease, refresh_pin=False)).result)
    answers.append((await state.leave_queue("m", QueueArgs(0, False, "", "t1", "none", 10))).result)
    answers.append((await state.abandon_request("m", "s", first.lease.id, first.pin.id)).result)
    return answers


def routing_state(redis_client, redis_url, hot_path, routing: dict, cluster: bool = False) -> RoutingState:
    redis = {"url": redis_url, "key_prefix": "t"}
    if cluster:  # only the topology is read from it: the calls still go to the standalone Redis
        redis = {"cluster": {"nodes": ["127.0.0.1:7000"]}, "key_prefix": "t"}
    return RoutingState(redis_client, parse_config(small_config_data(redis_url, routing=routing, redis=redis)), hot_path=hot_path)


@pytest.mark.parametrize("routing", list(ROUTING))
async def test_every_decision_script_returns_the_epoch_it_saw_and_answers_as_without(redis_client, redis_url, hot_path, routing):
    state = routing_state(redis_client, redis_url, hot_path, ROUTING[routing])
    assert state.epoch_in_script
    expected = await every_decision_call(state)
    await redis_client.flushall()
    await redis_client.set(state.keys.epoch(), EPOCH)
    seen = EpochSeen()
    assert await watching_epoch(every_decision_call(state), seen) == expected
    assert seen.epochs == {EPOCH} and seen.only(EPOCH) and not seen.only("another@1")


async def test_a_script_that_finds_no_epoch_says_so(redis_client, redis_url, hot_path):
    state = routing_state(redis_client, redis_url, hot_path, {})
    seen = EpochSeen()
    await watching_epoch(state.get_pin_and_try_admit("m", "s", ["iris-1"]), seen)
    assert seen.epochs == {None} and not seen.only(None)
    await redis_client.set(state.keys.epoch(), EPOCH)
    await watching_epoch(state.get_pin_and_try_admit("m", "s", ["iris-1"]), seen)
    assert seen.epochs == {None, EPOCH} and not seen.only(EPOCH)  # one script saw none: not only EPOCH


async def test_outside_a_decision_or_on_a_cluster_no_script_reads_the_epoch(redis_client, redis_url, hot_path):
    """Calls outside `watching_epoch` (renewals, releases, adoptions) and every call of a state
    over a Redis Cluster, whose epoch key is in another slot, leave the epoch out."""
    await redis_client.set("{t}:epoch", EPOCH)
    standalone = routing_state(redis_client, redis_url, hot_path, {})
    cluster = routing_state(redis_client, redis_url, hot_path, {}, cluster=True)
    assert not cluster.epoch_in_script
    seen = EpochSeen()
    outside = await every_decision_call(standalone)
    await redis_client.flushall()
    await redis_client.set("{t}:epoch", EPOCH)
    assert await watching_epoch(every_decision_call(cluster), seen) == outside
    assert seen.epochs == set()


async def test_an_admission_with_its_wait_returns_the_epoch_too(redis_client, redis_url, hot_path):
    """With `redis.durable_admissions` the admission and its WAIT go in one pipeline: the epoch
    still comes off the script's reply (no replica here: the WAIT times out, the admission stands)."""
    redis = {"url": redis_url, "key_prefix": "t", "durable_admissions": {"replicas": 1, "timeout_ms": 5}}
    state = RoutingState(redis_client, parse_config(small_config_data(redis_url, redis=redis)), hot_path=hot_path)
    await redis_client.set(state.keys.epoch(), EPOCH)
    seen = EpochSeen()
    pin, admission = await watching_epoch(state.get_pin_and_try_admit("m", "s", ["iris-1"]), seen)
    assert pin is None and admission.lease is not None and admission.lease.provider == "iris-1"
    assert seen.epochs == {EPOCH}
