"""Rendering envoy/envoy.yaml for a local run: the same file, with ports and addresses rewritten.

envoy/envoy.yaml stays the one source of the Envoy configuration; `iris-lab up`, the tests
and the benchmarks only move its listener, admin, ext_proc and provider clusters onto free ports.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from extproc.config.envoy_check import connection_managers, removed_early
from extproc.config.examples import envoy_yaml

DNS_CLUSTER_TYPES = ("STRICT_DNS", "LOGICAL_DNS")
DEFAULT_ENVOY_YAML = envoy_yaml()


def load_envoy_yaml(path: Path = DEFAULT_ENVOY_YAML) -> dict[str, Any]:
    """The Envoy bootstrap as a dict."""
    return yaml.safe_load(path.read_text())


def cluster_names(bootstrap: dict[str, Any]) -> list[str]:
    """Names of the static clusters of a bootstrap."""
    return [c["name"] for c in bootstrap["static_resources"]["clusters"]]


def cluster_port(bootstrap: dict[str, Any], name: str) -> int:
    """The port of cluster `name`'s first endpoint. Raises KeyError for an unknown cluster."""
    for cluster in bootstrap["static_resources"]["clusters"]:
        if cluster["name"] == name:
            endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
            return endpoint["address"]["socket_address"]["port_value"]
    raise KeyError(name)


def render(
    listener_port: int,
    admin_port: int,
    cluster_ports: dict[str, int | list[int]],
    source: Path = DEFAULT_ENVOY_YAML,
    extra_clusters: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """envoy.yaml with its listener on `listener_port`, admin on `admin_port`, and each cluster
    in `cluster_ports` (extproc and providers) sent to 127.0.0.1:<port> (a DNS cluster to
    localhost:<port>, IPv4 only, so it still resolves a name). A list of ports gives the cluster
    one endpoint per port (several ext_proc servers behind one Envoy), each a copy of the first
    endpoint. Clusters not named keep their addresses. Raises KeyError when `cluster_ports`
    names a cluster the file lacks."""
    bootstrap = render_onto(load_envoy_yaml(source), listener_port, admin_port, cluster_ports)
    bootstrap["static_resources"]["clusters"].extend(extra_clusters or [])
    return bootstrap


def render_onto(bootstrap: dict[str, Any], listener_port: int, admin_port: int, cluster_ports: dict[str, int | list[int]]) -> dict[str, Any]:
    """`render` on a bootstrap already loaded (modified in place and returned)."""
    bootstrap["admin"]["address"]["socket_address"]["port_value"] = admin_port
    bootstrap["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"] = listener_port
    clusters = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}
    for name, ports in cluster_ports.items():
        cluster = clusters[name]
        # A DNS cluster keeps resolving a name: `localhost`, IPv4 only (local servers bind 127.0.0.1).
        dns = cluster.get("type") in DNS_CLUSTER_TYPES
        if dns:
            cluster["dns_lookup_family"] = "V4_ONLY"
        groups = cluster["load_assignment"]["endpoints"]
        if isinstance(ports, list):
            first = groups[0]["lb_endpoints"][0]
            groups[:] = [{**groups[0], "lb_endpoints": [copy.deepcopy(first) for _ in ports]}]
        for group in groups:
            for index, endpoint in enumerate(group["lb_endpoints"]):
                address = endpoint["endpoint"]["address"]["socket_address"]
                address["address"] = "localhost" if dns else "127.0.0.1"
                address["port_value"] = ports[index] if isinstance(ports, list) else ports
    return bootstrap


CLAIMED_IDENTITY_PREFIX = "x-lab-claimed-"


def with_stand_in_authentication(bootstrap: dict[str, Any], headers: list[str]) -> dict[str, Any]:
    """`bootstrap` (modified in place and returned) with a stand-in for an authenticating filter
    (jwt_authn's claim_to_headers, ext_authz) setting each trusted identity header of `headers`:
    the early header mutation copies what the client sent in the header to a lab-only header and
    strips the header itself (so `iris-extproc check` agrees: no client can set it), then a
    header_mutation filter before ext_proc sets the header from the copy and drops the copy. The
    tests' clients send the identity they claim in the header itself, as a verified token's claim
    would set it. For the lab only: a real deployment authenticates the client there."""
    for manager in connection_managers(bootstrap):
        extensions = manager.setdefault("early_header_mutation_extensions", [])
        if not extensions:
            extensions.append({"name": "envoy.http.early_header_mutation.header_mutation", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation",
                "mutations": []}})
        mutations = extensions[0]["typed_config"].setdefault("mutations", [])
        request_mutations = []
        for header in headers:
            claimed = CLAIMED_IDENTITY_PREFIX + header
            mutations[:0] = [{"remove": claimed}, {"append": {"header": {"key": claimed, "value": f"%REQ({header})%"},
                                                              "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}}]
            mutations.append({"remove": header})
            request_mutations += [{"append": {"header": {"key": header, "value": f"%REQ({claimed})%"},
                                              "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}},
                                  {"remove": claimed}]
        manager["http_filters"].insert(0, {
            "name": "envoy.filters.http.header_mutation",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
                             "mutations": {"request_mutations": request_mutations}},
        })
    return bootstrap


def unstripped_identity_headers(bootstrap: dict[str, Any], headers: list[str]) -> list[str]:
    """The headers of `headers` that no early header mutation of `bootstrap` removes."""
    removed = {header for manager in connection_managers(bootstrap) for header in removed_early(manager)}
    return [header for header in headers if header.lower() not in removed]


def write(bootstrap: dict[str, Any], path: Path) -> Path:
    """Write a bootstrap as YAML and return the path."""
    path.write_text(yaml.safe_dump(bootstrap, sort_keys=False))
    return path
