"""The provider each session was last pinned to, for `routing.prefer_previous_provider`.

An option outside the spec (off by default, see `extproc.config.PreferPreviousProvider`): when a
session's pin has expired between two turns, the spec pins it anew on the first eligible provider
with room, often not the one holding its prefix in cache. With the option on, the router tries
the session's previous provider first among the providers of the same kind. This module only
remembers; `extproc.routing.Router.pin_order` applies the preference.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable


class PreviousProviders:
    """session id -> the provider of its last pinned request, bounded in size and in time.

    remember_seconds: how long after a session's last pinned request its provider is kept
    (seconds); max_sessions: sessions kept at most, the least recently routed dropped first.
    `clock` returns seconds (monotonic), for tests."""

    def __init__(self, remember_seconds: float, max_sessions: int, clock: Callable[[], float] = time.monotonic):
        self._ttl = remember_seconds
        self._max = max_sessions
        self._clock = clock
        self._entries: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def remember(self, session_id: str, provider: str) -> None:
        """`session_id` was just served on its pin at `provider`."""
        entries = self._entries
        entries[session_id] = (provider, self._clock() + self._ttl)
        entries.move_to_end(session_id)
        while len(entries) > self._max:
            entries.popitem(last=False)

    def get(self, session_id: str) -> str | None:
        """The provider `session_id` was last pinned to, or None (never, or too long ago)."""
        entry = self._entries.get(session_id)
        if entry is None:
            return None
        provider, expires = entry
        if self._clock() >= expires:
            del self._entries[session_id]
            return None
        return provider

    def __len__(self) -> int:
        return len(self._entries)
