"""The model name in answers: the client's, never the provider's own.

A request for `llama-3.1-70b` sent to a provider that names the model `tensorx/llama-3.1-70b-
instruct` (the pair's `upstream_model`, extproc.openai_api.adaptation) is answered with the
provider's name in every `"model"` field: the JSON answer's, each streamed chunk's, the
`response` object of Responses events. `ModelNameRewriter` puts the client's name back, chunk by
chunk, as Envoy hands the answer body to the ext_proc server (BUFFERED for a small JSON answer,
STREAMED for an event stream and for a JSON answer of unknown or large size, which Envoy could
not buffer whole: extproc.protocol.stream asks for the body only when the names differ).

What is rewritten: a JSON member `"model": "<upstream name>"` (any whitespace around the colon,
`/` written as `/` or `\\/`), wherever it stands; the member name and value must be JSON tokens
of the answer itself, so text that merely quotes them inside a string (where its quotes are
escaped) is never touched. A `model` holding any other value (a provider that answers with a
dated snapshot name, say) is left as it is. An event stream is rewritten line by line: the bytes
after the last newline of a chunk wait for the next chunk (a member never spans a line of a
server-sent event), at most MAX_HELD_BYTES of them. A JSON answer fed in several chunks holds back
only the end of a chunk that could begin a member to rewrite (`"mod`, `"model" :`, `"model":
"tensorx/lla`), at most MAX_HELD_BYTES of it.
"""

from __future__ import annotations

import re

import orjson

MAX_HELD_BYTES = 64 * 1024  # a longer line without a newline is passed on as it is


class ModelNameRewriter:
    """Rewrites `"model": "<upstream>"` to `"model": "<client>"` in an answer body fed chunk by
    chunk. `event_stream`: the body is server-sent events (hold back partial lines) rather than
    one JSON document (handed over whole when BUFFERED, else holding back a chunk's end that may
    begin a member)."""

    def __init__(self, upstream: str, client: str, event_stream: bool):
        self.event_stream = event_stream
        self._needle = upstream.encode()
        self._pattern = _member_pattern(upstream)
        self._partial = _partial_member_pattern(upstream)
        self._replacement = rb"\g<1>" + orjson.dumps(client).replace(b"\\", b"\\\\")
        self._held = b""
        self._before = b""  # the last byte sent on: a held member's quote may follow a backslash
        self.rewritten = 0  # members rewritten so far

    def feed(self, chunk: bytes, end_of_stream: bool) -> bytes:
        """The bytes to send on for `chunk`: rewritten, less a partial last line of an event
        stream, or the start of a member that a JSON chunk ends in (sent with a later chunk, or
        at `end_of_stream`)."""
        data = self._held + chunk if self._held else chunk
        self._held = b""
        if not end_of_stream:
            cut = data.rfind(b"\n") + 1 if self.event_stream else self._partial_member_start(data)
            if cut < len(data) and len(data) - cut <= MAX_HELD_BYTES:
                data, self._held = data[:cut], data[cut:]
        return self._rewrite(data)

    def _partial_member_start(self, data: bytes) -> int:
        """Where a member to rewrite that `data` does not complete begins (len(data): nowhere).
        Its `"model"` starts in the last MAX_HELD_BYTES, or `data` ends inside the name."""
        window = max(0, len(data) - MAX_HELD_BYTES)
        candidate = data.find(b'"model"', window)
        while candidate >= 0:
            if self._partial.fullmatch(data, candidate):
                return candidate
            candidate = data.find(b'"model"', candidate + 1)
        for size in range(min(6, len(data)), 0, -1):  # the data ends inside `"model"`
            if b'"model"'.startswith(data[-size:]):
                return len(data) - size
        return len(data)

    def _rewrite(self, data: bytes) -> bytes:
        before, self._before = self._before, data[-1:] or self._before
        if self._needle not in data and b"\\/" not in data:  # the common case: a byte search, no regex
            return data
        if before == b"\\":  # the lookbehind must see what was sent before
            rewritten, count = self._pattern.subn(self._replacement, before + data)
            rewritten = rewritten[1:]
        else:
            rewritten, count = self._pattern.subn(self._replacement, data)
        self.rewritten += count
        return rewritten


def _partial_member_pattern(upstream: str) -> re.Pattern[bytes]:
    """Matches a start of `_member_pattern`'s match from `"model"` on (full match): the name,
    then any prefix of the colon, the whitespace and the value with its closing quote (`\\/` may
    be cut after its backslash): a member at a chunk's very end is held whole too."""
    value = orjson.dumps(upstream)[1:-1]
    atoms = [rb"\s*", rb":", rb"\s*", rb'"']
    for index in range(len(value)):
        char = value[index:index + 1]
        atoms.append(rb"(?:/|\\/?)" if char == b"/" else re.escape(char))
    atoms.append(rb'"')
    tail = b""
    for atom in reversed(atoms):
        tail = rb"(?:" + atom + tail + rb")?" if tail else rb"(?:" + atom + rb")?"
    return re.compile(rb'"model"' + tail)


def _member_pattern(upstream: str) -> re.Pattern[bytes]:
    """`"model"` `:` `"<upstream as JSON>"`, the quotes being the JSON's own (not escaped)."""
    value = orjson.dumps(upstream)[1:-1]
    escaped = re.escape(value).replace(b"/", rb"(?:/|\\/)")
    return re.compile(rb'((?<!\\)"model"\s*:\s*)"' + escaped + rb'"')
