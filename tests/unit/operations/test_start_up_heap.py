"""The worker freezes its start-up heap (extproc.operations.gateway.freeze_start_up_heap): a full
collection of the garbage collector, which stops the event loop while it runs, walks only the
objects built since, not the ~84,000 that live as long as the process."""

from __future__ import annotations

import asyncio
import contextlib
import gc

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.config import parse_config
from extproc.operations.gateway import Gateway
from irislab.processes import free_port
from tests.support.configs import small_config_data

SECRET = b"x9Qm2vLr8TzP4kWn7cYb3HfD6sJg1aEu"


async def test_a_started_gateway_leaves_its_start_up_objects_to_no_collection(redis_url):
    data = small_config_data(redis_url)
    data["server"] = {**data.get("server", {}), "listen": f"127.0.0.1:{free_port()}"}
    gateway = Gateway(parse_config(data), SECRET)
    try:
        assert any(o is gateway.processor for o in gc.get_objects())  # built, not yet frozen
        await gateway.start()
        assert gc.get_freeze_count() > 10_000
        tracked = gc.get_objects()
        assert not any(o is gateway.processor or o is gateway.leases for o in tracked)
        built_later = [object()]  # a list: tracked by the collector
        assert any(o is built_later for o in gc.get_objects())
    finally:
        await gateway.drain(delay_seconds=0)
        gc.unfreeze()


async def test_a_gateway_drained_right_after_its_start_leaves_no_task_behind(redis_url):
    """Issue 29 item 17: drained as soon as it started, while its heartbeat's first Redis call
    runs, the gateway ends every background task before closing its clients. It once left the
    cancelled heartbeat waiting on a send that never ran, and the event loop's close waited for
    it forever (the 300 s timeout of a suite run): with grpc's poller engine, which the process
    uses once a synchronous grpc channel was made in it (an earlier test's, the OTLP exporter's)."""
    with grpc.insecure_channel(f"127.0.0.1:{free_port()}") as channel:
        with contextlib.suppress(grpc.RpcError):
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
    data = small_config_data(redis_url)
    data["server"] = {**data.get("server", {}), "listen": f"127.0.0.1:{free_port()}"}
    gateway = Gateway(parse_config(data), SECRET)
    try:
        await gateway.start()
    finally:
        await gateway.drain(delay_seconds=0)
        gc.unfreeze()
    left = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    assert left == [], [t.get_coro().cr_frame.f_locals.get("task") for t in left]
