"""The Envoy bootstrap rendered from the routing config, so that one file is the source of both.

`render(config, template)` starts from a template bootstrap (the shipped envoy/envoy.yaml: its
listener, limits, ext_proc filter, access log and local replies) and makes it agree with the
routing config:

- the ext_proc filter's cluster reaches `server.listen` and every worker's port (`server.workers`:
  worker i on listen's port + i), one endpoint each, over which the template's cluster balances
  streams (envoy/envoy.yaml: LEAST_REQUEST);
- each ext_proc filter forwards only the headers the server reads (`forward_rules.allowed_headers`:
  envoy_check.read_headers, the config's session, identity, credential and class headers
  included), so Envoy does not serialize every other request and response header into each message;
- the route's cluster_header is `server.routing_header` and hashes on `server.affinity_header`;
  the early header mutation removes both and the trusted identity headers (a client's own copies);
- every provider with `endpoints` gets its cluster built from them (`provider_clusters`): STATIC
  for IP addresses, STRICT_DNS for names (a headless Service resolves to every replica); for
  https, TLS that verifies the provider's certificate chain (against the provider's
  `tls_ca_file`, else the system's bundle) and name (the endpoint's host, which is also the SNI),
  as envoy/third-party-cluster.example.yaml does: with endpoints on several host names, each
  endpoint's own (a transport socket match per host name, picked by the endpoint's metadata);
  MAGLEV with bounded load for a pool whose sessions keep their replica (`session_hash`: a
  replica above 1.5 x the pool's mean of active requests passes a new request to the next replica
  of the hash), LEAST_REQUEST otherwise;
  the template's provider settings (timeouts, buffer limit, HTTP options, circuit breakers); for a
  managed provider over HTTP/1.1, one request per upstream connection (`set_connection_reuse`: an engine that
  closes a connection after a streamed answer never gets a request on it), Envoy's own health check of each replica and outlier detection, so that a
  failed replica leaves the hash ring and only its sessions move; a `sessionless_cluster` over
  the same replicas balancing by least request;
- a provider without `endpoints` keeps the template's cluster of that name; every other cluster
  of the template stays too, in its place (a JWKS cluster that jwt_authn fetches keys from, a
  collector's, ...); a rendered cluster replaces the template's of the same name.
- a provider with affinity `pick` (the router picks the endpoint: `render_pick`): its cluster is
  STATIC over the endpoints' `ip:port` identities (STRICT_DNS over the name when the endpoints
  are one DNS name, re-resolved every `routing.placement.dns_refresh_seconds`), with Envoy's override_host load-balancing
  policy reading the endpoint-picker protocol's header and `envoy.lb` metadata, MAGLEV on the
  session key as its fallback, each https endpoint keeping its transport socket match; the ext_proc filter accepts the `envoy.lb` namespace and the
  early header mutation removes a client's copy of the header.

The result passes extproc.config.envoy_check against the same config (tested).
"""

from __future__ import annotations

import copy
from typing import Any
from urllib.parse import urlsplit

from extproc.config.endpoints import dns_name, is_ip, pick_endpoints, split_identity
from extproc.config.envoy_check import (
    DESTINATION_ENDPOINT_HEADER,
    EXT_PROC_FILTER,
    HCM_FILTER,
    LB_METADATA_NAMESPACE,
    OVERRIDE_HOST_POLICY,
    connection_managers,
    read_headers,
)
from extproc.config.schema import Affinity, Config, Provider, ProviderKind

PROTOTYPE_KEYS = ("connect_timeout", "per_connection_buffer_limit_bytes", "typed_extension_protocol_options", "circuit_breakers")
DEFAULT_HEALTH_PATH = "/health"
HASH_BALANCE_FACTOR = 150  # percent of the pool's mean active requests a replica may carry (Envoy's bounded load)
TLS_SOCKET = "envoy.transport_sockets.tls"
TLS_CONTEXT_TYPE = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"
SYSTEM_CA_FILE = "/etc/ssl/certs/ca-certificates.crt"  # the system's CA bundle in Envoy's image (Debian, Ubuntu)
SOCKET_MATCH_FILTER = "envoy.transport_socket_match"  # the endpoint metadata Envoy matches transport_socket_matches on
SOCKET_MATCH_KEY = "host"
HTTP_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
HTTP_OPTIONS_TYPE = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
PROTOCOL_SELECTION_FIELDS = ("explicit_http_config", "auto_config", "use_downstream_protocol_config")  # HttpProtocolOptions' oneof


class RenderError(ValueError):
    """The template cannot carry the config: it lacks the listener, the ext_proc filter, or a
    cluster that a provider without `endpoints` names."""


def render(config: Config, template: dict[str, Any]) -> dict[str, Any]:
    """The bootstrap for `config` from `template` (not modified). Raises RenderError, for a
    template whose shape cannot be read too."""
    try:
        return _render(config, template)
    except (TypeError, KeyError, AttributeError, IndexError) as exc:
        raise RenderError(f"the template's shape cannot be read ({type(exc).__name__}: {exc}); `iris-extproc check` names "
                          "what is wrong in it") from None


def _render(config: Config, template: dict[str, Any]) -> dict[str, Any]:
    bootstrap = copy.deepcopy(template)
    resources = bootstrap.setdefault("static_resources", {})
    clusters = {c["name"]: c for c in resources.get("clusters") or []}
    managers = [_typed(f) for listener in resources.get("listeners") or [] for chain in listener.get("filter_chains") or []
                for f in chain.get("filters") or [] if f.get("name") == HCM_FILTER]
    if not managers:
        raise RenderError("the template has no listener with an http_connection_manager")
    ext_proc_clusters = set()
    for manager in managers:
        ext_proc_clusters |= _point_ext_proc(manager, clusters, config.server.listen, config.server.worker_ports())
        _set_route_headers(manager, config)
    forward_read_headers(bootstrap, config)
    prototype = _provider_prototype(clusters, ext_proc_clusters)
    rendered: dict[str, dict[str, Any]] = {}
    for provider in config.providers:
        rendered.update(provider_clusters(provider, prototype, clusters))
    render_pick(bootstrap, config, rendered)
    resources["clusters"] = [rendered.pop(name, cluster) for name, cluster in clusters.items()] + list(rendered.values())
    return bootstrap


def provider_clusters(provider: Provider, prototype: dict[str, Any], template_clusters: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The clusters rendered for `provider`, by name: its `cluster` (and `sessionless_cluster`)
    built from its endpoints; none for a provider without endpoints, whose clusters the template
    must have (RenderError otherwise). `prototype`: the settings each copies (`_provider_prototype`)."""
    if not provider.endpoints:
        for name in filter(None, (provider.cluster, provider.sessionless_cluster)):
            if name not in template_clusters:
                raise RenderError(f"provider {provider.name} has no endpoints and the template has no cluster {name!r}")
        return {}
    rendered = {provider.cluster: _provider_cluster(provider, provider.cluster, prototype, sessions=True)}
    if provider.sessionless_cluster:
        rendered[provider.sessionless_cluster] = _provider_cluster(provider, provider.sessionless_cluster, prototype, sessions=False)
    return rendered


def forward_read_headers(bootstrap: dict[str, Any], config: Config) -> dict[str, Any]:
    """`bootstrap` (modified in place and returned) with every ext_proc filter forwarding exactly
    the headers the server reads under `config` (envoy_check.read_headers), as exact matches in
    `forward_rules.allowed_headers` (Envoy applies them to request and response headers alike,
    pseudo-headers included). A template's `disallowed_headers` are kept."""
    patterns = [{"exact": header} for header in read_headers(config)]
    for manager in connection_managers(bootstrap):
        for http_filter in manager.get("http_filters") or []:
            if http_filter.get("name") == EXT_PROC_FILTER:
                rules = http_filter.setdefault("typed_config", {}).setdefault("forward_rules", {})
                rules["allowed_headers"] = {"patterns": patterns}
    return bootstrap


def _typed(network_filter: dict[str, Any]) -> dict[str, Any]:
    return network_filter.setdefault("typed_config", {})


def _point_ext_proc(manager: dict[str, Any], clusters: dict[str, Any], listen: str, ports: list[int]) -> set[str]:
    """Send each ext_proc filter's cluster to `listen`'s host (0.0.0.0 or :: become loopback) on
    each of `ports` (one endpoint per worker); return the clusters' names."""
    host, _, _ = listen.rpartition(":")
    host = host.strip("[]")
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"
    names = set()
    for http_filter in manager.get("http_filters") or []:
        if http_filter.get("name") != EXT_PROC_FILTER:
            continue
        name = ((http_filter.get("typed_config") or {}).get("grpc_service") or {}).get("envoy_grpc", {}).get("cluster_name")
        if name not in clusters:
            raise RenderError(f"the template's ext_proc filter names cluster {name!r}, which it lacks")
        names.add(name)
        endpoints = [{"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}} for port in ports]
        clusters[name]["load_assignment"] = {"cluster_name": name, "endpoints": [{"lb_endpoints": endpoints}]}
    if not names:
        raise RenderError("the template has no ext_proc filter with an envoy_grpc cluster")
    return names


def _set_route_headers(manager: dict[str, Any], config: Config) -> None:
    """The routing route reads config's routing header and hashes on its affinity header; the
    early mutation strips both, and the trusted identity headers, from clients."""
    routing, affinity = config.server.routing_header, config.server.affinity_header
    for host in (manager.get("route_config") or {}).get("virtual_hosts") or []:
        for route in host.get("routes") or []:
            action = route.get("route") or {}
            if "cluster_header" not in action:
                continue
            old = action["cluster_header"]
            action["cluster_header"] = routing
            for matcher in (route.get("match") or {}).get("headers") or []:
                if matcher.get("name") == old:
                    matcher["name"] = routing
            if route.get("request_headers_to_remove"):
                route["request_headers_to_remove"] = [routing if h == old else h for h in route["request_headers_to_remove"]]
            action["hash_policy"] = [{"header": {"header_name": affinity}}]
    stripped = [routing, affinity, *config.session.trusted_identity_headers]
    extensions = manager.setdefault("early_header_mutation_extensions", [])
    if not extensions:
        extensions.append({
            "name": "envoy.http.early_header_mutation.header_mutation",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation",
                "mutations": [],
            },
        })
    mutations = extensions[0]["typed_config"].setdefault("mutations", [])
    mutations[:] = [m for m in mutations if "remove" not in m] + [{"remove": header} for header in dict.fromkeys(stripped)]


def _provider_prototype(clusters: dict[str, Any], ext_proc_clusters: set[str]) -> dict[str, Any]:
    """The settings every rendered provider cluster copies: those of the template's first
    provider cluster (any cluster but ext_proc's), else Envoy's defaults and a 2 s connect
    timeout."""
    for name, cluster in clusters.items():
        if name not in ext_proc_clusters:
            return {key: copy.deepcopy(cluster[key]) for key in PROTOTYPE_KEYS if key in cluster}
    return {"connect_timeout": "2s"}


def _provider_cluster(provider: Provider, name: str, prototype: dict[str, Any], sessions: bool) -> dict[str, Any]:
    """The cluster `name` over `provider`'s endpoints; `sessions`: the cluster that carries the
    provider's sessions (hashed for a pool), else the least-request one for sessionless requests."""
    urls = [urlsplit(url) for url in provider.endpoints]
    tls = urls[0].scheme == "https"
    addresses = [(url.hostname, url.port or (443 if tls else 80)) for url in urls]
    cluster: dict[str, Any] = {"name": name, "type": "STATIC" if all(is_ip(host) for host, _ in addresses) else "STRICT_DNS"}
    cluster.update(copy.deepcopy(prototype))
    _set_balancing(cluster, provider, sessions)
    set_connection_reuse(cluster, provider, tls)
    if cluster["type"] == "STRICT_DNS":
        cluster["dns_lookup_family"] = "V4_PREFERRED"
    hosts = list(dict.fromkeys(host for host, _ in addresses))
    matched = tls and len(hosts) > 1  # each endpoint picks its host's transport socket by its metadata
    cluster["load_assignment"] = {
        "cluster_name": name,
        "endpoints": [{"lb_endpoints": [_lb_endpoint(host, port, host if matched else None) for host, port in addresses]}],
    }
    if tls:
        cluster.update(_verified_tls(hosts, provider.tls_ca_file or SYSTEM_CA_FILE))
    if provider.kind is ProviderKind.MANAGED:
        cluster["health_checks"] = [{
            "timeout": "1s", "interval": "2s", "unhealthy_threshold": 2, "healthy_threshold": 1,
            "http_health_check": {"path": _health_path(provider)},
        }]
        cluster["outlier_detection"] = {
            "consecutive_5xx": 5, "consecutive_local_origin_failure": 3, "split_external_local_origin_errors": True,
            "interval": "5s", "base_ejection_time": "30s", "max_ejection_percent": 50,
        }
    return cluster


def _set_balancing(cluster: dict[str, Any], provider: Provider, sessions: bool) -> None:
    """The cluster's load balancer: MAGLEV with bounded load for the sessions of a pool that
    hashes them (`session_hash`: a replica above 1.5 x the pool's mean passes new sessions to
    the next of the hash), LEAST_REQUEST otherwise."""
    hashed = sessions and provider.session_affinity is Affinity.SESSION_HASH
    cluster["lb_policy"] = "MAGLEV" if hashed else "LEAST_REQUEST"
    if hashed:
        cluster["common_lb_config"] = {"consistent_hashing_lb_config": {"hash_balance_factor": HASH_BALANCE_FACTOR}}


def set_connection_reuse(cluster: dict[str, Any], provider: Provider, tls: bool) -> dict[str, Any]:
    """`cluster` (modified in place and returned) with its upstream HTTP/1.1 connections reused
    or not, by `provider`'s kind, in the cluster's `HttpProtocolOptions` (`tls`: whether the
    cluster's endpoints are https):

    - the protocol: the template's (copied from its first provider cluster), set only when it
      sets none of the oneof `explicit_http_config`, `auto_config`,
      `use_downstream_protocol_config` (then HTTP/1.1, as envoy.yaml's; a second one of them makes
      Envoy refuse the bootstrap). `auto_config` on a cluster without TLS becomes HTTP/1.1
      (`explicit_http_config` with auto_config's `http_protocol_options`): it picks the protocol
      by ALPN, which needs TLS, and Envoy refuses it on a plaintext cluster ("ALPN configured for
      cluster ... which has a non-ALPN transport socket").
    - managed, over HTTP/1.1 only (`explicit_http_config.http_protocol_options`): one request
      per connection (`common_http_protocol_options.max_requests_per_connection: 1`).
      llama.cpp's server announces keep-alive on a streamed answer, then closes the
      connection right after its last chunk; Envoy returns the connection
      to its pool at that last chunk and may send the next request on it before it reads the
      close: the request is lost (503, flag UC, `upstream_reset_before_response_started
      {connection_termination}`), and no retry is safe, since it was sent. A new connection per
      request never meets a connection the engine is closing; a connection refused is retried
      (the route's `connect-failure`), nothing having been sent. Its cost is one TCP handshake
      per request to a replica (docs/operations.md "Upstream connections").
    - managed over HTTP/2, or a protocol that may become HTTP/2 (`auto_config` by ALPN,
      `use_downstream_protocol_config` by the client's): no limit, the streams sharing
      connections (one stream per connection would pay a TLS handshake per request). An engine
      that closes connections as llama.cpp does speaks HTTP/1.1 only, so ALPN gives HTTP/1.1 and
      the race is back: give such a provider's template cluster `explicit_http_config`.
    - unlimited: reused (a third party over TLS would pay a handshake per request), the
      template's `idle_timeout` closing them before its keep-alive does.

    A `max_requests_per_connection` the copied options carry is never kept: it was set for the
    template's cluster, not this one.

    Source: llama.cpp tools/server/server-http.cpp (the stream's provider returns false after
    `sink.done()`, which cpp-httplib reads as cancelled and closes on), RFC 9112 section 9.3.1
    (a request sent on a connection the server closes may not be retried unless idempotent),
    Envoy's HttpProtocolOptions (envoy/extensions/upstreams/http/v3/http_protocol_options.proto)."""
    options = cluster.setdefault("typed_extension_protocol_options", {}).setdefault(HTTP_OPTIONS, {"@type": HTTP_OPTIONS_TYPE})
    if not tls and "auto_config" in options:
        options["explicit_http_config"] = {"http_protocol_options": (options.pop("auto_config") or {}).get("http_protocol_options", {})}
    if not any(field in options for field in PROTOCOL_SELECTION_FIELDS):  # one of a oneof: never a second one
        options["explicit_http_config"] = {"http_protocol_options": {}}
    common = options.setdefault("common_http_protocol_options", {})
    if provider.kind is ProviderKind.MANAGED and _http1_only(options):
        common["max_requests_per_connection"] = 1
    else:
        common.pop("max_requests_per_connection", None)
    return cluster


def _http1_only(options: dict[str, Any]) -> bool:
    """Whether an `HttpProtocolOptions` speaks HTTP/1.1 only: `explicit_http_config` with
    `http_protocol_options`. `auto_config` may become HTTP/2 by ALPN and
    `use_downstream_protocol_config` by the client's protocol: both may multiplex streams."""
    return "http_protocol_options" in (options.get("explicit_http_config") or {})


def _lb_endpoint(address: str, port: int, tls_host: str | None) -> dict[str, Any]:
    """One endpoint of a load assignment at `address` (an IP address or a host name) and `port`;
    `tls_host` (the endpoint's host name as its URL writes it): with the metadata that picks that
    host's transport socket (Envoy's transport_socket_matches, `_verified_tls`)."""
    endpoint: dict[str, Any] = {"endpoint": {"address": {"socket_address": {"address": address, "port_value": port}}}}
    if tls_host is not None:
        endpoint["metadata"] = {"filter_metadata": {SOCKET_MATCH_FILTER: {SOCKET_MATCH_KEY: tls_host}}}
    return endpoint


def _verified_tls(hosts: list[str], ca_file: str) -> dict[str, Any]:
    """The cluster's TLS (`hosts`: the endpoints' host names, in order): `transport_socket` for
    the first; with several, a `transport_socket_matches` entry per host too, which each
    endpoint's metadata picks (the default is never plaintext: an endpoint that matched none
    would still have to show the first host's certificate)."""
    sockets: dict[str, Any] = {"transport_socket": _tls_socket(hosts[0], ca_file)}
    if len(hosts) > 1:
        sockets["transport_socket_matches"] = [
            {"name": f"tls-{host}", "match": {SOCKET_MATCH_KEY: host}, "transport_socket": _tls_socket(host, ca_file)} for host in hosts
        ]
    return sockets


def _tls_socket(host: str, ca_file: str) -> dict[str, Any]:
    """TLS to `host` that verifies the certificate chain against `ca_file` (PEM, on Envoy's host)
    and the certificate's name against `host` (a DNS or IP subject alternative name), with
    `host` as SNI (not for an IP address, which SNI cannot carry)."""
    ip = is_ip(host)
    context: dict[str, Any] = {"@type": TLS_CONTEXT_TYPE}
    if not ip:
        context["sni"] = host
    context["common_tls_context"] = {"validation_context": {
        "trusted_ca": {"filename": ca_file},
        "match_typed_subject_alt_names": [{"san_type": "IP_ADDRESS" if ip else "DNS", "matcher": {"exact": host}}],
    }}
    return {"name": TLS_SOCKET, "typed_config": context}


def _health_path(provider: Provider) -> str:
    """The path Envoy checks on each replica: the provider health check's path, else /health."""
    if provider.health_check is not None:
        return urlsplit(provider.health_check.url).path or DEFAULT_HEALTH_PATH
    return DEFAULT_HEALTH_PATH



# ---- affinity pick: the endpoint-picker protocol's clusters (issue 30) ---------------------------

OVERRIDE_HOST_TYPE = "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost"
MAGLEV_POLICY = "envoy.load_balancing_policies.maglev"
MAGLEV_TYPE = "type.googleapis.com/envoy.extensions.load_balancing_policies.maglev.v3.Maglev"


def render_pick(bootstrap: dict[str, Any], config: Config, rendered: dict[str, dict[str, Any]]) -> None:
    """Make `bootstrap` (modified in place) carry the router's endpoint picks: each provider with
    affinity `pick` gets its cluster (in `rendered`, by name) as `pick_cluster` makes it; with
    any such provider, every ext_proc filter accepts the `envoy.lb` metadata namespace and the
    early header mutation removes a client's `x-gateway-destination-endpoint` (the override_host
    policy trusts its downstream: only the router may name the endpoint)."""
    picking = [p for p in config.providers if p.picks and p.cluster in rendered]
    for provider in picking:
        pick_cluster(rendered[provider.cluster], provider, config.routing.placement.dns_refresh_seconds)
    if not picking:
        return
    for manager in connection_managers(bootstrap):
        for http_filter in manager.get("http_filters") or []:
            if http_filter.get("name") == EXT_PROC_FILTER:
                options = http_filter.setdefault("typed_config", {}).setdefault("metadata_options", {})
                untyped = options.setdefault("receiving_namespaces", {}).setdefault("untyped", [])
                if LB_METADATA_NAMESPACE not in untyped:
                    untyped.append(LB_METADATA_NAMESPACE)
        mutations = manager["early_header_mutation_extensions"][0]["typed_config"]["mutations"]  # _set_route_headers made it
        if {"remove": DESTINATION_ENDPOINT_HEADER} not in mutations:
            mutations.append({"remove": DESTINATION_ENDPOINT_HEADER})


def pick_cluster(cluster: dict[str, Any], provider: Provider, dns_refresh_seconds: float = 5.0) -> dict[str, Any]:
    """`cluster` (modified in place and returned) as the cluster of a provider with affinity
    pick, balanced by `pick_policy`: STATIC over the endpoints' `ip:port` (extproc.config.
    endpoints: the names the router sends, which override_host matches against the cluster's
    hosts); for `endpoints` that are one DNS name (a headless Service), STRICT_DNS over that
    name, re-resolved every `dns_refresh_seconds` (seconds; `dns_refresh_rate`), each address
    a host on the name's port: the `ip:port`s the router resolves the name to (V4_PREFERRED on
    both sides). Health checks, outlier detection and TLS stay as `_provider_cluster` made them;
    with a transport socket per host name, each endpoint keeps the metadata that picks its own
    (the host name as its URL writes it, when its identity is the address that name resolved to):
    without it Envoy would verify every replica against the first host's name (issue 29 item 14)."""
    cluster.pop("lb_policy", None)
    cluster.pop("common_lb_config", None)
    name = dns_name(provider.endpoints)
    if name is None:
        cluster["type"] = "STATIC"
        cluster.pop("dns_lookup_family", None)
        endpoints = [split_identity(e) for e in pick_endpoints(provider.endpoints)]
    else:
        cluster["type"] = "STRICT_DNS"
        cluster["dns_lookup_family"] = "V4_PREFERRED"
        cluster["dns_refresh_rate"] = f"{dns_refresh_seconds:g}s"
        endpoints = [name]
    matched = bool(cluster.get("transport_socket_matches"))  # several host names: one URL each, in order
    tls_hosts = [urlsplit(url).hostname if matched else None for url in provider.endpoints]
    lb_endpoints = [_lb_endpoint(host, port, tls_host) for (host, port), tls_host in zip(endpoints, tls_hosts, strict=True)]
    cluster["load_assignment"] = {"cluster_name": cluster["name"], "endpoints": [{"lb_endpoints": lb_endpoints}]}
    cluster["load_balancing_policy"] = pick_policy()
    return cluster


def pick_policy() -> dict[str, Any]:
    """Envoy's override_host policy (envoy.extensions.load_balancing_policies.override_host.v3.
    OverrideHost): the endpoints from the endpoint-picker protocol's header, else from its
    `envoy.lb` metadata, tried in order (the next ones for retries); without them (a request the
    router placed without Redis, a lookup by id) MAGLEV on the route's hash (the session key)
    with the bounded load of `session_hash`."""
    maglev = {"@type": MAGLEV_TYPE, "consistent_hashing_lb_config": {"hash_balance_factor": HASH_BALANCE_FACTOR}}
    return {"policies": [{"typed_extension_config": {
        "name": OVERRIDE_HOST_POLICY,
        "typed_config": {
            "@type": OVERRIDE_HOST_TYPE,
            "override_host_sources": [
                {"header": DESTINATION_ENDPOINT_HEADER},
                {"metadata": {"key": LB_METADATA_NAMESPACE, "path": [{"key": DESTINATION_ENDPOINT_HEADER}]}},
            ],
            "fallback_policy": {"policies": [{"typed_extension_config": {"name": MAGLEV_POLICY, "typed_config": maglev}}]},
        },
    }}]}
