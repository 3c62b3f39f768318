"""grpc.aio's own log, cleaned of what is not an error of this server."""

from __future__ import annotations

import logging


class PeerGoneFilter(logging.Filter):
    """Drops grpc.aio's log of a status it could not send because Envoy had already ended the
    stream (`ExecuteBatchError` on `SendStatusFromServerOperation`): a client abort or upstream
    reset, which the stream end already handled (the lease is released), not a server error."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (type(exc).__name__ == "ExecuteBatchError" and "SendStatusFromServerOperation" in str(exc))


def quiet_peer_gone_errors() -> None:
    """Install PeerGoneFilter on grpc's Cython logger (idempotent)."""
    logger = logging.getLogger("grpc._cython.cygrpc")
    if not any(isinstance(f, PeerGoneFilter) for f in logger.filters):
        logger.addFilter(PeerGoneFilter())
