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
from extproc.state import Lease, Result, RoutingState

log = logging.getLogger(__name__)


class LeaseHolder:
    """Owns one decision's lease from admission to release.

    `start()` begins background renewal; `on_lost` is called (once) when the lease is reported
    lost, either by Redis (LEASE_LOST) or because renewals failed until the lease must have
    expired. A single failed renewal is survived: with renewals every timeout/3, two may fail.
    `finish(succeeded)` stops renewal and releases; it is idempotent and safe to call from any of
    the ways a stream can end. A decision without a lease holds nothing.

    A local decision (made during a Redis outage) holds a lease in this process: `release_local`
    gives it back and answers False once the lease was adopted into Redis; only then is it
    renewed and released there.
    """

    release_retry_seconds = 0.5

    def __init__(
        self,
        state: RoutingState,
        decision: Decision,
        lease_timeout_seconds: float,
        on_lost: Callable[[], None],
        release_local: Callable[[Lease], bool] | None = None,
        is_adopted: Callable[[Lease], bool] | None = None,
    ):
        self.state = state
        self.decision = decision
        self._timeout = lease_timeout_seconds
        self._on_lost = on_lost
        self._release_local = release_local
        self._is_adopted = is_adopted
        self._first_renewal: asyncio.TimerHandle | None = None
        self._renewal: asyncio.Task | None = None
        self._expires_at = time.monotonic() + lease_timeout_seconds  # the caller's clock
        self._finished = False
        self.lost = False

    def start(self) -> None:
        """Begin renewing in the background (no-op without a lease). Most requests end before
        the first renewal is due, so the renewal task is only created then."""
        if self.decision.lease is not None and self._first_renewal is None:
            loop = asyncio.get_running_loop()
            self._first_renewal = loop.call_later(self._timeout / 3, self._start_renewing)

    def _start_renewing(self) -> None:
        if not self._finished:
            self._renewal = asyncio.get_running_loop().create_task(self._renew_forever())

    async def finish(self, succeeded: bool) -> Result | None:
        """Stop renewing and release the lease (refreshing the pin when the decision asks for it
        and `succeeded`). Returns the release result, or None when there was nothing to release,
        it was already released, or Redis could not be reached (the lease then expires by itself)."""
        if self._finished:
            return None
        self._finished = True
        if self._first_renewal is not None:
            self._first_renewal.cancel()
        if self._renewal is not None:
            self._renewal.cancel()
        lease = self.decision.lease
        if lease is None:
            return None
        if self.decision.local and self._release_local is not None and self._release_local(lease):
            return Result.RELEASED
        refresh = self.decision.refresh_pin_on_success and succeeded and not self.lost
        while True:
            try:
                return (await self.state.release_request_lease(lease, refresh_pin=refresh)).result
            except RedisError as exc:
                if time.monotonic() + self.release_retry_seconds >= self._expires_at:
                    log.warning("lease %s not released, it expires by itself: %s", lease.id, exc)
                    return None
            await asyncio.sleep(self.release_retry_seconds)

    async def _renew_forever(self) -> None:
        interval = self._timeout / 3
        while True:
            if self.decision.local and not (self._is_adopted and self._is_adopted(self.decision.lease)):
                self._expires_at = time.monotonic() + self._timeout
            elif not await self._renew_once(interval):
                self._report_lost()
                return
            await asyncio.sleep(interval)

    async def _renew_once(self, interval: float) -> bool:
        """One renewal. False when the lease is lost: Redis says so, or it failed and the next
        try would come after the lease has expired."""
        renewed_at = time.monotonic()
        try:
            update = await self.state.renew_request_lease(self.decision.lease)
        except RedisError as exc:
            if time.monotonic() + interval < self._expires_at:
                log.warning("lease renewal failed, retrying: %s", exc)
                return True
            log.warning("lease renewals failed until expiry: %s", exc)
            return False
        if update.result is Result.LEASE_LOST:
            return False
        self._expires_at = renewed_at + self._timeout
        return True

    def _report_lost(self) -> None:
        self.lost = True
        self._on_lost()
