"""The Redis breaker counts per scope (issue 29 items 3, 4): a model's failures open that model
only, the fleet's keys (epoch, registry) open every model's decisions, a success of one scope
resets that scope's run only, and a busy pool is never counted."""

from __future__ import annotations

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TryAgainError

from extproc.routing.outage import RedisBreaker


def test_a_models_failures_open_that_model_only():
    breaker = RedisBreaker(None, failures_in_a_row=3)
    for _ in range(2):
        breaker.record_failure(TryAgainError("Multiple keys request during rehashing of slot"), "moving")
        breaker.record_success("other")  # another model's success does not reset the moving model's run
    assert not breaker.is_open
    breaker.record_failure(TryAgainError("again"), "moving")
    assert breaker.open_models == {"moving"} and breaker.is_open and not breaker.fleet_open
    assert breaker.open_for("moving") and not breaker.open_for("other")
    breaker.close("moving")
    assert not breaker.is_open and not breaker.open_for("moving")


def test_the_fleets_scope_opens_every_models_decisions():
    breaker = RedisBreaker(None, failures_in_a_row=2)
    breaker.record_failure(RedisConnectionError("epoch"))
    breaker.record_success("m")
    breaker.record_failure(RedisConnectionError("epoch"))
    assert breaker.fleet_open and breaker.open_for("m") and breaker.open_for("e") and breaker.open_models == frozenset()
    breaker.hold_until_recovered("m")
    breaker.close()
    assert not breaker.fleet_open and breaker.open_for("m") and not breaker.open_for("e")


def test_a_busy_pool_is_not_counted():
    breaker = RedisBreaker(None, failures_in_a_row=1)
    busy = RedisConnectionError("No connection available.")
    busy.__cause__ = TimeoutError()
    breaker.record_failure(busy, "m")
    assert not breaker.is_open and breaker.failures_seen == 0
