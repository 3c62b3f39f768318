"""Keeping a decision's request lease alive while the request runs, and releasing it once.

The spec's execute_with_request_lease: renew every `lease_timeout_seconds / 3`, cancel the
request when the lease is lost, and release at the end, refreshing the pin only after a
successful response on a pinned provider.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from redis.exceptions import RedisError

from extproc.routing import Decision
from extproc.state import Result, RoutingState

log = logging.getLogger(__name__)


class LeaseHolder:
    """Owns one decision's lease from admission to release.

    `start()` begins background renewal; `on_lost` is called (once) when the lease is reported
    lost, either by Redis (LEASE_LOST) or because renewals failed until the lease must have
    expired. A single failed renewal is survived: with renewals every timeout/3, two may fail.
    `finish(succeeded)` stops renewal and releases; it is idempotent and safe to call from any of
    the ways a stream can end. A decision without a lease holds nothing.
    """

    def __init__(self, state: RoutingState, decision: Decision, lease_timeout_seconds: float, on_lost: Callable[[], None]):
        self.state = state
        self.decision = decision
        self._timeout = lease_timeout_seconds
        self._on_lost = on_lost
        self._renewal: asyncio.Task | None = None
        self._finished = False
        self.lost = False

    def start(self) -> None:
        """Begin renewing in the background (no-op without a lease)."""
        if self.decision.lease is not None and self._renewal is None:
            self._renewal = asyncio.get_running_loop().create_task(self._renew_forever())

    async def finish(self, succeeded: bool) -> Result | None:
        """Stop renewing and release the lease (refreshing the pin when the decision asks for it
        and `succeeded`). Returns the release result, or None when there was nothing to release,
        it was already released, or Redis could not be reached (the lease then expires by itself)."""
        if self._finished:
            return None
        self._finished = True
        if self._renewal is not None:
            self._renewal.cancel()
        lease = self.decision.lease
        if lease is None:
            return None
        refresh = self.decision.refresh_pin_on_success and succeeded and not self.lost
        try:
            update = await self.state.release_request_lease(lease, refresh_pin=refresh)
        except RedisError as exc:
            log.warning("lease %s not released (it expires within %s s): %s", lease.id, self._timeout, exc)
            return None
        return update.result

    async def _renew_forever(self) -> None:
        interval = self._timeout / 3
        expires_at = time.monotonic() + self._timeout
        while True:
            await asyncio.sleep(interval)
            try:
                update = await self.state.renew_request_lease(self.decision.lease)
            except RedisError as exc:
                if time.monotonic() + interval < expires_at:
                    log.warning("lease renewal failed, retrying: %s", exc)
                    continue
                log.warning("lease renewals failed until expiry: %s", exc)
                self._report_lost()
                return
            if update.result is Result.LEASE_LOST:
                self._report_lost()
                return
            expires_at = time.monotonic() + self._timeout

    def _report_lost(self) -> None:
        self.lost = True
        self._on_lost()
