"""A pick provider whose `endpoints` are one DNS name (a headless Service): the router resolves
it again and again (extproc.routing.endpoint_refresh) and places on what it answers. A resolver
stand-in whose answers change plays the Service's replicas coming and going; the routing state
runs against a real Redis, with explicit times (ms), over both clients."""

from __future__ import annotations

import asyncio

import pytest

from extproc import metrics
from extproc.config import parse_config
from extproc.config.endpoints import EndpointError, dns_name, pick_endpoints
from extproc.routing.endpoint_refresh import EndpointRefresh, EndpointResolutionError
from extproc.routing.state import Result, RoutingState
from extproc.supervision import run_every
from tests.support.configs import small_config_data

T0 = 1_000_000_000
PORT = 8000
NAME = "localhost"  # resolves (to 127.0.0.1) when the config loads; the stand-in answers after that


class ChangingResolver:
    """The Service's DNS answers, set by the test: a list of addresses, or an exception to raise."""

    def __init__(self, *addresses: str):
        self.answer: list[str] | Exception = list(addresses)
        self.asked: list[tuple[str, int]] = []

    def resolve(self, host: str, port: int) -> list[str]:
        self.asked.append((host, port))
        if isinstance(self.answer, Exception):
            raise self.answer
        return list(self.answer)


def dns_config(redis_url: str, refresh_seconds: float = 5.0, name: str = NAME):
    data = small_config_data(redis_url)
    pool = data["providers"][0]
    pool["affinity"] = "pick"
    pool["endpoints"] = [f"http://{name}:{PORT}"]
    pool["models"]["m"]["limits"] = {"max_pinned_sessions": 100, "max_global_in_flight_request_slots": 100,
                                     "max_per_session_in_flight_request_slots": 10}
    data["routing"] = {"placement": {"dns_refresh_seconds": refresh_seconds}}
    return parse_config(data)


def at(*last_octets: int) -> list[str]:
    return [f"127.0.0.{n}:{PORT}" for n in last_octets]


def test_one_name_is_every_address_it_resolves_to() -> None:
    assert dns_name([f"http://{NAME}:{PORT}"]) == (NAME, PORT)
    assert dns_name(["http://127.0.0.1:8000"]) is None and dns_name(["http://a:1", "http://b:2"]) is None
    answers = ChangingResolver("127.0.0.3", "127.0.0.1", "127.0.0.3", "::1")
    assert pick_endpoints([f"http://{NAME}:{PORT}"], answers) == tuple(at(1, 3)), "IPv4 preferred, sorted, no repeats"
    answers.answer = ["::2", "::1"]
    assert pick_endpoints([f"https://{NAME}"], answers) == ("[::1]:443", "[::2]:443")
    answers.answer = []
    with pytest.raises(EndpointError):
        pick_endpoints([f"http://{NAME}:{PORT}"], answers)
    assert pick_endpoints([f"http://{NAME}:{PORT}"]) == (f"127.0.0.1:{PORT}",), "the system's resolver by default"


async def place_sessions(state: RoutingState, sessions: list[str], now: int) -> dict[str, str]:
    """One turn of each session, all running at once (each placed seeing the others' load), then
    released; their endpoints."""
    leases = {}
    for session in sessions:
        _, admission = await state.get_pin_and_try_admit("m", session, ["iris-1"], now_ms=now)
        assert admission is not None and admission.lease is not None, (session, admission)
        leases[session] = admission.lease
    for lease in leases.values():
        assert (await state.release_request_lease(lease, refresh_pin=True, now_ms=now)).result is Result.RELEASED
    return {session: lease.endpoint for session, lease in leases.items()}


async def test_an_address_added_moves_no_session_and_one_removed_moves_only_its_own(redis_client, redis_url, hot_path):
    state = RoutingState(redis_client, dns_config(redis_url), hot_path=hot_path)
    assert state.endpoints("iris-1") == tuple(at(1)), "resolved once when the config loaded"
    answers = ChangingResolver("127.0.0.3", "127.0.0.1", "127.0.0.2")
    refresh = EndpointRefresh(lambda: state, answers)
    assert await refresh.step() == 1 and answers.asked == [(NAME, PORT)]
    assert state.endpoints("iris-1") == tuple(at(1, 2, 3))
    sessions = [f"s{i}" for i in range(6)]
    homes = await place_sessions(state, sessions, T0)
    assert sorted(homes.values()) == sorted(at(1, 2, 3) * 2), "equal load: two sessions each"

    answers.answer = ["127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4"]  # a replica added
    assert await refresh.step() == 1 and await refresh.step() == 0
    assert await place_sessions(state, sessions, T0 + 1) == homes, "an added endpoint moves no session"
    newcomer = await place_sessions(state, [*sessions, "new"], T0 + 1)
    assert newcomer["new"] == at(4)[0], "a new session goes to the endpoint with nothing yet"

    gone = homes["s0"]
    answers.answer = [a.rpartition(":")[0] for a in at(1, 2, 3, 4) if a != gone]  # a replica removed
    assert await refresh.step() == 1
    moved = await place_sessions(state, sessions, T0 + 2)
    for session, home in homes.items():
        if home == gone:
            assert moved[session] != gone, "a removed endpoint's sessions are placed again"
        else:
            assert moved[session] == home, "the other sessions stay"
    later = await place_sessions(state, sessions, T0 + 3)
    assert later == moved, "a moved session stays where it was placed again"


async def test_a_failed_or_empty_answer_keeps_the_endpoints_known(redis_client, redis_url):
    state = RoutingState(redis_client, dns_config(redis_url))
    answers = ChangingResolver("127.0.0.1", "127.0.0.2")
    refresh = EndpointRefresh(lambda: state, answers)
    await refresh.step()
    homes = await place_sessions(state, ["a", "b"], T0)
    for answer in (EndpointError("NXDOMAIN"), [], OSError("resolver down")):
        answers.answer = answer
        with pytest.raises(EndpointResolutionError):
            await refresh.step()
        assert state.endpoints("iris-1") == tuple(at(1, 2))
        assert await place_sessions(state, ["a", "b"], T0 + 1) == homes


async def test_the_supervised_loop_follows_the_name_and_survives_failures(redis_client, redis_url):
    """Under run_every (as the gateway runs it): the set follows the answers every
    dns_refresh_seconds; a failing resolver is counted and retried, never ends the loop."""
    state = RoutingState(redis_client, dns_config(redis_url, refresh_seconds=0.1))
    answers = ChangingResolver("127.0.0.1", "127.0.0.2")
    refresh = EndpointRefresh(lambda: state, answers)
    assert refresh.needed()
    restarts = metrics.RESTARTS.labels("endpoint_refresh")
    before = restarts._value.get()
    loop = asyncio.create_task(run_every("endpoint_refresh", refresh.run, 0, max_backoff_seconds=0.1))
    try:
        await wait_for(lambda: state.endpoints("iris-1") == tuple(at(1, 2)))
        answers.answer = OSError("resolver down")
        await wait_for(lambda: restarts._value.get() > before)
        answers.answer = ["127.0.0.5"]
        await wait_for(lambda: state.endpoints("iris-1") == tuple(at(5)))
        assert not loop.done()
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)


async def wait_for(condition, deadline_seconds: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    give_up = loop.time() + deadline_seconds
    while not condition():
        assert loop.time() < give_up, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_a_name_that_does_not_resolve_yet_loads_and_serves_once_it_does(redis_client, redis_url):
    """A headless Service with no ready replica answers NXDOMAIN: the config still loads (its
    check cannot resolve offline either), the pair takes no request (as at its cap: the request
    goes to the next provider), and the first answer with an address opens it."""
    state = RoutingState(redis_client, dns_config(redis_url, name="no-ready-replica.invalid"))
    assert state.endpoints("iris-1") == () and state.picks("m")
    _, refused = await state.get_pin_and_try_admit("m", "s", ["iris-1"], now_ms=T0)
    assert refused is not None and refused.lease is None and refused.result is not Result.ADMITTED
    refresh = EndpointRefresh(lambda: state, ChangingResolver("127.0.0.7"))
    assert await refresh.step() == 1
    assert await place_sessions(state, ["s"], T0 + 1) == {"s": at(7)[0]}
