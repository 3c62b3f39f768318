"""The routing state over the pipelined hot-path client (config `redis.hot_path_client`,
extproc.storage.pipelined): every script the state runs goes over it when it is given, and the
model's constants encoded once (`Packed`) answer exactly what redis-py's per-call encoding does,
with the admission queue and routing.third_party_share on (their sections are packed too)."""

from __future__ import annotations

import pytest

from extproc.config import parse_config
from extproc.routing.state import SCRIPT_NAMES, QueueArgs, RoutingState
from extproc.storage.client import connect
from extproc.storage.pipelined import open_pipelined
from irislab.processes import free_port
from tests.support.configs import small_config_data

T0 = 1_000_000_000
QUEUE = {"classes": [{"name": "interactive", "max_wait_ms": 1000, "max_depth": 3}], "ticket_lease_ms": 3000}
SHARE = {"window_seconds": 3600, "max_share": 0.0, "burst": 1}


def full_config(redis_url: str):
    """small_config_data with the admission queue and the third-party share on."""
    return parse_config(small_config_data(redis_url, routing={"queue": QUEUE, "third_party_share": SHARE}))


async def every_call(state: RoutingState) -> list[object]:
    """One call of every script the state runs (fixed ids and times), their answers in order."""
    wait = QueueArgs(0, True, "tenant", "T1", "join", 3)
    out: list[object] = []
    out.append(await state.get_pin("m", "s1", now_ms=T0))
    pin, first = await state.get_pin_and_try_admit("m", "s1", ["iris-1"], lease_id="L1", pin_id="P1", share="alice", now_ms=T0)
    out += [pin, first]
    out.append(await state.try_admit_unpinned_session_request("iris-2", "m", "s2", lease_id="L2", pin_id="P2", now_ms=T0 + 1))
    out.append(await state.try_admit_pinned_session_request("m", "s1", lease_id="L3", share="alice", now_ms=T0 + 2))
    out.append(await state.try_compare_and_swap_pin_and_admit_request(first.pin, "m", "s1", "iris-2", lease_id="L4", pin_id="P4",
                                                                       now_ms=T0 + 3))
    out.append(await state.try_admit_request_without_pin("iris-1", "m", lease_id="L5", now_ms=T0 + 4, queue=wait))
    out.append(await state.try_admit_share("tensorx", "m", "alice", lease_id="L6", now_ms=T0 + 5))
    out.append(await state.try_admit_share("tensorx", "m", "alice", lease_id="L7", now_ms=T0 + 6))
    out.append(await state.renew_request_lease(first.lease, now_ms=T0 + 7))
    out.append(await state.release_request_lease(first.lease, refresh_pin=True, now_ms=T0 + 8))
    out.append(await state.adopt_request_lease(first.lease, now_ms=T0 + 9))
    out.append(await state.move_endpoint_lease(first.lease, "127.0.0.1:1", now_ms=T0 + 9))
    out.append(await state.abandon_request("m", "s2", "L2", "P2", now_ms=T0 + 10))
    out.append(await state.probe("m"))
    out.append(await state.leave_queue("m", wait, now_ms=T0 + 11))
    return out


def test_every_script_is_called():
    """every_call covers every script of the state (a new script must be added there)."""
    called = {"get_pin", "get_pin_and_admit", "admit_unpinned", "admit_pinned", "cas_repin", "admit_without_pin", "admit_share",
              "renew", "release", "adopt", "abandon", "queue_leave", "probe", "move_endpoint_lease"}
    assert called == set(SCRIPT_NAMES)


async def test_every_script_goes_over_the_hot_path_client(redis_client, redis_url):
    """With redis-py pointing at a closed port, every call still answers: it went over the
    pipelined client."""
    dead = connect(f"redis://127.0.0.1:{free_port()}/0", timeout_seconds=0.2)
    hot_path = open_pipelined(parse_config(small_config_data(redis_url)).redis, timeout_seconds=5)
    try:
        answers = await every_call(RoutingState(dead, full_config(redis_url), hot_path=hot_path))
    finally:
        await hot_path.aclose()
        await dead.aclose()
    assert answers[2].result.value == "ADMITTED" and answers[-1].result.value in ("RELEASED", "NOT_FOUND")


@pytest.mark.parametrize("variant", ["pipelined+packed", "pipelined"])
async def test_packed_constants_answer_what_redis_py_answers(redis_client, redis_url, variant):
    """The same calls through redis-py, then (Redis emptied) through the pipelined client with
    the constants packed or encoded per call: the same answers, and Redis holds the same keys."""
    config = full_config(redis_url)
    expected = await every_call(RoutingState(redis_client, config))
    expected_keys = sorted(await redis_client.keys("*"))
    await redis_client.flushall()
    hot_path = open_pipelined(config.redis, timeout_seconds=5)
    try:
        answers = await every_call(RoutingState(redis_client, config, hot_path=hot_path, packed=variant == "pipelined+packed"))
    finally:
        await hot_path.aclose()
    assert answers == expected
    assert sorted(await redis_client.keys("*")) == expected_keys
