"""The endpoints of a provider with affinity `pick`, as Envoy knows them: `ip:port`.

The router names the endpoint it picked in the endpoint-picker protocol's header
(`x-gateway-destination-endpoint`) and Envoy's override_host policy matches it against its
cluster's hosts by address, so an endpoint's identity is its `ip:port` (`[ip]:port` for IPv6),
never a host name. A URL with a host name is resolved once, when the config is loaded (the first
address the resolver gives); re-resolving a name periodically is later work (issue 30).
"""

from __future__ import annotations

import ipaddress
import socket
from functools import lru_cache
from urllib.parse import urlsplit


class EndpointError(ValueError):
    """An endpoint URL that names no usable address (a host name that does not resolve)."""


def pick_endpoints(urls: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """The `ip:port` identity of each of `urls` (http(s)://host[:port]; the port defaults to 80
    or 443), in order. Raises EndpointError for a host name that does not resolve."""
    return _resolved(tuple(urls))


@lru_cache(maxsize=256)
def _resolved(urls: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(endpoint_identity(url) for url in urls)


def endpoint_identity(url: str) -> str:
    """`url`'s endpoint as Envoy names a host: `ip:port`, or `[ip]:port` for IPv6. Raises
    EndpointError when its host name does not resolve."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise EndpointError(f"{host!r} does not resolve: {exc.strerror or exc}") from None
        address = ipaddress.ip_address(sorted(infos, key=lambda info: info[0] != socket.AF_INET)[0][4][0])
    return f"[{address}]:{port}" if address.version == 6 else f"{address}:{port}"


def split_identity(endpoint: str) -> tuple[str, int]:
    """The (address, port) of an identity `endpoint_identity` made."""
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)
