"""Supervised background work: a periodic task that no exception can end.

Every background loop of the ext_proc server (health and load checks, the instance heartbeat,
the degraded-flag refresh, the Redis probe, the passive-failure writers) runs its work one step
at a time through `run_every`. A step that raises anything but cancellation is a failure: it is
counted in `iris_background_task_restarts_total{task}`, logged once per failure streak (with its
traceback; the recovery is logged too), and the next step comes after a backoff that doubles
from `MIN_BACKOFF_SECONDS` up to the task's interval (at least 1 s), so a failing task neither
spins nor falls silent. The state a step keeps lives in its owner, so a restart loses nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from extproc import metrics

log = logging.getLogger(__name__)

MIN_BACKOFF_SECONDS = 0.05

def backoff_seconds(failures: int, max_seconds: float) -> float:
    """The wait after the `failures`-th failure in a row (seconds): MIN_BACKOFF_SECONDS doubled
    per failure, capped at `max_seconds`."""
    return min(max_seconds, MIN_BACKOFF_SECONDS * 2 ** (failures - 1))


async def run_every(
    task: str,
    step: Callable[[], Awaitable[object]],
    interval_seconds: float,
    *,
    max_backoff_seconds: float | None = None,
) -> None:
    """Run `step()` every `interval_seconds` (seconds, from the start of one step to the start of
    the next; 0: back to back, for a step that waits itself) until cancelled. A step that raises
    is restarted after a backoff (at most `max_backoff_seconds`, default the interval or 1 s,
    whichever is longer) and counted under `task`. Never returns; raises only CancelledError.

    A cancellation is final even when the step swallows it: Python 3.11's `asyncio.wait_for`
    (redis-py wraps every send and read in one) can lose a cancel that arrives as its call
    completes, and the step then returns normally. The loop checks its task's pending cancels
    after each step, so a drain that cancels it never leaves it running past the clients it
    uses (issue 29 item 17)."""
    cap = max_backoff_seconds if max_backoff_seconds is not None else max(interval_seconds, 1.0)
    loop = asyncio.get_running_loop()
    current = asyncio.current_task()
    failures = 0
    while True:
        started = loop.time()
        try:
            await step()
            _stop_if_cancelled(current)
        except asyncio.CancelledError:
            raise
        except Exception:
            _stop_if_cancelled(current)
            failures += 1
            metrics.RESTARTS.labels(task).inc()
            if failures == 1:
                log.exception("background task %s failed; restarting with a backoff until it succeeds", task)
            await asyncio.sleep(backoff_seconds(failures, cap))
            continue
        if failures:
            log.warning("background task %s recovered after %d failed attempts", task, failures)
            failures = 0
        await asyncio.sleep(max(0.0, interval_seconds - (loop.time() - started)))


def _stop_if_cancelled(task: asyncio.Task | None) -> None:
    """Raise CancelledError when `task` was asked to cancel and the cancel was swallowed."""
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
