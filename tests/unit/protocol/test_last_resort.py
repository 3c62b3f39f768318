"""The stream loop's last resort (issue 12): an unexpected exception while handling a message is
answered with a generic 500 (code internal_error), logged with its traceback, and the lease the
request held is released. Real Redis; the failure is a request adapter of this project that
raises, standing in for a bug."""

from __future__ import annotations

import dataclasses
import logging

import orjson
import redis
from envoy.service.ext_proc.v3.external_processor_pb2 import HttpBody, ProcessingRequest

from extproc.protocol.live import build_live
from extproc.protocol.stream import ExternalProcessor, StreamState
from extproc.routing.degraded import DegradedFlags
from extproc.routing.lease_table import LeaseTable
from extproc.routing.outage import InstanceRegistry, OutagePolicy, RedisBreaker
from tests.support.gateway import live_leases


class BrokenAdapter:
    def adapt(self, provider, model, body, session_id=None):
        raise RuntimeError("internal detail the client must not see")


async def test_an_unexpected_exception_is_a_generic_500_and_releases_the_lease(redis_client, redis_url, small_config, caplog):
    degraded = DegradedFlags(redis_client, small_config)
    live = build_live(small_config, redis_client, degraded, b"secret")
    breaker = RedisBreaker(redis_client)
    outage = OutagePolicy(small_config, live.router, InstanceRegistry(redis_client, small_config.redis.key_prefix))
    leases = LeaseTable(small_config, live.state, live.router, outage, breaker)
    leases.start()
    processor = ExternalProcessor(dataclasses.replace(live, adapter=BrokenAdapter()), leases, breaker)
    stream = StreamState(path="/v1/chat/completions", method="POST")
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    request = ProcessingRequest(request_body=HttpBody(body=body, end_of_stream=True))

    with caplog.at_level(logging.ERROR, logger="extproc.protocol.stream"):
        response = await processor._handle_or_answer_500(stream, request)

    immediate = response.immediate_response
    assert immediate.status.code == 500
    error = orjson.loads(immediate.body)["error"]
    assert error["code"] == "internal_error" and error["type"] == "server_error"
    assert "internal detail" not in immediate.body.decode()
    assert any("unexpected error in the request_body phase" in r.getMessage() and r.exc_info for r in caplog.records)
    assert stream.held is not None and stream.held.lease is not None  # the decision held a lease...
    assert live_leases(redis.Redis.from_url(redis_url)) == 1
    processor._end_stream(stream)
    await leases.drain()
    assert live_leases(redis.Redis.from_url(redis_url)) == 0  # ...released at the stream's end
