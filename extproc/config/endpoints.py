"""The endpoints of a provider with affinity `pick`, as Envoy knows them: `ip:port`.

The router names the endpoint it picked in the endpoint-picker protocol's header
(`x-gateway-destination-endpoint`) and Envoy's override_host policy matches it against its
cluster's hosts by address, so an endpoint's identity is its `ip:port` (`[ip]:port` for IPv6),
never a host name. `endpoints` take one of two forms:

- URLs, one per replica: a URL with a host name is resolved once, when the config is loaded (the
  first address the resolver gives);
- one URL whose host is a DNS name (`dns_name`): a Kubernetes headless Service, each address it
  resolves to one endpoint on the URL's port. The name is resolved when the config is loaded and
  again every `routing.placement.dns_refresh_seconds` (extproc.routing.endpoint_refresh); Envoy's
  cluster over it is STRICT_DNS, which re-resolves on the same period (envoy_render.pick_cluster).

Addresses are taken as Envoy's `dns_lookup_family: V4_PREFERRED` takes them: the IPv4 ones when
there are any, else the IPv6 ones. The resolver is injectable (`Resolver`), so a test can stand a
changing answer in for DNS.
"""

from __future__ import annotations

import ipaddress
import socket
from functools import lru_cache
from typing import Protocol
from urllib.parse import urlsplit


class EndpointError(ValueError):
    """An endpoint URL that names no usable address (a host name that does not resolve)."""


class Resolver(Protocol):
    """What resolves a host name to addresses (blocking; the refresh loop runs it in a thread)."""

    def resolve(self, host: str, port: int) -> list[str]:
        """The addresses of `host` (IP address strings, any order, possibly repeated). Raises
        EndpointError when the name does not resolve."""
        ...


class SystemResolver:
    """The system's resolver (`getaddrinfo`: /etc/hosts, then DNS)."""

    def resolve(self, host: str, port: int) -> list[str]:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise EndpointError(f"{host!r} does not resolve: {exc.strerror or exc}") from None
        return [info[4][0] for info in infos]


SYSTEM_RESOLVER = SystemResolver()


def dns_name(urls: list[str] | tuple[str, ...]) -> tuple[str, int] | None:
    """The (host name, port) when `urls` is one URL whose host is a DNS name (not an IP
    address): each address of the name is an endpoint. None for IP addresses or several URLs."""
    if len(urls) != 1:
        return None
    host, port = _host_port(urls[0])
    return None if is_ip(host) else (host, port)


def pick_endpoints(urls: list[str] | tuple[str, ...], resolver: Resolver = SYSTEM_RESOLVER) -> tuple[str, ...]:
    """The `ip:port` identity of each endpoint of `urls` (http(s)://host[:port]; the port defaults
    to 80 or 443): one per URL, in order; for one DNS name (`dns_name`), one per address it
    resolves to, sorted (every proxy lists them alike). Raises EndpointError for a host name that
    does not resolve (or resolves to nothing)."""
    name = dns_name(urls)
    if name is not None:
        return name_endpoints(*name, resolver)
    return _resolved(tuple(urls))


def name_endpoints(host: str, port: int, resolver: Resolver = SYSTEM_RESOLVER) -> tuple[str, ...]:
    """Every endpoint `host` resolves to, on `port`, as `identity` makes them, sorted and without
    repeats; IPv4 addresses when there are any, else IPv6 (Envoy's V4_PREFERRED). Raises
    EndpointError when there is none."""
    addresses = {ipaddress.ip_address(a.split("%")[0]) for a in resolver.resolve(host, port)}
    preferred = sorted(a for a in addresses if a.version == 4) or sorted(a for a in addresses if a.version == 6)
    if not preferred:
        raise EndpointError(f"{host!r} resolves to no address")
    return tuple(identity(str(a), port) for a in preferred)


@lru_cache(maxsize=256)
def _resolved(urls: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(endpoint_identity(url) for url in urls)


def endpoint_identity(url: str) -> str:
    """`url`'s endpoint as Envoy names a host: `ip:port`, or `[ip]:port` for IPv6. Raises
    EndpointError when its host name does not resolve."""
    host, port = _host_port(url)
    if is_ip(host):
        return identity(host, port)
    addresses = SYSTEM_RESOLVER.resolve(host, port)
    return identity(sorted(addresses, key=lambda a: ":" in a)[0], port)


def identity(address: str, port: int) -> str:
    """`address` and `port` as Envoy names a host: `ip:port`, or `[ip]:port` for IPv6."""
    parsed = ipaddress.ip_address(address)
    return f"[{parsed}]:{port}" if parsed.version == 6 else f"{parsed}:{port}"


def split_identity(endpoint: str) -> tuple[str, int]:
    """The (address, port) of an identity `endpoint_identity` made."""
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def _host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)


def is_ip(host: str) -> bool:
    """Whether `host` is an IP address (v4 or v6), not a name."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
