"""The ports the ext_proc server listens on: one per worker (`server.workers`, worker i on
`server.listen`'s port + i: extproc.config.schema.ServerSettings.worker_listen), never shared.

No socket option lets a second process onto a port one of ours holds (gRPC's SO_REUSEPORT is
off: extproc.operations.gateway), so a port already taken is an error at start, named here,
rather than a server that silently splits its connections with another.
"""

from __future__ import annotations

import socket


class ListenError(RuntimeError):
    """The server cannot listen on an address of its own (taken, or not an address of this host)."""


def unavailable(addresses: list[str]) -> list[str]:
    """Of `addresses` (host:port, IPv6 hosts in brackets), those this process cannot bind now,
    each as `address (why)`: a test bind as gRPC's (SO_REUSEADDR, no SO_REUSEPORT), released at
    once. Empty: every one was free a moment ago."""
    problems = []
    for address in addresses:
        host, _, port = address.rpartition(":")
        try:
            family, kind, proto, _, where = socket.getaddrinfo(host.strip("[]") or None, int(port), type=socket.SOCK_STREAM,
                                                               flags=socket.AI_PASSIVE)[0]
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(where)
        except OSError as exc:
            problems.append(f"{address} ({exc.strerror or exc})")
    return problems
