"""The admission queue on this process's side (docs/queue.md): a request's priority class and wait,
its ticket, and the wake-ups that tell a waiting request it may find a slot.

The queue itself lives in Redis (lua/queue.lua, run by every admission script: the hand-over of a
freed slot to the queue's head is part of the admission). Here:

- `QueuePolicy` reads `routing.queue`: whether the queue is on for a model, a request's class (a
  trusted header, else its identity's configured class, else the default) and its wait.
- `Ticket`: one decision's place in the queue; its id is the decision's lease id, so abandoning the
  decision (extproc.routing.lease_table) ends the ticket with its lease.
- `Wakeups`: the waiting tickets of this process and the one pub/sub subscription that wakes them
  (`listen`): a message names the provider and the tickets heading its queues; only those waiters
  are woken. Each waiter also polls every `poll_ms` (a lost message, a slot freed by an expired
  lease), which renews its ticket. `close` (a drain) stops every wait at once.

The router (extproc.routing.router) decides where requests wait and what they attempt.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from extproc.config import AdmissionQueue
from extproc.routing.state import QueueArgs
from extproc.storage.client import RedisClient

log = logging.getLogger(__name__)

# Identities whose class may come from `identity_classes`: those a client cannot choose at will
# (docs/sessions.md "Identity"); a body `user` never picks a class.
AUTHENTICATED_IDENTITY_PREFIXES = ("trusted_header:", "credential:")


class DecisionAbandoned(Exception):
    """Raised in a decision waiting in the queue whose caller gave up on it (the client hung up,
    the decision timed out): the wait ends at once, and the lease table's abandonment of the
    decision's ids removes its ticket."""


class QueuePolicy:
    """`routing.queue` as routing reads it (docs/queue.md)."""

    def __init__(self, settings: AdmissionQueue, models: Iterable[str]):
        self.settings = settings
        self._classes = {c.name: (rank, c) for rank, c in enumerate(settings.classes)}
        self._enabled = frozenset(m for m in models if settings.enabled(m))

    def enabled(self, model: str) -> bool:
        """Whether the queue is on for `model` (some class may wait), one of the config's models."""
        return model in self._enabled

    def class_for(self, header_value: str | None, identity: str) -> str:
        """A request's class: the trusted class header's value when it names a class, else the
        configured class of its (authenticated) identity, else the default class."""
        if header_value in self._classes:
            return header_value
        if identity.startswith(AUTHENTICATED_IDENTITY_PREFIXES) and identity in self.settings.identity_classes:
            return self.settings.identity_classes[identity]
        return self.settings.default_class

    def wait_seconds(self, model: str, priority: str | None) -> float:
        """How long a request of class `priority` (None: the default) may wait for `model`, seconds."""
        _, settings = self._classes[priority if priority in self._classes else self.settings.default_class]
        return settings.max_wait_ms_for(model) / 1000

    def ticket(self, model: str, priority: str | None, tenant: str, ticket_id: str) -> Ticket:
        """The ticket of a decision (`ticket_id`: its lease id) of class `priority` (None or an
        unknown name: the default class), for tenant `tenant` (a keyed hash of its identity)."""
        name = priority if priority in self._classes else self.settings.default_class
        rank, settings = self._classes[name]
        return Ticket(
            id=ticket_id, model=model, priority=name, rank=rank, may_use_reserved=settings.use_reserved_slots, tenant=tenant,
            max_depth=settings.max_depth, max_wait=settings.max_wait_ms_for(model) / 1000,
        )


@dataclass(eq=False)
class Ticket:
    """One decision's place in the admission queue. `max_wait` (seconds) is spent once: the wait
    begins at the first refusal it waits on (`begin`) and ends at `deadline` (monotonic seconds).
    `joined`: a script answered QUEUED since the ticket was last consumed, so it may sit in a
    queue. `admitted_after_wait`: the provider that served it from the queue, when one did."""

    id: str
    model: str
    priority: str
    rank: int
    may_use_reserved: bool
    tenant: str
    max_depth: int
    max_wait: float
    deadline: float | None = None
    began: float | None = None
    joined: bool = False
    timed_out: bool = False
    admitted_after_wait: str | None = None
    abandoned: bool = False  # its caller gave up on the decision (Wakeups.abandon)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    hint: str | None = None  # the provider named by the last wake-up

    def args(self, mode: str) -> QueueArgs:
        """The scripts' queue arguments for an attempt in `mode` ("none", "join", "wait")."""
        return QueueArgs(self.rank, self.may_use_reserved, self.tenant, self.id, mode, self.max_depth)

    def begin(self) -> None:
        """The first wait starts the clock of `max_wait`."""
        if self.began is None:
            self.began = time.monotonic()
            self.deadline = self.began + self.max_wait

    @property
    def remaining(self) -> float:
        """Seconds of waiting left (the whole `max_wait` before the first wait)."""
        if self.deadline is None:
            return self.max_wait
        return max(0.0, self.deadline - time.monotonic())

    @property
    def waited(self) -> bool:
        return self.began is not None


class Wakeups:
    """This process's waiting tickets and their wake-ups (see the module docstring). One per
    process, shared by every config a reload builds."""

    def __init__(self) -> None:
        self._waiting: dict[str, Ticket] = {}
        self.closing = False
        self.woken = 0  # waiters a wake-up message reached

    def register(self, ticket: Ticket) -> None:
        """Let wake-ups naming `ticket` reach it (before its first admission attempt: a wake-up
        may arrive before the attempt's answer)."""
        self._waiting[ticket.id] = ticket

    def unregister(self, ticket: Ticket) -> None:
        self._waiting.pop(ticket.id, None)

    @property
    def waiting(self) -> int:
        """Tickets registered in this process."""
        return len(self._waiting)

    def deliver(self, data: bytes | str) -> None:
        """A wake-up message, `<provider> <head ticket> <reserved queue's head ticket>` (`-` for
        none): wake the waiters of this process it names."""
        text = data.decode() if isinstance(data, bytes) else data
        provider, *heads = text.split(" ")
        for ticket_id in heads:
            ticket = self._waiting.get(ticket_id)
            if ticket is not None:
                ticket.hint = provider
                ticket.wake.set()
                self.woken += 1

    def abandon(self, ticket_id: str) -> None:
        """The caller of the decision holding `ticket_id` gave up on it: its wait ends at once
        (raising DecisionAbandoned in the decision). Nothing when no such ticket waits here."""
        ticket = self._waiting.get(ticket_id)
        if ticket is not None:
            ticket.abandoned = True
            ticket.wake.set()

    def close(self) -> None:
        """Stop every wait at once and let no request wait from now on (a drain)."""
        self.closing = True
        for ticket in self._waiting.values():
            ticket.wake.set()

    async def wait(self, ticket: Ticket, timeout_seconds: float) -> str | None:
        """Wait for a wake-up of `ticket` or `timeout_seconds` (seconds, the poll); returns the
        provider the wake-up named, or None (a poll, or `close`)."""
        if not ticket.wake.is_set() and timeout_seconds > 0:
            try:
                await asyncio.wait_for(ticket.wake.wait(), timeout_seconds)
            except TimeoutError:
                pass
        ticket.wake.clear()
        hint, ticket.hint = ticket.hint, None
        return hint

    async def listen(self, redis: RedisClient, channels: Callable[[], tuple[str, ...]], idle_seconds: float = 1.0) -> None:
        """One subscription: subscribe to `channels()` (the wake-up channels of the models whose
        queue is on) and deliver messages until the channels change (a reload) or the connection
        fails (raises: the supervisor runs it again). Returns at once, after `idle_seconds`, when
        there is nothing to subscribe to."""
        wanted = channels()
        if not wanted:
            await asyncio.sleep(idle_seconds)
            return
        pubsub = redis.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(*wanted)
            log.info("admission queue: listening for wake-ups of %d model(s)", len(wanted))
            while channels() == wanted:
                message = await pubsub.get_message(timeout=idle_seconds)
                if message is not None and message.get("type") == "message":
                    self.deliver(message["data"])
        finally:
            await pubsub.aclose()
