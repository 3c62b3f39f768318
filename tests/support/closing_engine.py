"""An engine that closes its connection after a streamed answer, as llama.cpp's `llama-server`
does: it announces keep-alive (`Keep-Alive: timeout=5, max=100`) on a chunked event stream,
writes the stream's last chunk, then closes the connection without reading what came after
(llama.cpp tools/server/server-http.cpp: the stream's content provider returns false once it
called `sink.done()`, which cpp-httplib takes for a cancelled write, and it closes). A request
sent on the connection in between is reset unread (the kernel answers its bytes with RST).

`close_delay_seconds` stands for the engine's thread finishing the request before it closes
(llama-server logs, frees the slot's task, then closes): long enough here for a client's next
request to cross the gateway and meet the connection. Answers without streaming, and `/health`,
keep their connection open (idle ones closed after 5 s), as llama-server's do.

Runs on an asyncio loop of its own in a thread of the test process, on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter

from irislab.processes import free_port

KEEP_ALIVE_SECONDS = 5.0


class ClosingEngine:
    """Use as a context manager; `url` is its base URL. `answered`: requests answered, by path
    (a request reset unread is not counted: it never reached the engine). `connections`: the
    connections accepted."""

    def __init__(self, close_delay_seconds: float = 0.03, port: int | None = None):
        self.close_delay_seconds = close_delay_seconds
        self.port = port or free_port()
        self.answered: Counter[str] = Counter()
        self.connections = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"closing-engine-{self.port}", daemon=True)
        self._server: asyncio.base_events.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ClosingEngine:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(asyncio.start_server(self._serve, "127.0.0.1", self.port),
                                                        self._loop).result(timeout=10)
        return self

    def __exit__(self, *exc) -> None:
        async def close() -> None:
            self._server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=KEEP_ALIVE_SECONDS)
                except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                    return
                method, path, headers = _parse_head(head)
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                if method == "POST" and path.endswith("/chat/completions") and json.loads(body or b"{}").get("stream"):
                    await _stream(writer)
                    self.answered[path] += 1
                    await asyncio.sleep(self.close_delay_seconds)
                    return  # closed with whatever came after unread, as llama-server does
                await _json(writer, path)
                self.answered[path] += 1
        except (ConnectionError, asyncio.CancelledError):
            return
        finally:
            writer.close()


def _parse_head(head: bytes) -> tuple[str, str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    return method, path, headers


async def _stream(writer: asyncio.StreamWriter) -> None:
    """A two-token chat stream with usage, chunked, under keep-alive headers."""
    writer.write(b"HTTP/1.1 200 OK\r\nServer: llama.cpp\r\nContent-Type: text/event-stream\r\n"
                 b"Transfer-Encoding: chunked\r\nKeep-Alive: timeout=5, max=100\r\n\r\n")
    events = [{"choices": [{"index": 0, "delta": {"content": word}, "finish_reason": None}]} for word in ("Hello", " there")]
    events.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
                   "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}})
    for event in events:
        payload = f"data: {json.dumps({'object': 'chat.completion.chunk', 'model': 'm', **event})}\n\n".encode()
        writer.write(b"%x\r\n%s\r\n" % (len(payload), payload))
    payload = b"data: [DONE]\n\n"
    writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(payload), payload))
    await writer.drain()


async def _json(writer: asyncio.StreamWriter, path: str) -> None:
    """`/health` and any other request: a small JSON answer; the connection stays open."""
    if path.startswith("/health"):
        body = b'{"status":"ok"}'
    else:
        body = json.dumps({"object": "chat.completion", "model": "m", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "Hello there"}, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}}).encode()
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nKeep-Alive: timeout=5, max=100\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    await writer.drain()
