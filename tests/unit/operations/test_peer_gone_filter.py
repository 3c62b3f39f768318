"""grpc.aio logs a status it could not send to a stream Envoy had already ended (a client abort):
the server drops that record and keeps every other one of grpc's errors."""

from __future__ import annotations

import logging

from grpc._cython import cygrpc

from extproc.operations.grpc_logs import PeerGoneFilter, quiet_peer_gone_errors


def _record(exc: BaseException) -> logging.LogRecord:
    return logging.LogRecord("grpc._cython.cygrpc", logging.ERROR, __file__, 1, "Unexpected error", None, (type(exc), exc, None))


def test_a_status_to_a_gone_peer_is_dropped_and_other_errors_are_kept():
    gone = cygrpc.ExecuteBatchError('Failed "execute_batch": (<grpc._cython.cygrpc.SendStatusFromServerOperation object at 0x1>,)')
    other_batch = cygrpc.ExecuteBatchError('Failed "execute_batch": (<grpc._cython.cygrpc.SendMessageOperation object at 0x1>,)')
    assert not PeerGoneFilter().filter(_record(gone))
    assert PeerGoneFilter().filter(_record(other_batch))
    assert PeerGoneFilter().filter(_record(RuntimeError("boom")))


def test_installed_once_on_grpcs_logger():
    quiet_peer_gone_errors()
    quiet_peer_gone_errors()
    assert sum(isinstance(f, PeerGoneFilter) for f in logging.getLogger("grpc._cython.cygrpc").filters) == 1
