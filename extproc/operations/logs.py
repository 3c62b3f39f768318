"""The ext_proc server's own log: one line per record on stderr, as text or as JSON.

- `text` (the default): `<time> <LEVEL> [worker <i>] <logger>: <message>`, the worker part only in
  a worker of `serve --workers N`;
- `json` (`--log-format json`, or IRIS_LOG_FORMAT=json): one JSON object per line, formatted by
  python-json-logger (with orjson): `time` (ISO 8601, UTC), `level`, `logger`, `message`, `pid`,
  and when they apply `worker` (the worker's index), `suppressed` (see below) and `exc_info` (the
  traceback).

Repeated warnings are rate-limited (`RepeatFilter`): a warning or error logged again within
`REPEAT_WINDOW_SECONDS` of the first one that was written is dropped and counted; the next one
written after the window carries the count (`suppressed` in JSON, `[K more suppressed]` in text).
"The same" means the same logger, level and message template with the same arguments, the
exceptions among them aside: a Redis outage's "degraded flags not refreshed: <error>", once a
second while it lasts, is written once a minute.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO

FORMATS = ("text", "json")
FORMAT_ENV = "IRIS_LOG_FORMAT"
REPEAT_WINDOW_SECONDS = 60.0
_MAX_REMEMBERED = 4096  # distinct repeated messages remembered at once; older ones are forgotten first


def log_format(value: str) -> str:
    """argparse `type` of `--log-format` (and of its default, IRIS_LOG_FORMAT): `text` or `json`.
    Raises argparse.ArgumentTypeError for anything else."""
    normalized = value.strip().lower()
    if normalized not in FORMATS:
        raise argparse.ArgumentTypeError(f"{value!r} is not a log format (choose from {', '.join(FORMATS)}; {FORMAT_ENV} too)")
    return normalized


@dataclass(slots=True)
class _Seen:
    written_at: float  # clock seconds of the record last written
    suppressed: int = 0  # records dropped since


class RepeatFilter(logging.Filter):
    """Writes a record of level `level` or above at most once per `window_seconds` (seconds, of
    `clock`) per message (`key`); the ones dropped meanwhile are counted and the next record
    written gets the count as its `suppressed` attribute. Lower levels always pass. Thread-safe
    (the metrics thread logs too). Memory: at most _MAX_REMEMBERED messages remembered."""

    def __init__(self, window_seconds: float = REPEAT_WINDOW_SECONDS, level: int = logging.WARNING,
                 clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.window_seconds = window_seconds
        self.level = level
        self.clock = clock
        self._seen: dict[tuple, _Seen] = {}
        self._lock = threading.Lock()

    @staticmethod
    def key(record: logging.LogRecord) -> tuple:
        """What makes two records "the same message": logger, level, template and the arguments
        that are not exceptions (an error's text changes from one failure to the next)."""
        args = record.args if isinstance(record.args, tuple) else (record.args,) if record.args else ()
        kept = tuple(repr(arg) for arg in args if not isinstance(arg, BaseException))
        return record.name, record.levelno, str(record.msg), kept

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < self.level:
            return True
        key, now = self.key(record), self.clock()
        with self._lock:
            seen = self._seen.get(key)
            if seen is not None and now - seen.written_at < self.window_seconds:
                seen.suppressed += 1
                return False
            if seen is not None and seen.suppressed:
                record.suppressed = seen.suppressed
            self._seen.pop(key, None)  # re-inserted last: the dict stays in order of writing
            self._seen[key] = _Seen(now)
            if len(self._seen) > _MAX_REMEMBERED:
                del self._seen[next(iter(self._seen))]
        return True


class WorkerFilter(logging.Filter):
    """Gives every record the `worker` attribute: the index of this worker of `serve --workers`."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index

    def filter(self, record: logging.LogRecord) -> bool:
        record.worker = self.index
        return True


class TextFormatter(logging.Formatter):
    """The text line, with `[K more suppressed]` after a message whose repeats were dropped."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        line = super().formatMessage(record)
        suppressed = getattr(record, "suppressed", 0)
        return f"{line} [{suppressed} more suppressed]" if suppressed else line


def text_format(worker: int | None) -> str:
    """The %-style format of a text line."""
    where = "" if worker is None else "[worker %(worker)s] "
    return f"%(asctime)s %(levelname)s {where}%(name)s: %(message)s"


def formatter(fmt: str, worker: int | None = None) -> logging.Formatter:
    """The formatter of `fmt` (`text` or `json`). Raises ValueError for another format."""
    if fmt == "text":
        return TextFormatter(text_format(worker))
    if fmt == "json":
        from pythonjsonlogger.orjson import OrjsonFormatter

        return OrjsonFormatter(
            ["levelname", "name", "message", "process"],
            rename_fields={"levelname": "level", "name": "logger", "process": "pid"},
            timestamp="time",
        )
    raise ValueError(f"unknown log format {fmt!r}")


def handler(fmt: str = "text", worker: int | None = None, stream: IO[str] | None = None,
            window_seconds: float = REPEAT_WINDOW_SECONDS) -> logging.Handler:
    """A handler writing to `stream` (default stderr) in `fmt`, repeats rate-limited per
    `window_seconds` (seconds), every record tagged with `worker` when given."""
    out = logging.StreamHandler(stream)
    out.setFormatter(formatter(fmt, worker))
    out.addFilter(RepeatFilter(window_seconds))
    if worker is not None:
        out.addFilter(WorkerFilter(worker))
    return out


def configure(level: str, fmt: str = "text", worker: int | None = None) -> None:
    """Set up the process's log (the root logger) at `level` (`debug`, `info`...), in `fmt`, with
    `worker` (a worker's index) on every line; as logging.basicConfig, nothing changes when the
    root logger has handlers already."""
    logging.basicConfig(level=level.upper(), handlers=[handler(fmt, worker)])
