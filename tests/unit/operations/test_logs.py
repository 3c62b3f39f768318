"""The server's own log (extproc.operations.logs, issue 22): repeated warnings rate-limited with
the count of those dropped, JSON lines with their fields, the worker's index on every line, and
the one warning a Redis outage repeats every second (the degraded-flag refresh) written once a
window against a Redis that refuses connections."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import socket
from datetime import datetime, timedelta

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from extproc import cli
from extproc.config import parse_config
from extproc.operations import logs
from extproc.routing.degraded import DegradedFlags
from extproc.storage.client import open_redis
from tests.support.configs import small_config_data


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def record(msg: str, *args, level: int = logging.WARNING, name: str = "extproc.test") -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, args, None)


def test_a_repeated_warning_passes_once_per_window_then_carries_the_count():
    clock = Clock()
    limit = logs.RepeatFilter(window_seconds=60, clock=clock)
    first = record("degraded flags not refreshed: %s", RedisConnectionError("refused"))
    assert limit.filter(first) and not hasattr(first, "suppressed")
    for second in range(1, 60):  # once a second, each with another error text
        clock.now += 1
        assert not limit.filter(record("degraded flags not refreshed: %s", RedisConnectionError(f"timeout {second}")))
    clock.now += 1  # 60 s after the one written
    after = record("degraded flags not refreshed: %s", RedisConnectionError("refused"))
    assert limit.filter(after) and after.suppressed == 59
    clock.now += 1
    assert not limit.filter(record("degraded flags not refreshed: %s", RedisConnectionError("refused")))
    clock.now += 60
    quiet = record("degraded flags not refreshed: %s", RedisConnectionError("refused"))
    assert limit.filter(quiet) and quiet.suppressed == 1


def test_other_messages_arguments_loggers_and_lower_levels_are_not_limited():
    limit = logs.RepeatFilter(window_seconds=60, clock=Clock())
    assert limit.filter(record("%s %s degraded: %s", "iris-1", "m", "health"))
    assert limit.filter(record("%s %s degraded: %s", "iris-2", "m", "health"))  # another pair: another message
    assert limit.filter(record("%s %s degraded: %s", "iris-1", "m", "health", name="extproc.other"))
    assert limit.filter(record("%s %s degraded: %s", "iris-1", "m", "health", level=logging.ERROR))
    assert not limit.filter(record("%s %s degraded: %s", "iris-1", "m", "health"))
    for _ in range(5):
        assert limit.filter(record("ext_proc server listening on %s", "127.0.0.1:1", level=logging.INFO))


def emit(handler: logging.Handler, message: str, *args, exc: BaseException | None = None, level: int = logging.WARNING) -> None:
    logger = logging.getLogger("extproc.test.logs")
    logger.propagate = False
    logger.handlers = [handler]
    logger.setLevel(logging.DEBUG)
    try:
        if exc is not None:
            try:
                raise exc
            except type(exc):
                logger.exception(message, *args)
        else:
            logger.log(level, message, *args)
    finally:
        logger.handlers = []


def test_json_lines_carry_time_level_logger_message_pid_and_worker():
    out = io.StringIO()
    handler = logs.handler("json", worker=1, stream=out)
    emit(handler, "ext_proc server listening on %s", "127.0.0.1:50051", level=logging.INFO)
    emit(handler, "background task %s failed", "heartbeat", exc=ValueError("boom"))
    first, second = (json.loads(line) for line in out.getvalue().splitlines())
    assert {k: first[k] for k in ("level", "logger", "message", "pid", "worker")} == {
        "level": "INFO", "logger": "extproc.test.logs", "message": "ext_proc server listening on 127.0.0.1:50051",
        "pid": os.getpid(), "worker": 1,
    }
    written = datetime.fromisoformat(first["time"])
    assert written.utcoffset() == timedelta(0) and abs(datetime.now(written.tzinfo) - written) < timedelta(minutes=1)
    assert second["level"] == "ERROR" and second["message"] == "background task heartbeat failed"
    assert "Traceback" in second["exc_info"] and "ValueError: boom" in second["exc_info"]
    assert "suppressed" not in first and "suppressed" not in second


def test_json_carries_the_suppressed_count_and_no_worker_outside_workers():
    clock = Clock()
    out = io.StringIO()
    handler = logs.handler("json", stream=out)
    next(f for f in handler.filters if isinstance(f, logs.RepeatFilter)).clock = clock
    for _ in range(4):
        emit(handler, "lease renewal failed, the request keeps running: %s", RedisConnectionError("refused"))
    clock.now += logs.REPEAT_WINDOW_SECONDS
    emit(handler, "lease renewal failed, the request keeps running: %s", RedisConnectionError("refused"))
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [line.get("suppressed") for line in lines] == [None, 3]
    assert all("worker" not in line for line in lines)


def test_text_lines_name_the_worker_and_the_suppressed_count():
    clock = Clock()
    out = io.StringIO()
    handler = logs.handler("text", worker=0, stream=out)
    next(f for f in handler.filters if isinstance(f, logs.RepeatFilter)).clock = clock
    emit(handler, "degraded flags not refreshed: %s", RedisConnectionError("refused"))
    emit(handler, "degraded flags not refreshed: %s", RedisConnectionError("refused"))
    clock.now += logs.REPEAT_WINDOW_SECONDS
    emit(handler, "degraded flags not refreshed: %s", RedisConnectionError("refused"))
    first, second = out.getvalue().splitlines()
    assert " WARNING [worker 0] extproc.test.logs: degraded flags not refreshed: refused" in first
    assert second.endswith("degraded flags not refreshed: refused [1 more suppressed]")
    plain = io.StringIO()
    emit(logs.handler("text", stream=plain), "alone")
    assert plain.getvalue().split(" ", 3)[2:] == ["WARNING", "extproc.test.logs: alone\n"]


async def test_a_redis_outage_writes_the_refresh_warning_once_per_window():
    """The degraded-flag refresh runs every second and warns at each failure while Redis is gone
    (here: every 10 ms, against a port that refuses connections): one line is written."""
    with socket.socket() as refused:
        refused.bind(("127.0.0.1", 0))  # bound, never listening
        config = parse_config(small_config_data(f"redis://127.0.0.1:{refused.getsockname()[1]}/0"))
        redis = open_redis(config.redis)
        out = io.StringIO()
        handler = logs.handler("text", stream=out)
        limit = next(f for f in handler.filters if isinstance(f, logs.RepeatFilter))
        logger = logging.getLogger("extproc.routing.degraded")
        logger.addHandler(handler)
        refresher = asyncio.create_task(DegradedFlags(redis, config).run_refresher(0.01))
        try:
            async with asyncio.timeout(30):
                while sum(seen.suppressed for seen in limit._seen.values()) < 20:
                    await asyncio.sleep(0.01)
        finally:
            refresher.cancel()
            logger.removeHandler(handler)
            await redis.aclose()
    (line,) = out.getvalue().splitlines()
    assert "degraded flags not refreshed" in line


def test_log_format_comes_from_the_flag_or_iris_log_format(monkeypatch, capsys):
    assert logs.log_format(" JSON ") == "json"
    with pytest.raises(Exception, match="not a log format"):
        logs.log_format("xml")
    monkeypatch.setenv(logs.FORMAT_ENV, "json")
    assert cli._parser().parse_args(["status", "--config", "x"]).log_format == "json"
    assert cli._parser().parse_args(["--log-format", "text", "status", "--config", "x"]).log_format == "text"
    assert cli._parser().parse_args(["status", "--config", "x", "--log-format", "text"]).log_format == "text"
    with pytest.raises(SystemExit) as exit_:
        cli._parser().parse_args(["--log-format", "xml", "status", "--config", "x"])
    assert exit_.value.code == 2 and "not a log format" in capsys.readouterr().err
    monkeypatch.setenv(logs.FORMAT_ENV, "xml")
    assert cli.main(["status", "--config", "x"]) == 2
    assert "IRIS_LOG_FORMAT" in capsys.readouterr().err
