"""Loading the routing config: YAML to a validated `Config`, every problem named.

`load_config` rejects a bad file with one message per problem, each naming the field path, for
example ``providers[1].models.llama-3.1-70b.limits.max_pinned_sessions: must be >= 0``: the
schema's own checks (extproc.config.schema) and the cross-field rules below.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import ValidationError

from extproc.config.endpoints import EndpointError, dns_name, pick_endpoints
from extproc.config.schema import (
    FEATURE_CLASSES,
    REDIS_NODE_PATTERN,
    ROUTER_SESSION_HEADERS,
    SUB_FEATURES,
    Affinity,
    Config,
    ModelLimits,
    Provider,
    ProviderKind,
    RedisSettings,
    ServerSettings,
)
from extproc.config.yaml_text import YamlTextError, parse_yaml


class ConfigError(ValueError):
    """A configuration file that cannot be used. `problems` holds one 'path: message' per problem."""

    def __init__(self, source: str, problems: list[str]):
        self.problems = problems
        super().__init__(f"invalid configuration {source}:\n  " + "\n  ".join(problems))



def load_config(path: str | os.PathLike[str]) -> Config:
    """Read and validate a YAML configuration file.

    Raises ConfigError listing every problem (schema and cross-field checks, YAML syntax, text
    that is not UTF-8), or OSError (with its `filename`) when the file cannot be read.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(str(path), ["<file>: not UTF-8 text"]) from None
    try:
        data = parse_yaml(text)
    except YamlTextError as exc:
        raise ConfigError(str(path), [f"<file>: not valid YAML: {exc}"]) from None
    return parse_config(data, source=str(path))


def parse_config(data: Any, source: str = "<data>") -> Config:
    """Validate already-parsed configuration data. Raises ConfigError."""
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(source, [_describe(error) for error in exc.errors()]) from None
    problems = _cross_field_problems(config)
    if problems:
        raise ConfigError(source, problems)
    return config


def _cross_field_problems(config: Config) -> list[str]:
    problems = []
    for label, values in (
        ("name", [p.name for p in config.providers]),
        ("cluster", [p.cluster for p in config.providers]),
    ):
        for value, count in Counter(values).items():
            if count > 1:
                problems.append(f"providers: duplicate provider {label} {value!r}")
    passthrough = config.passthrough_features()
    for i, provider in enumerate(config.providers):
        for model, entry in provider.models.items():
            at = f"providers[{i}].models.{model}"
            if "{" in model or "}" in model or not model.strip():
                problems.append(f"{at}: a model name must be non-blank and hold no braces")
            unknown = entry.features - FEATURE_CLASSES - SUB_FEATURES - passthrough
            if unknown:
                problems.append(f"{at}.features: unknown feature(s) {sorted(unknown)}")
            if not entry.features & (FEATURE_CLASSES | passthrough):
                problems.append(f"{at}.features: needs one of {sorted(FEATURE_CLASSES | passthrough)}")
            problems.extend(_limit_problems(at, provider.kind, entry.limits))
        problems.extend(_provider_extension_problems(f"providers[{i}]", provider))
    problems.extend(_server_problems(config.server))
    problems.extend(_session_problems(config))
    problems.extend(_redis_problems(config.redis))
    problems.extend(_passthrough_problems(config))
    problems.extend(_queue_problems(config))
    return problems


def _queue_problems(config: Config) -> list[str]:
    """Class names once each and known where used; tickets renewed in time by the waiters' polls;
    the class header is a header of its own."""
    queue = config.routing.queue
    at = "routing.queue"
    names = [c.name for c in queue.classes]
    problems = [f"{at}.classes: duplicate class {name!r}" for name, count in Counter(names).items() if count > 1]
    if queue.default_class not in names:
        problems.append(f"{at}.default_class: {queue.default_class!r} is not one of the classes {names}")
    for identity, name in queue.identity_classes.items():
        if name not in names:
            problems.append(f"{at}.identity_classes.{identity}: {name!r} is not one of the classes {names}")
    models = set(config.models())
    for i, priority in enumerate(queue.classes):
        for model in priority.max_wait_ms_by_model:
            if model not in models:
                problems.append(f"{at}.classes[{i}].max_wait_ms_by_model: no provider serves the model {model!r}")
    if queue.ticket_lease_ms < 3 * queue.poll_ms:
        problems.append(f"{at}.ticket_lease_ms: must be at least 3 x poll_ms ({3 * queue.poll_ms}): the polls renew the tickets")
    header = queue.class_header
    taken = {config.server.routing_header, config.server.affinity_header, *config.session.trusted_identity_headers,
             *config.session.session_headers, *config.session.agent_session_headers, *config.adaptation.client_credential_headers}
    if header is not None and header in taken:
        problems.append(f"{at}.class_header: {header!r} is already the routing, affinity, identity, session or credential header")
    return problems


# Paths the router serves itself or as OpenAI's API: a passthrough endpoint cannot take them.
_OWN_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/models")


def _passthrough_problems(config: Config) -> list[str]:
    """Each path once, none of OpenAI's paths the router serves, no feature class as a feature."""
    problems = []
    paths = [e.path for e in config.passthrough_endpoints]
    for path, count in Counter(paths).items():
        if count > 1:
            problems.append(f"passthrough_endpoints: path {path!r} is listed twice")
    for i, endpoint in enumerate(config.passthrough_endpoints):
        if any(endpoint.path == own or endpoint.path.startswith(own + "/") for own in _OWN_PATHS):
            problems.append(f"passthrough_endpoints[{i}].path: {endpoint.path!r} is one of OpenAI's paths the router serves")
        if endpoint.feature in FEATURE_CLASSES | SUB_FEATURES:
            problems.append(f"passthrough_endpoints[{i}].feature: {endpoint.feature!r} is already a feature of OpenAI's API")
    return problems


def _server_problems(server: ServerSettings) -> list[str]:
    """`listen` is host:port, and the workers' consecutive ports stay below 65536."""
    try:
        port = server.listen_port()
    except ValueError as exc:
        return [f"server.listen: {exc}"]
    if port + server.workers - 1 > 65535:
        return [f"server.workers: {server.workers} workers on ports from {port} would go past port 65535"]
    return []


def _session_problems(config: Config) -> list[str]:
    """No source or signal twice; a trusted identity header is not a header clients send anyway."""
    session = config.session
    problems = []
    for name in ("identity_sources", "signals", "trusted_identity_headers", "session_headers", "agent_session_headers"):
        values = getattr(session, name)
        if len(set(values)) != len(values):
            problems.append(f"session.{name}: holds a value twice")
    clash = set(session.trusted_identity_headers) & (
        {config.server.routing_header, config.server.affinity_header} | set(config.adaptation.client_credential_headers)
        | set(session.session_headers) | set(session.agent_session_headers)
    )
    if clash:
        problems.append(f"session.trusted_identity_headers: {sorted(clash)} cannot carry an identity")
    signals = {config.server.routing_header} | set(session.session_headers) | set(session.agent_session_headers)
    if config.server.affinity_header in signals:
        problems.append(f"server.affinity_header: {config.server.affinity_header!r} is already the routing header or a session header")
    return problems


def _redis_problems(redis: RedisSettings) -> list[str]:
    """One topology only; node addresses are `host:port`."""
    problems = []
    if redis.cluster is not None and redis.sentinel is not None:
        problems.append("redis: set only one of cluster or sentinel")
    if "url" in redis.model_fields_set and (redis.cluster is not None or redis.sentinel is not None):
        problems.append("redis.url: a standalone URL cannot be combined with redis.cluster or redis.sentinel")
    for at, nodes in (("redis.cluster.nodes", redis.cluster and redis.cluster.nodes),
                      ("redis.sentinel.sentinels", redis.sentinel and redis.sentinel.sentinels)):
        for i, node in enumerate(nodes or []):
            if not re.match(REDIS_NODE_PATTERN, node) or not 0 < int(node.rsplit(":", 1)[1]) < 65536:
                problems.append(f"{at}[{i}]: {node!r} is not host:port")
    problems.extend(_redis_tls_problems(redis))
    durable = redis.durable_admissions
    if durable is not None and durable.timeout_ms >= redis.socket_timeout_seconds * 1000:
        problems.append("redis.durable_admissions.timeout_ms: must be below redis.socket_timeout_seconds "
                        "(the WAIT would outlast the command timeout)")
    learn_within = max(redis.probe_interval_seconds, redis.instance_heartbeat_seconds)
    if redis.epoch_grace_seconds is not None and redis.epoch_grace_seconds <= learn_within:
        problems.append(f"redis.epoch_grace_seconds: must exceed probe_interval_seconds and instance_heartbeat_seconds "
                        f"({_plain_number(learn_within)}), the time every instance takes to see a new epoch")
    return problems


def _redis_tls_problems(redis: RedisSettings) -> list[str]:
    """TLS files only with TLS on; a key only with its certificate; no URL query options (redis-py
    would take `?ssl_cert_reqs=none` and the like from it, the pipelined client would not)."""
    problems = []
    for name in ("tls_ca_file", "tls_cert_file", "tls_key_file"):
        if getattr(redis, name) is not None and not redis.uses_tls:
            problems.append(f"redis.{name}: TLS is off (set redis.tls: true, or a rediss:// url)")
    if redis.tls_key_file is not None and redis.tls_cert_file is None:
        problems.append("redis.tls_key_file: needs redis.tls_cert_file (the certificate it goes with)")
    if urlsplit(redis.url).query:
        problems.append("redis.url: query options are not supported; use the redis settings (tls, tls_ca_file, ...)")
    return problems


def _provider_extension_problems(at: str, provider: Provider) -> list[str]:
    """Credentials name one source; health and load checks only on managed providers."""
    problems = []
    credentials = provider.credentials
    if credentials is not None and (credentials.api_key_env is None) == (credentials.api_key_file is None):
        problems.append(f"{at}.credentials: set exactly one of api_key_env or api_key_file")
    if credentials is not None and credentials.header in ("host", "content-length", "content-type"):
        problems.append(f"{at}.credentials.header: {credentials.header!r} cannot carry a key")
    if provider.kind is ProviderKind.UNLIMITED:
        for name in ("health_check", "load"):
            if getattr(provider, name) is not None:
                problems.append(f"{at}.{name}: an unlimited provider is never degraded (the spec)")
    problems.extend(_affinity_problems(at, provider))
    load = provider.load
    if load is not None:
        if (load.metric is None) != (load.threshold is None):
            problems.append(f"{at}.load: metric and threshold go together")
        if not load.all_signals():
            problems.append(f"{at}.load: needs a preset, a metric with a threshold, or signals")
        singles = [("", load.recover_below, load.threshold)] if load.threshold is not None else []
        for where, recover, threshold in singles + [(f".signals[{i}]", x.recover_below, x.threshold) for i, x in enumerate(load.signals)]:
            if recover is not None and recover > threshold:
                problems.append(f"{at}.load{where}.recover_below: must be <= threshold ({_plain_number(threshold)})")
    return problems


def _affinity_problems(at: str, provider: Provider) -> list[str]:
    """A third party never gets a session key; an own router names its header; a sessionless
    cluster is another cluster, for a pool; endpoints as _endpoint_problems says."""
    problems = []
    affinity = provider.session_affinity
    if provider.kind is ProviderKind.UNLIMITED and affinity is not Affinity.NONE:
        problems.append(f"{at}.affinity: an unlimited provider (a third party) never receives a session key: use none")
    if affinity is Affinity.OWN_ROUTER and provider.router_session_header is None:
        problems.append(f"{at}.router_session_header: own_router needs one: a preset ({', '.join(ROUTER_SESSION_HEADERS)}) or a header name")
    if affinity is not Affinity.OWN_ROUTER and provider.router_session_header is not None:
        problems.append(f"{at}.router_session_header: only with affinity own_router")
    if provider.sessionless_cluster is not None:
        if affinity is not Affinity.SESSION_HASH:
            problems.append(f"{at}.sessionless_cluster: only with affinity session_hash")
        if provider.sessionless_cluster == provider.cluster:
            problems.append(f"{at}.sessionless_cluster: must differ from cluster (it balances by least request)")
    return problems + _endpoint_problems(at, provider)


def _endpoint_problems(at: str, provider: Provider) -> list[str]:
    """Each endpoint is what an Envoy cluster can reach as written: http(s)://host[:port], a port
    from 1 to 65535 (no 0, which Envoy's socket_address cannot use), nothing Envoy would drop (a
    `user:password@`, a path, a query, a fragment); one scheme per provider; `tls_ca_file` only
    with https endpoints (it is what Envoy verifies them against)."""
    problems = []
    schemes = set()
    for i, url in enumerate(provider.endpoints):
        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            problems.append(f"{at}.endpoints[{i}]: {url!r} has an invalid port")
            continue
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/") or parts.query or parts.fragment:
            problems.append(f"{at}.endpoints[{i}]: {url!r} is not http(s)://host[:port]")
        elif port == 0:
            problems.append(f"{at}.endpoints[{i}]: {url!r} has port 0 (give the port the provider listens on, or none)")
        elif parts.username is not None or parts.password is not None:
            problems.append(f"{at}.endpoints[{i}]: the URL carries user:password@ (not shown here), which Envoy would not "
                            "send (give the provider's key in credentials)")
        schemes.add(parts.scheme)
    if len(schemes) > 1:
        problems.append(f"{at}.endpoints: mixes http and https (one cluster speaks one)")
    if provider.tls_ca_file is not None and schemes != {"https"}:
        problems.append(f"{at}.tls_ca_file: only with https endpoints (Envoy verifies them against it)")
    if not problems:
        problems.extend(_pick_problems(at, provider))
    return problems


def _pick_problems(at: str, provider: Provider) -> list[str]:
    """Affinity `pick`: a managed provider whose endpoints resolve to distinct `ip:port`s; the
    per-endpoint cap only there (extproc.config.endpoints)."""
    if not provider.picks:
        return [
            f"{at}.models.{model}.max_in_flight_per_endpoint: only with affinity pick (the router counts per endpoint only there)"
            for model, entry in provider.models.items() if entry.max_in_flight_per_endpoint is not None
        ]
    if not provider.endpoints:
        return [f"{at}.endpoints: affinity pick needs the provider's endpoints (http(s)://ip:port, one per replica)"]
    if dns_name(provider.endpoints) is not None:
        identities: tuple[str, ...] = ()  # one DNS name: resolved while serving, each address once (it may not resolve yet)
    else:
        try:
            identities = pick_endpoints(provider.endpoints)
        except EndpointError as exc:
            return [f"{at}.endpoints: {exc} (affinity pick names each endpoint by its ip:port; affinity session_hash "
                    "leaves the replica to Envoy's hash)"]
    repeated = sorted(e for e, n in Counter(identities).items() if n > 1)
    if repeated:
        return [f"{at}.endpoints: {', '.join(repeated)} listed more than once (affinity pick: one URL per replica)"]
    return [
        f"{at}.models.{model}.limits: affinity pick counts each endpoint's requests by their leases, and a pair without "
        "limits takes none for a request without a session: set limits (an empty mapping limits nothing), or "
        "affinity session_hash to leave the replica to Envoy's hash"
        for model, entry in provider.models.items() if entry.limits is None
    ]


def _limit_problems(at: str, kind: ProviderKind, limits: ModelLimits | None) -> list[str]:
    if limits is None:
        return []
    if kind is ProviderKind.UNLIMITED:
        return [f"{at}.limits: an unlimited provider has no limits (the spec)"]
    reserved = limits.global_in_flight_request_slots_reserved_for_pinned_sessions
    if not reserved:
        return []
    total = limits.max_global_in_flight_request_slots
    if total is None or reserved > total:
        return [
            f"{at}.limits.global_in_flight_request_slots_reserved_for_pinned_sessions: "
            f"must be <= max_global_in_flight_request_slots ({total})"
        ]
    return []


_MESSAGES = {
    "missing": "is required",
    "extra_forbidden": "unknown field",
    "greater_than_equal": "must be >= {ge}",
    "greater_than": "must be > {gt}",
    "too_short": "must not be empty",
    "string_pattern_mismatch": "must match {pattern}",
}


def _describe(error: Any) -> str:
    path = _format_location(error["loc"])
    template = _MESSAGES.get(error["type"])
    context = {k: _plain_number(v) for k, v in error.get("ctx", {}).items()}
    message = template.format(**context) if template else error["msg"]
    return f"{path}: {message}"


def _plain_number(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _format_location(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "<root>"
