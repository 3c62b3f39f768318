"""The model name in answers: the client's, never the provider's own.

A request for `llama-3.1-70b` sent to a provider that names the model `tensorx/llama-3.1-70b-
instruct` (the pair's `upstream_model`, extproc.openai_api.adaptation) is answered with the
provider's name in every `"model"` field: the JSON answer's, each streamed chunk's, the
`response` object of Responses events. `ModelNameRewriter` puts the client's name back, chunk by
chunk, as Envoy hands the answer body to the ext_proc server (BUFFERED for a JSON answer,
STREAMED for an event stream: extproc.protocol.stream asks for the body only when the names
differ).

What is rewritten: a JSON member `"model": "<upstream name>"` (any whitespace around the colon,
`/` written as `/` or `\\/`), wherever it stands; the member name and value must be JSON tokens
of the answer itself, so text that merely quotes them inside a string (where its quotes are
escaped) is never touched. A `model` holding any other value (a provider that answers with a
dated snapshot name, say) is left as it is. An event stream is rewritten line by line: the bytes
after the last newline of a chunk wait for the next chunk (a member never spans a line of a
server-sent event), at most MAX_HELD_BYTES of them.
"""

from __future__ import annotations

import re

import orjson

MAX_HELD_BYTES = 64 * 1024  # a longer line without a newline is passed on as it is


class ModelNameRewriter:
    """Rewrites `"model": "<upstream>"` to `"model": "<client>"` in an answer body fed chunk by
    chunk. `event_stream`: the body is server-sent events (hold back partial lines) rather than
    one JSON document (handed over whole, BUFFERED)."""

    def __init__(self, upstream: str, client: str, event_stream: bool):
        self.event_stream = event_stream
        self._needle = upstream.encode()
        self._pattern = _member_pattern(upstream)
        self._replacement = rb"\g<1>" + orjson.dumps(client).replace(b"\\", b"\\\\")
        self._held = b""
        self.rewritten = 0  # members rewritten so far

    def feed(self, chunk: bytes, end_of_stream: bool) -> bytes:
        """The bytes to send on for `chunk`: rewritten, less a partial last line of an event
        stream (sent with a later chunk, or at `end_of_stream`)."""
        data = self._held + chunk if self._held else chunk
        self._held = b""
        if self.event_stream and not end_of_stream:
            cut = data.rfind(b"\n") + 1
            if cut < len(data) and len(data) - cut <= MAX_HELD_BYTES:
                data, self._held = data[:cut], data[cut:]
        return self._rewrite(data)

    def _rewrite(self, data: bytes) -> bytes:
        if self._needle not in data and b"\\/" not in data:  # the common case: a byte search, no regex
            return data
        rewritten, count = self._pattern.subn(self._replacement, data)
        self.rewritten += count
        return rewritten


def _member_pattern(upstream: str) -> re.Pattern[bytes]:
    """`"model"` `:` `"<upstream as JSON>"`, the quotes being the JSON's own (not escaped)."""
    value = orjson.dumps(upstream)[1:-1]
    escaped = re.escape(value).replace(b"/", rb"(?:/|\\/)")
    return re.compile(rb'((?<!\\)"model"\s*:\s*)"' + escaped + rb'"')
