"""Which engine served which session: a byte-for-byte TCP relay in front of each engine that
notes the session tag of every request it carries.

    python -m bench.engine_tap --log taps.txt --pair LISTEN_PORT:ENGINE_PORT [--pair ...]

`bench.real_engines` puts `[session NAME]` at the start of each session's first user message
(every turn repeats it, so every request carries exactly one tag) and points the front ends at
these relays instead of the engines. A relay opens one engine connection per front-end
connection and copies bytes both ways unchanged, so the front end's connection reuse, the
engine's keep-alive closes and its resets reach the other side as they would directly (a reset
becomes a reset: the relay aborts the other side). It parses no HTTP: it finds the tags in the
bytes going to the engine (the front ends pass message text through, whatever else they
rewrite), with the path of the request line before each, and appends `<seconds since start>
<engine index> <session> <path>` to `--log` for each: a generation (GENERATION_PATHS), or a
router's own call that carries the text (vllm-router's `cache_aware` sends the prompt to every
engine's `/tokenize`).
Every relay listens on 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import time
from pathlib import Path
from typing import TextIO

TAG = re.compile(rb"\[session ([A-Za-z0-9_.-]{1,64})\]")
REQUEST_LINE = re.compile(rb"(?:GET|POST|PUT|DELETE|PATCH) (/[^ \r\n]{0,200}) HTTP/1\.[01]\r\n")
FOUND = re.compile(TAG.pattern + rb"|" + REQUEST_LINE.pattern)
TAG_MAX = 300  # bytes: a tag or request line split over two reads is found in the kept tail
GENERATION_PATHS = ("/v1/chat/completions", "/chat/completions", "/v1/completions", "/completions", "/generate")


def session_tag(session: str) -> str:
    """The text `bench.real_engines` puts in a session's first user message."""
    return f"[session {session}]"


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, on_bytes=None) -> None:
    tail = b""
    try:
        while data := await reader.read(65536):
            if on_bytes is not None:
                tail = on_bytes(tail + data)
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.transport.abort()


def _relay(index: int, engine_port: int, log: TextIO, started: float):
    def noter():
        path = ["-"]  # the path of the connection's latest request line

        def note(buffer: bytes) -> bytes:
            last = 0
            for match in FOUND.finditer(buffer):
                if match.group(2) is not None:
                    path[0] = match.group(2).decode(errors="replace").split("?")[0]
                else:
                    log.write(f"{time.monotonic() - started:.3f} {index} {match.group(1).decode()} {path[0]}\n")
                last = match.end()
            log.flush()
            return buffer[max(last, len(buffer) - TAG_MAX):]

        return note

    async def handle(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            engine_reader, engine_writer = await asyncio.open_connection("127.0.0.1", engine_port)
        except OSError:
            client_writer.transport.abort()
            return
        await asyncio.gather(_pipe(client_reader, engine_writer, noter()), _pipe(engine_reader, client_writer))
        for writer in (engine_writer, client_writer):
            writer.close()

    return handle


async def serve(pairs: list[tuple[int, int]], log_path: Path) -> None:
    """Relay 127.0.0.1:listen -> 127.0.0.1:engine for each pair (engine index = its position)."""
    started = time.monotonic()
    with log_path.open("a") as log:
        servers = [await asyncio.start_server(_relay(i, engine, log, started), "127.0.0.1", listen)
                   for i, (listen, engine) in enumerate(pairs)]
        await asyncio.gather(*(server.serve_forever() for server in servers))


def read_log(log_path: Path) -> list[tuple[int, str, str]]:
    """The (engine index, session, path) of every request a relay carried with a tag, in order
    (path "-" when its request line was not seen)."""
    if not log_path.exists():
        return []
    out = []
    for line in log_path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 4:
            out.append((int(parts[1]), parts[2], parts[3]))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--log", type=Path, required=True)
    parser.add_argument("--pair", action="append", required=True, help="LISTEN_PORT:ENGINE_PORT")
    args = parser.parse_args(argv)
    pairs = [tuple(int(p) for p in pair.split(":")) for pair in args.pair]
    asyncio.run(serve(pairs, args.log))


if __name__ == "__main__":
    main()
