"""Does a routing configuration agree with the Envoy configuration it runs behind?

The two files are kept by hand and must agree (docs/operations.md "The config pair"): every provider's
`cluster` is a cluster of the Envoy bootstrap; the routing header (`server.routing_header`) is the
route's `cluster_header` and is removed by the early header mutation; so is each trusted identity
header (`session.trusted_identity_headers`, when `trusted_header` is an identity source), else
any client could claim any identity; a provider whose sessions
keep their replica by hash (Affinity `session_hash`) has a consistent-hash cluster, the route
hashes on `server.affinity_header` and the early header mutation removes it too; a
`sessionless_cluster` exists and does not hash; a provider cluster that speaks TLS verifies
the provider's certificate chain and name (`_tls_problems`); a provider with affinity `pick` has an
override_host cluster over its endpoints and the early header mutation removes a client's
`x-gateway-destination-endpoint` (`pick_cluster_problems`, `pick_header_problems`); the ext_proc filter's cluster reaches
`server.listen`'s port and the port of every worker (`server.workers`: listen's port + i), and
its `mutation_rules` let the server remove every `x-envoy-*` header it must remove
(`adaptation.private_headers`, ...: Envoy ignores such a removal otherwise); with the admission
queue on, its class header is removed early too and the filter's `message_timeout` outlasts the
longest wait (docs/queue.md); each health-check and load URL points at the provider's own
cluster (the same host and port when the cluster is STATIC); when the ext_proc filter forwards
only some headers (`forward_rules`), it forwards every header the server reads (`read_headers`:
a session, identity or credential header it does not get is a signal silently lost); each
ext_proc filter runs as the server needs (`_processing_problems`: before the router, its own
processing_mode, fail closed, the route cache cleared, not disabled or overridden on the
routing route). `check` answers one plain sentence per disagreement; an empty list means the
pair agrees, and it never raises, whatever the file holds (a malformed value is a problem too). Used by `iris-extproc check`, `serve
--envoy`, `up` and the configuration reload.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from extproc.config import Affinity, Config, IdentitySource, Provider, ProviderKind
from extproc.config.endpoints import EndpointError, dns_name, pick_endpoints
from extproc.config.schema import ServerSettings, SessionSignal
from extproc.config.yaml_text import YamlTextError, parse_yaml

EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
HCM_FILTER = "envoy.filters.network.http_connection_manager"
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
HASH_LB_POLICIES = frozenset({"RING_HASH", "MAGLEV"})
HASH_LB_EXTENSIONS = ("envoy.load_balancing_policies.ring_hash", "envoy.load_balancing_policies.maglev")
OVERRIDE_HOST_POLICY = "envoy.load_balancing_policies.override_host"
DESTINATION_ENDPOINT_HEADER = "x-gateway-destination-endpoint"  # the endpoint-picker protocol (extproc.protocol.messages)
LB_METADATA_NAMESPACE = "envoy.lb"
ENVOY_HEADER_PREFIX = "x-envoy-"  # Envoy's own headers: an ext_proc mutation needs mutation_rules to touch them

class EnvoyConfigError(ValueError):
    """An Envoy configuration file that cannot be read or is not a YAML mapping."""


def load_bootstrap(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The Envoy bootstrap of the YAML (or JSON) file at `path`. Raises EnvoyConfigError naming
    the file for a missing, unreadable or malformed file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise EnvoyConfigError(f"cannot read the Envoy configuration {path}: {exc.strerror or exc}") from None
    try:
        data = parse_yaml(text)
    except YamlTextError as exc:
        raise EnvoyConfigError(f"the Envoy configuration {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise EnvoyConfigError(f"the Envoy configuration {path} is not a YAML mapping")
    return data


# The headers the ext_proc server reads whatever the config (extproc.protocol.stream and
# extproc.protocol.tracing; tests/unit/config/test_forward_rules.py reads the code to keep this
# whole), request then response. Envoy sends a header to the server only if the filter's
# forward_rules allow it, pseudo-headers included; each direction has its own names.
FIXED_READ_HEADERS = {
    ":path": "the request's path", ":method": "the request's method", "content-length": "the request body's size",
    "traceparent": "tracing", "tracestate": "tracing",
    ":status": "the response's status", "content-type": "the response's type (events)",
    "content-encoding": "the response's encoding",
}


def read_headers(config: Config) -> dict[str, str]:
    """Every header name (lowercase) the ext_proc server reads under `config`, in both
    directions, -> the setting (or purpose) it comes from: FIXED_READ_HEADERS; the trusted
    identity headers and the client credential headers when `session.identity_sources` uses
    them; the session and agent session headers when `session.signals` does; the admission
    queue's class header when set (extproc.openai_api.sessions reads nothing else). What
    Envoy's ext_proc filter must forward (`forward_rules.allowed_headers`); the rest it need not
    serialize into every message."""
    session = config.session
    sources, signals = session.identity_sources, session.signals
    named = {**FIXED_READ_HEADERS}
    for setting, used, headers in (
        ("session.trusted_identity_headers", IdentitySource.TRUSTED_HEADER in sources, session.trusted_identity_headers),
        ("adaptation.client_credential_headers", IdentitySource.CREDENTIAL in sources, config.adaptation.client_credential_headers),
        ("session.session_headers", SessionSignal.SESSION_HEADER in signals, session.session_headers),
        ("session.agent_session_headers", SessionSignal.AGENT_HEADERS in signals, session.agent_session_headers),
        ("routing.queue.class_header", True, [config.routing.queue.class_header] if config.routing.queue.class_header else []),
    ):
        for header in headers if used else []:
            named.setdefault(header.lower(), setting)
    return named


def check(config: Config, bootstrap: dict[str, Any], envoy_name: str = "envoy.yaml", addresses: bool = True) -> list[str]:
    """The disagreements between `config` and the Envoy `bootstrap`, one sentence each (empty:
    they agree). `envoy_name` names the Envoy file in the sentences. With `addresses` False the
    ext_proc port and the health/load URLs are not compared (for a local gateway that moves every
    address onto free ports). Never raises on a malformed bootstrap: its shape is a problem too."""
    clusters, problems = _named_clusters(bootstrap, envoy_name)
    problems += protocol_problems(clusters, envoy_name)
    known = ", ".join(sorted(str(name) for name in clusters)) or "none"
    for provider in config.providers:
        for what, name in (("cluster", provider.cluster), ("sessionless_cluster", provider.sessionless_cluster)):
            if name is not None and name not in clusters:
                problems.append(f"provider {provider.name}: {what} {name!r} is not a cluster of {envoy_name} (its clusters: {known})")
        problems += _affinity_cluster_problems(provider, clusters, envoy_name)
        problems += _tls_problems(provider, clusters, envoy_name)
        problems += socket_match_problems(provider, clusters, envoy_name)
        problems += pick_cluster_problems(provider, clusters, envoy_name)
    hashed = [p for p in config.providers if p.session_affinity is Affinity.SESSION_HASH]
    managers = connection_managers(bootstrap)
    if not managers:
        problems.append(f"{envoy_name}: no listener with an http_connection_manager")
    for manager in managers:
        problems += _header_problems(config.server.routing_header, manager, envoy_name)
        problems += _identity_header_problems(config, manager, envoy_name)
        if hashed:
            problems += _hash_policy_problems(config.server.affinity_header, hashed[0].name, manager, envoy_name)
        if addresses:
            problems += _ext_proc_problems(config.server, manager, clusters, envoy_name)
        problems += _mutation_rule_problems(config, manager, envoy_name)
        problems += _processing_problems(manager, envoy_name)
        problems += _mode_override_problems(manager, envoy_name)
        problems += _queue_problems(config, manager, envoy_name)
        problems += _forwarding_problems(config, manager, envoy_name)
        problems += pick_header_problems(config, manager, envoy_name)
    if addresses:
        for provider in config.providers:
            cluster = clusters.get(provider.cluster)
            for name in ("health_check", "load"):
                setting = getattr(provider, name)
                if setting is not None and cluster is not None and provider.kind is ProviderKind.MANAGED:
                    problems += _url_problems(f"provider {provider.name}: {name}.url", setting.url, cluster, envoy_name)
    return problems


def _named_clusters(bootstrap: dict[str, Any], envoy_name: str) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """The bootstrap's static clusters by name, and a problem for each whose name is not a string
    (`name: [iris-2]`: Envoy refuses the file, and no provider can name the cluster)."""
    clusters, problems = {}, []
    for index, cluster in enumerate(_list(_dict(bootstrap.get("static_resources")).get("clusters"))):
        name = _dict(cluster).get("name")
        if isinstance(name, str):
            clusters[name] = cluster
        else:
            problems.append(f"{envoy_name}: static_resources.clusters[{index}] has no name that is a string (name: {_shown(name)})")
    return clusters, problems


def _shown(value: Any) -> str:
    """A YAML value in a problem's sentence: one line, at most 80 characters."""
    text = " ".join(repr(value).split())
    return text if len(text) <= 80 else text[:77] + "..."


def check_files(config: Config, envoy_path: str | os.PathLike[str], addresses: bool = True) -> list[str]:
    """`check` against the Envoy file at `envoy_path`. Raises EnvoyConfigError."""
    return check(config, load_bootstrap(envoy_path), str(envoy_path), addresses)


def connection_managers(bootstrap: dict[str, Any]) -> list[dict[str, Any]]:
    """The typed configs of every http_connection_manager of the bootstrap's listeners (a
    malformed shape yields none)."""
    managers = []
    for listener in _list(_dict(bootstrap.get("static_resources")).get("listeners")):
        for chain in _list(_dict(listener).get("filter_chains")):
            for network_filter in _list(_dict(chain).get("filters")):
                network_filter = _dict(network_filter)
                if network_filter.get("name") == HCM_FILTER:
                    managers.append(_dict(network_filter.get("typed_config")))
    return managers


def _affinity_cluster_problems(provider: Provider, clusters: dict[str, Any], envoy_name: str) -> list[str]:
    """A hashed provider's cluster balances by consistent hash; its sessionless cluster does not."""
    problems = []
    cluster = clusters.get(provider.cluster)
    if provider.session_affinity is Affinity.SESSION_HASH and cluster is not None and not _hashes(cluster):
        problems.append(
            f"provider {provider.name}: cluster {provider.cluster!r} of {envoy_name} does not balance by consistent hash, so its "
            "sessions would lose their replica's cache (lb_policy: MAGLEV or RING_HASH; or affinity: none)"
        )
    spread = clusters.get(provider.sessionless_cluster)
    if spread is not None and _hashes(spread):
        problems.append(f"provider {provider.name}: sessionless_cluster {provider.sessionless_cluster!r} balances by hash (use LEAST_REQUEST)")
    return problems


TLS_SOCKET = "envoy.transport_sockets.tls"


def _tls_problems(provider: Provider, clusters: dict[str, Any], envoy_name: str) -> list[str]:
    """Each TLS transport socket of the provider's clusters (`transport_socket` and each of
    `transport_socket_matches`) verifies the provider's certificate: its chain, against a CA
    (`trusted_ca`, SDS, a certificate provider, a custom validator) or a pinned hash, and its name
    (`match_typed_subject_alt_names`, `auto_sni_san_validation`, or a pinned hash), as
    envoy/third-party-cluster.example.yaml does. Without that, anyone on the path can answer in
    the provider's place and receive its API key and the prompts."""
    problems = []
    for name in filter(None, dict.fromkeys((provider.cluster, provider.sessionless_cluster))):
        cluster = _dict(clusters.get(name))
        sockets = [("transport_socket", cluster.get("transport_socket"))]
        sockets += [(f"transport_socket_matches[{i}]", _dict(m).get("transport_socket"))
                    for i, m in enumerate(_list(cluster.get("transport_socket_matches")))]
        for where, socket in sockets:
            context = _dict(_dict(socket).get("typed_config"))
            if _dict(socket).get("name") != TLS_SOCKET and not str(context.get("@type", "")).endswith("UpstreamTlsContext"):
                continue
            missing = _unverified(context)
            if missing is not None:
                problems.append(f"provider {provider.name}: cluster {name!r} of {envoy_name} speaks TLS without verifying the "
                                f"provider's certificate ({where}: {missing}), so anyone on the path could receive its API key "
                                "and the prompts (see envoy/third-party-cluster.example.yaml)")
    return problems


def _unverified(context: dict[str, Any]) -> str | None:
    """What an UpstreamTlsContext does not verify of the peer's certificate, or None."""
    common = _dict(context.get("common_tls_context"))
    if "validation_context_sds_secret_config" in common:
        return None  # the whole validation context comes from SDS
    combined = _dict(common.get("combined_validation_context"))
    validation = _dict(combined.get("default_validation_context") if combined else common.get("validation_context"))
    pinned = bool(_list(validation.get("verify_certificate_hash")) or _list(validation.get("verify_certificate_spki")))
    has_ca = "validation_context_sds_secret_config" in combined or any(
        validation.get(key) for key in ("trusted_ca", "ca_certificate_provider_instance", "custom_validator_config")
    )
    if not (has_ca or pinned):
        return "no CA to verify the certificate chain against, validation_context.trusted_ca"
    if str(validation.get("trust_chain_verification", "")).upper() == "ACCEPT_UNTRUSTED":
        return "trust_chain_verification ACCEPT_UNTRUSTED accepts any chain"
    names = _list(validation.get("match_typed_subject_alt_names")) or _list(validation.get("match_subject_alt_names"))
    if not (names or pinned or _truthy(context.get("auto_sni_san_validation"))):
        return "no name to verify the certificate against, validation_context.match_typed_subject_alt_names"
    return None


SOCKET_MATCH_FILTER = "envoy.transport_socket_match"  # the endpoint (or locality) metadata transport_socket_matches reads


def socket_match_problems(provider: Provider, clusters: dict[str, Any], envoy_name: str) -> list[str]:
    """Each `transport_socket_matches` entry of the provider's clusters is the one some endpoint
    of the load assignment gets, and each endpoint whose `envoy.transport_socket_match` metadata
    names a socket gets one. Envoy gives an endpoint the first entry whose `match` its metadata
    (else its locality's) contains, else the cluster's `transport_socket`: an entry no endpoint
    gets means its endpoint is verified against another host's name (the default socket's: the
    first host's SNI and SAN), and fails, or is not verified as the entry meant (issue 29 item 14).
    A cluster without a static load assignment (EDS) is not judged."""
    problems = []
    for name in filter(None, dict.fromkeys((provider.cluster, provider.sessionless_cluster))):
        cluster = _dict(clusters.get(name))
        matches = [_dict(m) for m in _list(cluster.get("transport_socket_matches"))]
        groups = [_dict(g) for g in _list(_dict(cluster.get("load_assignment")).get("endpoints"))]
        endpoints = [(_dict(e), g) for g in groups for e in _list(g.get("lb_endpoints"))]
        if not matches or not endpoints:
            continue
        where = f"provider {provider.name}: cluster {name!r} of {envoy_name}"
        used = set()
        for lb_endpoint, group in endpoints:
            labels = _socket_match_labels(lb_endpoint), _socket_match_labels(group)
            index = next((i for metadata in labels for i, m in enumerate(matches) if _labels_match(_dict(m.get("match")), metadata)), None)
            if index is not None:
                used.add(index)
            elif labels[0] or labels[1]:
                address = _dict(_dict(_dict(lb_endpoint.get("endpoint")).get("address")).get("socket_address"))
                problems.append(f"{where}: the endpoint {_socket_identity(address)} has {SOCKET_MATCH_FILTER} metadata "
                                f"{_shown(labels[0] or labels[1])} that no transport_socket_matches entry matches, so Envoy gives it "
                                "the cluster's transport_socket")
        for index, match in enumerate(matches):
            if index not in used:
                problems.append(f"{where}: no endpoint gets transport_socket_matches[{index}] ({_shown(match.get('name'))}, match "
                                f"{_shown(match.get('match'))}): each endpoint needs its {SOCKET_MATCH_FILTER} metadata (endpoint "
                                "metadata.filter_metadata), else Envoy verifies it with the cluster's transport_socket, another "
                                "host's name")
    return problems


def _socket_match_labels(holder: dict[str, Any]) -> dict[str, Any]:
    """The `envoy.transport_socket_match` filter metadata of an lb endpoint or a locality."""
    return _dict(_dict(_dict(holder.get("metadata")).get("filter_metadata")).get(SOCKET_MATCH_FILTER))


def _labels_match(match: dict[str, Any], metadata: dict[str, Any]) -> bool:
    """Envoy's metadataLabelMatch: every key of `match` is in `metadata` with the same value (an
    empty match takes every endpoint)."""
    return all(key in metadata and metadata[key] == value for key, value in match.items())


HTTP_PROTOCOL_OPTIONS_TYPE = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
PROTOCOL_SELECTION_FIELDS = ("explicit_http_config", "auto_config", "use_downstream_protocol_config")  # one oneof of it


def protocol_problems(clusters: dict[str, Any], envoy_name: str) -> list[str]:
    """Each cluster's `HttpProtocolOptions` (in `typed_extension_protocol_options`) sets at most
    one of its oneof `explicit_http_config`, `auto_config`, `use_downstream_protocol_config`
    (Envoy refuses the file otherwise: "... has already been set (oneof)"), and `auto_config` only
    with a `transport_socket` (it picks the protocol by ALPN, which needs TLS; Envoy refuses it on
    a plaintext cluster: "ALPN configured for cluster ... which has a non-ALPN transport socket").
    Source: envoy/extensions/upstreams/http/v3/http_protocol_options.proto."""
    problems = []
    for name, cluster in clusters.items():
        for key, options in _dict(_dict(cluster).get("typed_extension_protocol_options")).items():
            options = _dict(options)
            if options.get("@type") != HTTP_PROTOCOL_OPTIONS_TYPE:
                continue
            where = f"{envoy_name}: cluster {name!r}: typed_extension_protocol_options {key}"
            chosen = [field for field in PROTOCOL_SELECTION_FIELDS if field in options]
            if len(chosen) > 1:
                problems.append(f"{where} sets {' and '.join(chosen)}, which are one choice (a oneof): Envoy refuses the file; keep one")
            if "auto_config" in options and not _dict(cluster).get("transport_socket"):
                problems.append(f"{where} sets auto_config on a cluster without a transport_socket: it picks HTTP/2 or HTTP/1.1 by "
                                "TLS's ALPN, and Envoy refuses it without TLS (use explicit_http_config)")
    return problems


def _hashes(cluster: dict[str, Any]) -> bool:
    """Whether the cluster's load balancer is a consistent hash (lb_policy or a typed policy)."""
    if str(cluster.get("lb_policy", "")).upper() in HASH_LB_POLICIES:
        return True
    policies = _list(_dict(cluster.get("load_balancing_policy")).get("policies"))
    return any(_dict(_dict(policy).get("typed_extension_config")).get("name") in HASH_LB_EXTENSIONS for policy in policies)


def _routes(manager: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        _dict(route)
        for host in _list(_dict(manager.get("route_config")).get("virtual_hosts"))
        for route in _list(_dict(host).get("routes"))
    ]


def removed_early(manager: dict[str, Any]) -> list[str]:
    """The headers the early header mutation removes (lowercase)."""
    return [
        str(mutation.get("remove", "")).lower()
        for extension in _list(manager.get("early_header_mutation_extensions"))
        for mutation in _list(_dict(_dict(extension).get("typed_config")).get("mutations"))
        if isinstance(mutation, dict)
    ]


def _hash_policy_problems(header: str, provider: str, manager: dict[str, Any], envoy_name: str) -> list[str]:
    """Every cluster_header route hashes on the affinity header, and the early mutation removes it."""
    problems = []
    for route in _routes(manager):
        action = _dict(route.get("route"))
        if "cluster_header" not in action:
            continue
        hashed_on = [str(_dict(_dict(policy).get("header")).get("header_name", "")).lower() for policy in _list(action.get("hash_policy"))]
        if header.lower() not in hashed_on:
            problems.append(
                f"{envoy_name}: the route with cluster_header has no hash_policy on {header!r} (server.affinity_header), so provider "
                f"{provider}'s sessions would not keep their replica"
            )
    if header.lower() not in removed_early(manager):
        problems.append(
            f"{envoy_name}: no early header mutation removes {header!r}, so a client could pick its replica "
            "(early_header_mutation_extensions: remove)"
        )
    return problems


def _header_problems(header: str, manager: dict[str, Any], envoy_name: str) -> list[str]:
    """The routing header is every header route's cluster_header and the early mutation removes it."""
    problems = []
    routes = _routes(manager)
    cluster_headers = [_dict(r.get("route")).get("cluster_header") for r in routes if "cluster_header" in _dict(r.get("route"))]
    if not cluster_headers:
        problems.append(f"{envoy_name}: no route with cluster_header (the route that sends a request to the chosen cluster)")
    for name in cluster_headers:
        if str(name).lower() != header.lower():
            problems.append(f"{envoy_name}: the route's cluster_header is {name!r} but server.routing_header is {header!r}")
    if header.lower() not in removed_early(manager):
        problems.append(
            f"{envoy_name}: no early header mutation removes {header!r}, so a client could choose the cluster "
            "(early_header_mutation_extensions: remove)"
        )
    return problems


def _identity_header_problems(config: Config, manager: dict[str, Any], envoy_name: str) -> list[str]:
    """Each trusted identity header is removed by the early mutation, as the routing header is:
    only a filter after it (the authenticating one) may set it. Not checked when `trusted_header`
    is no identity source (the headers are then never read)."""
    if IdentitySource.TRUSTED_HEADER not in config.session.identity_sources:
        return []
    removed = removed_early(manager)
    return [
        f"{envoy_name}: no early header mutation removes {header!r} (session.trusted_identity_headers), so any client could "
        "claim an identity (early_header_mutation_extensions: remove; an authenticating filter then sets it)"
        for header in config.session.trusted_identity_headers
        if header.lower() not in removed
    ]


def _queue_problems(config: Config, manager: dict[str, Any], envoy_name: str) -> list[str]:
    """With the admission queue on for some model (docs/queue.md): its class header, when set, is
    removed by the early mutation (only the authenticating filter may set it), and the ext_proc
    filter's `message_timeout` (Envoy's default: 200 ms) outlasts a decision that waits its
    longest (`server.decision_timeout_seconds` + the longest `max_wait_ms`)."""
    queue = config.routing.queue
    if not any(queue.enabled(model) for model in config.models()):
        return []
    problems = []
    header = queue.class_header
    if header is not None and header.lower() not in removed_early(manager):
        problems.append(f"{envoy_name}: no early header mutation removes {header!r} (routing.queue.class_header), so any client "
                        "could choose its priority (early_header_mutation_extensions: remove; an authenticating filter then sets it)")
    longest = config.server.decision_timeout_seconds + queue.longest_wait_ms() / 1000
    for ext_proc in (_dict(f) for f in _list(manager.get("http_filters")) if _dict(f).get("name") == EXT_PROC_FILTER):
        timeout = _seconds(_dict(ext_proc.get("typed_config")).get("message_timeout", "0.2s"))
        if timeout is not None and timeout <= longest:
            problems.append(f"{envoy_name}: the ext_proc filter's message_timeout ({timeout:g} s) must exceed "
                            f"server.decision_timeout_seconds + the longest routing.queue max_wait_ms ({longest:g} s), "
                            "or a request that waits in the admission queue fails")
    return problems


def _seconds(duration: Any) -> float | None:
    """A protobuf Duration as YAML writes it (`5s`, `0.25s`), in seconds; None when unreadable."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)s\s*", str(duration))
    return float(match.group(1)) if match else None


def _mutation_rule_problems(config: Config, manager: dict[str, Any], envoy_name: str) -> list[str]:
    """The ext_proc filter's mutation_rules let the server remove every x-envoy-* header it removes
    from requests (by default Envoy ignores those mutations, counting rejected_header_mutations)."""
    session = config.session
    removed = [*config.adaptation.client_credential_headers, *config.adaptation.private_headers, *session.trusted_identity_headers,
               *session.session_headers, *session.agent_session_headers]
    envoy_headers = [h for h in dict.fromkeys(h.lower() for h in removed) if h.startswith(ENVOY_HEADER_PREFIX)]
    problems = []
    for ext_proc in (_dict(f) for f in _list(manager.get("http_filters")) if _dict(f).get("name") == EXT_PROC_FILTER):
        rules = _dict(_dict(ext_proc.get("typed_config")).get("mutation_rules"))
        for header in envoy_headers:
            if not _may_remove(rules, header):
                problems.append(
                    f"{envoy_name}: the ext_proc filter may not remove {header!r}, so it would reach third parties "
                    "(ext_proc mutation_rules: allow_envoy: true)"
                )
    return problems


# The ext_proc filter's processing mode the server is written for (as envoy/envoy.yaml sets it;
# extproc.protocol.messages.processing_mode builds the same), Envoy's defaults filled in.
PROCESSING_MODE = {
    "request_header_mode": "SEND", "request_body_mode": "BUFFERED", "request_trailer_mode": "SKIP",
    "response_header_mode": "SEND", "response_body_mode": "NONE", "response_trailer_mode": "SEND",
}
_ENVOY_MODE_DEFAULTS = {
    "request_header_mode": "SEND", "request_body_mode": "NONE", "request_trailer_mode": "SKIP",
    "response_header_mode": "SEND", "response_body_mode": "NONE", "response_trailer_mode": "SKIP",
}
# The response-body modes the server asks for by a mode override in its response-headers answer: a
# /v1/responses answer's id (docs/sessions.md) and an answer whose model name it rewrites.
OVERRIDE_BODY_MODES = ("BUFFERED", "STREAMED")


# What the server needs of each ext_proc filter's own processing mode (extproc.protocol.stream;
# Envoy's defaults filled in), and why. The request trailers may be sent or not: they are passed on.
REQUIRED_MODES = {
    "request_header_mode": ("SEND", "the router reads the path, method and identity headers"),
    "request_body_mode": ("BUFFERED", "the router decides on the whole body: with any other mode no request gets a route "
                                      "(503 no_route)"),
    "response_header_mode": ("SEND", "the status refreshes pins, records Responses chains and feeds passive health"),
    "response_body_mode": ("NONE", "the server asks for the answers it reads by a mode override (allowed_override_modes)"),
    "response_trailer_mode": ("SEND", "it keeps the ext_proc stream, and so the request's lease, open until the response "
                                      "really ends"),
}
# The ext_proc filter's settings under which Envoy does not do what the server answers, and why
# each must stay false (Envoy's ExternalProcessor; also an ExtProcPerRoute override's).
MUST_BE_FALSE = {
    "failure_mode_allow": "fail closed: a request the router did not admit would reach the providers unrouted, and a lost "
                          "lease could not cancel its request",
    "observability_mode": "Envoy would not wait for the router's answers: nothing would be routed",
    "async_mode": "Envoy would not wait for the router's answers: nothing would be routed",
    "disable_immediate_response": "the router's own answers (400, 404, 429, 503 with an OpenAI error) would become 500s",
    "disable_clear_route_cache": "the route is chosen before the routing header is set: every request would get 503 no_route",
}
ROUTER_FILTER = "envoy.filters.http.router"


def _processing_problems(manager: dict[str, Any], envoy_name: str) -> list[str]:
    """Each ext_proc filter runs as the server needs: before the router filter, enabled, its own
    processing_mode as REQUIRED_MODES, none of MUST_BE_FALSE set, the route cache cleared when
    the server asks (route_cache_action not RETAIN); and no per-route config of the routing
    route (or its virtual host) disables it or overrides those."""
    filters = [_dict(f) for f in _list(manager.get("http_filters"))]
    names = [f.get("name") for f in filters]
    router_at = names.index(ROUTER_FILTER) if ROUTER_FILTER in names else len(names)
    problems = []
    for index, ext_proc in enumerate(filters):
        if ext_proc.get("name") != EXT_PROC_FILTER:
            continue
        if index > router_at:
            problems.append(f"{envoy_name}: the ext_proc filter comes after the router filter, which ends the filter chain: "
                            "no request would be routed (http_filters: ext_proc first, the router last)")
        if _truthy(ext_proc.get("disabled")):
            problems.append(f"{envoy_name}: the ext_proc filter is disabled (disabled: true): no request would be routed")
        typed = _dict(ext_proc.get("typed_config"))
        problems += _mode_problems(typed.get("processing_mode", {}), "the ext_proc filter's processing_mode", envoy_name)
        problems += _must_be_false_problems(typed, "the ext_proc filter", envoy_name)
        if str(typed.get("route_cache_action", "")).upper() == "RETAIN":
            problems.append(f"{envoy_name}: the ext_proc filter's route_cache_action is RETAIN: the route is chosen before the "
                            "routing header is set, so every request would get 503 no_route")
    if EXT_PROC_FILTER in names:
        problems += _per_route_problems(manager, envoy_name)
    return problems


def _mode_problems(value: Any, what: str, envoy_name: str) -> list[str]:
    """A ProcessingMode (YAML) against REQUIRED_MODES, one sentence per field that differs."""
    mode = _mode(value)
    return [f"{envoy_name}: {what} has {field}: {mode[field]}, but the server needs {wanted}: {why}"
            for field, (wanted, why) in REQUIRED_MODES.items() if mode[field] != wanted]


def _must_be_false_problems(settings: dict[str, Any], what: str, envoy_name: str) -> list[str]:
    return [f"{envoy_name}: {what} sets {name}: true, but it must stay false: {why}"
            for name, why in MUST_BE_FALSE.items() if _truthy(settings.get(name))]


def _per_route_problems(manager: dict[str, Any], envoy_name: str) -> list[str]:
    """The ext_proc per-route config (ExtProcPerRoute, maybe inside a FilterConfig) that applies
    to each routing route (one with cluster_header): the route's own, else its virtual host's,
    else the route_config's. It must not disable the filter, nor override the processing mode or
    the settings the server needs."""
    route_config = _dict(manager.get("route_config"))
    problems = []
    for host in (_dict(h) for h in _list(route_config.get("virtual_hosts"))):
        for route in (_dict(r) for r in _list(host.get("routes"))):
            if "cluster_header" not in _dict(route.get("route")):
                continue
            for scope in (route, host, route_config):
                per_route = _dict(scope.get("typed_per_filter_config")).get(EXT_PROC_FILTER)
                if per_route is not None:
                    problems += _per_route_config_problems(_dict(per_route), envoy_name)
                    break
    return list(dict.fromkeys(problems))


def _per_route_config_problems(per_route: dict[str, Any], envoy_name: str) -> list[str]:
    what = "the routing route's ext_proc per-route config"
    if str(per_route.get("@type", "")).endswith("envoy.config.route.v3.FilterConfig"):
        if _truthy(per_route.get("disabled")):
            return [f"{envoy_name}: {what} disables the ext_proc filter: no request would be routed"]
        per_route = _dict(per_route.get("config"))
    if _truthy(per_route.get("disabled")):
        return [f"{envoy_name}: {what} disables the ext_proc filter: no request would be routed"]
    overrides = _dict(per_route.get("overrides"))
    problems = _must_be_false_problems(overrides, what, envoy_name)
    if "processing_mode" in overrides:
        problems += _mode_problems(overrides["processing_mode"], f"{what}'s processing_mode", envoy_name)
    return problems


def _mode_override_problems(manager: dict[str, Any], envoy_name: str) -> list[str]:
    """Each ext_proc filter lets the server override the response body mode as it needs: without
    that, Envoy ignores the override and, silently, no Responses chain is recorded and no model
    name is rewritten."""
    problems = []
    for ext_proc in (_dict(f) for f in _list(manager.get("http_filters")) if _dict(f).get("name") == EXT_PROC_FILTER):
        typed = _dict(ext_proc.get("typed_config"))
        if not _truthy(typed.get("allow_mode_override")):
            problems.append(f"{envoy_name}: the ext_proc filter must set allow_mode_override: true (Responses chains, model names in answers)")
            continue
        allowed = [_mode(m) for m in _list(typed.get("allowed_override_modes"))]
        missing = [b for b in OVERRIDE_BODY_MODES if allowed and {**PROCESSING_MODE, "response_body_mode": b} not in allowed]
        if missing:
            problems.append(
                f"{envoy_name}: the ext_proc filter's allowed_override_modes lack the processing mode with "
                f"response_body_mode {' and '.join(missing)} (the rest as envoy/envoy.yaml's processing_mode)"
            )
    return problems


def _forwarding_problems(config: Config, manager: dict[str, Any], envoy_name: str) -> list[str]:
    """Each ext_proc filter forwards every header the server reads (read_headers): Envoy sends a
    header when `forward_rules.allowed_headers` is empty or matches it, and no
    `disallowed_headers` pattern does. A lost header is a lost signal, and nothing else says so."""
    problems = []
    for ext_proc in (_dict(f) for f in _list(manager.get("http_filters")) if _dict(f).get("name") == EXT_PROC_FILTER):
        rules = _dict(_dict(ext_proc.get("typed_config")).get("forward_rules"))
        allowed = _list(_dict(rules.get("allowed_headers")).get("patterns"))
        disallowed = _list(_dict(rules.get("disallowed_headers")).get("patterns"))
        for header, setting in read_headers(config).items():
            if (allowed and not any(_string_match(p, header) for p in allowed)) or any(_string_match(p, header) for p in disallowed):
                problems.append(
                    f"{envoy_name}: the ext_proc filter's forward_rules do not forward {header!r} ({setting}), which the "
                    "router reads (render the file with `iris-extproc envoy-config`, or add it to allowed_headers)"
                )
    return problems


def _string_match(matcher: Any, value: str) -> bool:
    """Envoy's StringMatcher (exact, prefix, suffix, contains, safe_regex; ignore_case) on `value`."""
    matcher = _dict(matcher)
    fold = _truthy(matcher.get("ignore_case"))
    subject = value.lower() if fold else value
    for kind, test in (("exact", str.__eq__), ("prefix", str.startswith), ("suffix", str.endswith), ("contains", str.__contains__)):
        if isinstance(matcher.get(kind), str):
            return test(subject, matcher[kind].lower() if fold else matcher[kind])
    return _full_match(matcher.get("safe_regex"), value)


def _mode(value: Any) -> dict[str, str]:
    """A ProcessingMode of the YAML with Envoy's defaults for what it leaves out (DEFAULT too);
    a mode given by its number (`request_body_mode: 2`) is named as Envoy reads it (BUFFERED)."""
    given = {k: _mode_name(k, v) for k, v in _dict(value).items()}
    return {**_ENVOY_MODE_DEFAULTS, **{k: v for k, v in given.items() if v != "DEFAULT"}}


def _mode_name(field: Any, value: Any) -> str:
    """The enum name of a ProcessingMode field's value (Envoy's numbers: ProcessingMode)."""
    names = _BODY_MODE_NAMES if str(field).endswith("body_mode") else _HEADER_MODE_NAMES
    return names[value] if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(names) else str(value)


_HEADER_MODE_NAMES = ("DEFAULT", "SEND", "SKIP")  # ProcessingMode.HeaderSendMode, by number
_BODY_MODE_NAMES = ("NONE", "STREAMED", "BUFFERED", "BUFFERED_PARTIAL", "FULL_DUPLEX_STREAMED", "GRPC")  # BodySendMode


def _may_remove(rules: dict[str, Any], header: str) -> bool:
    """Whether Envoy's HeaderMutationRules `rules` let ext_proc remove the x-envoy-* `header`
    (Envoy's Checker, in its order: disallow_expression, allow_expression, disallow_all, allow_envoy)."""
    if _full_match(rules.get("disallow_expression"), header):
        return False
    if _full_match(rules.get("allow_expression"), header):
        return True
    return not _truthy(rules.get("disallow_all")) and _truthy(rules.get("allow_envoy"))


def _full_match(matcher: Any, header: str) -> bool:
    regex = _dict(matcher).get("regex")
    try:
        return isinstance(regex, str) and re.fullmatch(regex, header) is not None
    except re.error:
        return False


def _truthy(value: Any) -> bool:
    """A BoolValue as YAML writes it: `true`, or `{value: true}`."""
    return value is True or _dict(value).get("value") is True


def _ext_proc_problems(server: ServerSettings, manager: dict[str, Any], clusters: dict[str, Any], envoy_name: str) -> list[str]:
    """The ext_proc filter's cluster reaches server.listen's port and, with several workers, the
    port of every worker (server.worker_ports): a worker whose port is not an endpoint gets no
    stream. More ports are fine (other ext_proc servers of the same Envoy)."""
    filters = [_dict(f) for f in _list(manager.get("http_filters")) if _dict(f).get("name") == EXT_PROC_FILTER]
    if not filters:
        return [f"{envoy_name}: no {EXT_PROC_FILTER} filter"]
    problems = []
    port, wanted = str(server.listen_port()), [str(p) for p in server.worker_ports()]
    for ext_proc in filters:
        grpc_service = _dict(_dict(ext_proc.get("typed_config")).get("grpc_service"))
        envoy_grpc = grpc_service.get("envoy_grpc")
        if envoy_grpc is None:
            continue  # google_grpc names its target directly: nothing to compare here
        name = _dict(envoy_grpc).get("cluster_name")
        if not isinstance(name, str):
            problems.append(f"{envoy_name}: the ext_proc filter's envoy_grpc.cluster_name is not a string ({_shown(name)})")
            continue
        cluster = clusters.get(name)
        if cluster is None:
            problems.append(f"{envoy_name}: the ext_proc filter's cluster {name!r} is not a cluster of the file")
            continue
        ports = {str(p) for _, p in _endpoints(cluster)}
        shown = ", ".join(sorted(ports)) or "none"
        missing = [p for p in wanted if p not in ports]
        if port not in ports:
            problems.append(f"{envoy_name}: the ext_proc cluster {name!r} reaches port {shown} but server.listen is {server.listen!r}")
        elif missing:
            problems.append(
                f"{envoy_name}: the ext_proc cluster {name!r} lacks port {', '.join(missing)}: server.workers is {server.workers}, worker i "
                f"listens on port {port} + i, and a worker that is no endpoint gets no stream (list ports {wanted[0]}-{wanted[-1]})"
            )
    return problems


def _url_problems(what: str, url: str, cluster: dict[str, Any], envoy_name: str) -> list[str]:
    """A check URL is http(s) and, for a STATIC cluster, on one of its endpoints' host and port."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return [f"{what} {url!r} is not an http:// or https:// URL with a host"]
    if cluster.get("type", "STATIC") != "STATIC":
        return []
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return [f"{what} {url!r} has an invalid port"]
    endpoints = _endpoints(cluster)
    if not endpoints:
        return []
    for host, endpoint_port in endpoints:
        if _same_host(parts.hostname, str(host)) and str(endpoint_port) == str(port):
            return []
    shown = ", ".join(f"{host}:{p}" for host, p in endpoints)
    return [f"{what} {url!r} is not on cluster {cluster.get('name')!r} of {envoy_name} ({shown})"]


def _endpoints(cluster: dict[str, Any]) -> list[tuple[Any, Any]]:
    """(address, port) of every endpoint of a cluster's load_assignment."""
    out = []
    for group in _list(_dict(cluster.get("load_assignment")).get("endpoints")):
        for lb_endpoint in _list(_dict(group).get("lb_endpoints")):
            address = _dict(_dict(_dict(_dict(lb_endpoint).get("endpoint")).get("address")).get("socket_address"))
            if "port_value" in address:
                out.append((address.get("address"), address["port_value"]))
    return out


def _same_host(a: str, b: str) -> bool:
    return a.lower() == b.lower() or (a.lower() in LOOPBACK and b.lower() in LOOPBACK)


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


# ---- affinity pick: the endpoint-picker protocol (issue 30) -------------------------------------

def pick_cluster_problems(provider: Provider, clusters: dict[str, Any], envoy_name: str) -> list[str]:
    """A provider with affinity pick: its cluster balances by override_host reading the
    endpoint-picker protocol's header (or its `envoy.lb` metadata), with a consistent hash as the
    fallback, and lists every endpoint the router may name (`ip:port`) as a STATIC host; for
    endpoints that are one DNS name (extproc.config.endpoints.dns_name), is STRICT_DNS over
    that name and port (each address Envoy resolves it to is a host, as the router resolves it)."""
    cluster = clusters.get(provider.cluster)
    if not provider.picks or cluster is None:
        return []
    problems = []
    policy = next((
        _dict(_dict(p).get("typed_extension_config")) for p in _list(_dict(cluster.get("load_balancing_policy")).get("policies"))
        if _dict(_dict(p).get("typed_extension_config")).get("name") == OVERRIDE_HOST_POLICY
    ), None)
    where = f"provider {provider.name}: cluster {provider.cluster!r} of {envoy_name}"
    if policy is None:
        return [f"{where} cannot take the router's pick: its load_balancing_policy is not {OVERRIDE_HOST_POLICY} "
                "(affinity pick, the default for a managed provider with endpoints; affinity session_hash keeps Envoy's hash)"]
    typed = _dict(policy.get("typed_config"))
    sources = [_dict(s) for s in _list(typed.get("override_host_sources"))]
    reads = any(str(s.get("header", "")).lower() == DESTINATION_ENDPOINT_HEADER for s in sources) or any(
        _dict(s.get("metadata")).get("key") == LB_METADATA_NAMESPACE
        and [_dict(k).get("key") for k in _list(_dict(s.get("metadata")).get("path"))] == [DESTINATION_ENDPOINT_HEADER]
        for s in sources
    )
    if not reads:
        problems.append(f"{where}: override_host reads neither the header {DESTINATION_ENDPOINT_HEADER!r} nor envoy.lb metadata of that key")
    fallback = _list(_dict(typed.get("fallback_policy")).get("policies"))
    if not any(_dict(_dict(p).get("typed_extension_config")).get("name") in HASH_LB_EXTENSIONS for p in fallback):
        problems.append(f"{where}: override_host's fallback_policy is not a consistent hash (maglev or ring_hash): "
                        "a request without a pick would lose its session's replica")
    hosts = {
        _socket_identity(_dict(_dict(_dict(e).get("endpoint")).get("address")).get("socket_address"))
        for group in _list(_dict(cluster.get("load_assignment")).get("endpoints")) for e in _list(_dict(group).get("lb_endpoints"))
    }
    name = dns_name(provider.endpoints)
    if name is not None:  # one DNS name: Envoy must resolve it to every address, as the router does
        if cluster.get("type") != "STRICT_DNS" or f"{name[0]}:{name[1]}" not in hosts:
            problems.append(f"{where} is not STRICT_DNS over {name[0]}:{name[1]}, the name the router resolves to its endpoints: "
                            "override_host only reaches a host of the cluster")
        return problems
    try:
        missing = [e for e in pick_endpoints(provider.endpoints) if e not in hosts]
    except EndpointError as exc:
        return [*problems, f"provider {provider.name}: endpoints: {exc}"]
    if missing or cluster.get("type", "STATIC") != "STATIC":
        problems.append(f"{where} is not STATIC over every endpoint the router picks (missing: {', '.join(missing) or 'none'}): "
                        "override_host only reaches a host of the cluster")
    return problems


def _socket_identity(address: Any) -> str:
    """A socket_address as an endpoint identity, `ip:port` or `[ip]:port`."""
    address = _dict(address)
    host = str(address.get("address", ""))
    return f"[{host}]:{address.get('port_value')}" if ":" in host else f"{host}:{address.get('port_value')}"


def pick_header_problems(config: Config, manager: dict[str, Any], envoy_name: str) -> list[str]:
    """With a provider of affinity pick, the early header mutation removes a client's
    `x-gateway-destination-endpoint` (override_host trusts its downstream), and the route hashes
    on the session key for the fallback policy."""
    picking = [p for p in config.providers if p.picks]
    if not picking:
        return []
    problems = []
    if DESTINATION_ENDPOINT_HEADER not in removed_early(manager):
        problems.append(f"{envoy_name}: no early header mutation removes {DESTINATION_ENDPOINT_HEADER!r}, so a client could pick "
                        f"provider {picking[0].name}'s replica (early_header_mutation_extensions: remove)")
    if any(p.session_affinity is Affinity.SESSION_HASH for p in config.providers):
        return problems  # check() compares the route's hash policy already
    return problems + _hash_policy_problems(config.server.affinity_header, picking[0].name, manager, envoy_name)
