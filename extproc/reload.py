"""Hot reload of the routing config: on SIGHUP and when the file changes.

`ConfigReloader` is the one owner of the running configuration of an ext_proc server. It polls the
file every `server.reload_poll_seconds` (its mtime, size and inode, then a SHA-256 of the content
when they change) and reloads at once on SIGHUP. A reload reads and validates the whole file
(and, with `serve --envoy`, checks it against the Envoy file), reads the providers' API keys, then
swaps everything built from the config in one step, without awaiting in between:

- `LiveConfig` (the config, RoutingState with the limits the scripts get, Router, RequestAdapter):
  a stream takes one snapshot when its request body arrives and decides and adapts with it, so
  one request never mixes two configs;
- the lease table (extproc.lease_table) decides with the new pair from now on; every lease it
  holds renews, adopts and releases through the RoutingState it was admitted with (its pair's
  keys, even when the provider or model is gone);
- DegradedFlags and the OutagePolicy are reconfigured in place (the flag snapshot carries over);
- the HealthMonitor is replaced only when the checks changed (its failure streaks carry over
  otherwise); the metrics' fleet-state reader reads the new pairs.

A file that cannot be used (unreadable, invalid, disagreeing with the Envoy file, a key that
cannot be read) keeps the running config: one log line and `iris_config_reloads_total{result=
"failure"}`. Fields that cannot change in a running process (RESTART_ONLY: the listen address,
Redis URL and key prefix, ...) keep their running values, with a log line saying a restart is
needed.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from redis.asyncio import Redis

from extproc import envoy_check, metrics
from extproc import envoy_messages as msg
from extproc.adaptation import CredentialError, RequestAdapter
from extproc.chains import ResponseChains
from extproc.config import Config, ConfigError, parse_config
from extproc.degraded import DegradedFlags
from extproc.envoy_check import EnvoyConfigError
from extproc.routing import Router
from extproc.sessions import SessionKeys
from extproc.state import RoutingState

if TYPE_CHECKING:
    from extproc.server import Gateway

log = logging.getLogger(__name__)

# Per settings section, the fields a running server keeps until it restarts.
RESTART_ONLY = {
    "server": ("listen", "routing_header", "metrics_listen", "degraded_refresh_seconds"),
    "redis": (
        "url", "cluster", "sentinel", "username", "password_env", "tls", "tls_ca_file", "key_prefix", "socket_timeout_seconds",
        "max_connections", "breaker_failures_in_a_row", "instance_heartbeat_seconds",
    ),
    "session": ("secret_env",),
}


@dataclass(frozen=True, slots=True)
class LiveConfig:
    """What a request reads of the routing config, built from one Config: the config itself, the
    routing state (limits and timings for the scripts), the router, the request adapter (API keys
    read), the session keys and Responses chains, the set of model names and the `GET /v1/models`
    answer."""

    config: Config
    state: RoutingState
    router: Router
    adapter: RequestAdapter
    sessions: SessionKeys
    chains: ResponseChains
    models: frozenset[str]
    model_list: bytes


def build_live(config: Config, redis: Redis, degraded: DegradedFlags, secret: bytes) -> LiveConfig:
    """Everything a request needs from `config` (`secret`: the session secret). Raises
    adaptation.CredentialError when an API key cannot be read."""
    state = RoutingState(redis, config)
    return LiveConfig(
        config, state, Router(config, state, degraded), RequestAdapter(config), SessionKeys(config, secret),
        ResponseChains(redis, config, secret), frozenset(config.models()), msg.model_list_body(config.models(), int(time.time())),
    )


def keep_restart_only(running: Config, new: Config) -> tuple[Config, list[str]]:
    """`new` with the RESTART_ONLY fields of `running`, and the names of those that differed."""
    kept = []
    sections = {}
    for section, names in RESTART_ONLY.items():
        old_settings, new_settings = getattr(running, section), getattr(new, section)
        changed = {name: getattr(old_settings, name) for name in names if getattr(old_settings, name) != getattr(new_settings, name)}
        kept += [f"{section}.{name}" for name in changed]
        if changed:
            sections[section] = new_settings.model_copy(update=changed)
    return (new.model_copy(update=sections) if sections else new), kept


def _health_inputs(config: Config) -> tuple:
    """What the HealthMonitor is built from: a monitor is replaced only when this changes."""
    providers = tuple(
        (p.name, p.kind, p.health_check, p.load, tuple((m, e.upstream_model) for m, e in p.models.items())) for p in config.providers
    )
    return providers, config.degradation, config.redis.key_prefix


class ReloadError(Exception):
    """A new routing config that cannot be used; the message is one line."""


class ConfigReloader:
    """Reloads `path` into a running `Gateway` on `request()` (SIGHUP) and on a change of the file.
    `envoy_path`: the Envoy file a new config must agree with (envoy_check), re-read each time."""

    def __init__(self, gateway: Gateway, path: str | os.PathLike[str], envoy_path: str | os.PathLike[str] | None = None):
        self.gateway = gateway
        self.path = Path(path)
        self.envoy_path = envoy_path
        self.reloads = 0  # successful reloads so far
        self._wake = asyncio.Event()
        self._seen = self._signature()
        self._tried = self._digest(self._read())  # the content of the running config (or the last bad try)

    def request(self) -> None:
        """Reload as soon as possible, even if the file looks unchanged (SIGHUP)."""
        self._wake.set()

    async def run_forever(self) -> None:
        """Poll the file every `server.reload_poll_seconds` (0: SIGHUP only) until cancelled."""
        while True:
            poll = self.gateway.config.server.reload_poll_seconds
            forced = False
            try:
                async with asyncio.timeout(poll or None):
                    await self._wake.wait()
                forced = True
            except TimeoutError:
                pass
            self._wake.clear()
            signature = self._signature()
            if not forced and signature == self._seen:
                continue
            self._seen = signature
            content = self._read()
            if content is None:
                if forced:
                    self._fail(f"cannot read {self.path}")
                continue
            digest = self._digest(content)
            if forced or digest != self._tried:
                self._tried = digest
                self.reload(content)

    def reload(self, content: bytes) -> bool:
        """Validate `content` (the file's bytes) and swap it in. Returns whether it was applied;
        a failure is logged and counted, and the running config stays."""
        try:
            new, kept = self._prepare(content)
            live = build_live(new, self.gateway.redis, self.gateway.degraded, self.gateway.secret)
        except ReloadError as exc:
            self._fail(str(exc))
            return False
        except CredentialError as exc:
            self._fail(str(exc))
            return False
        old = self.gateway.config
        self._swap(new, live)
        self.reloads += 1
        metrics.CONFIG_RELOADS.labels("success").inc()
        metrics.CONFIG_LAST_SUCCESS.set(time.time())
        for name in kept:
            log.warning("routing config: %s changed in %s: it needs a restart, the running value stays", name, self.path)
        log.info("routing config reloaded from %s (reload %d): %s", self.path, self.reloads, describe_change(old, new))
        return True

    def _prepare(self, content: bytes) -> tuple[Config, list[str]]:
        import yaml

        try:
            data = yaml.safe_load(content.decode("utf-8"))
            new = parse_config(data, source=str(self.path))
        except UnicodeDecodeError:
            raise ReloadError(f"{self.path}: not UTF-8 text") from None
        except yaml.YAMLError as exc:
            raise ReloadError(f"{self.path}: not valid YAML: {' '.join(str(exc).split())}") from None
        except ConfigError as exc:
            raise ReloadError(f"invalid configuration {self.path}: {'; '.join(exc.problems)}") from None
        new, kept = keep_restart_only(self.gateway.config, new)
        if self.envoy_path is not None:
            try:
                problems = envoy_check.check_files(new, self.envoy_path)
            except EnvoyConfigError as exc:
                raise ReloadError(str(exc)) from None
            if problems:
                raise ReloadError(f"{self.path} disagrees with {self.envoy_path}: {'; '.join(problems)}")
        return new, kept

    def _swap(self, new: Config, live: LiveConfig) -> None:
        """Everything at once: no await, so no stream sees half of it."""
        gateway = self.gateway
        old = gateway.config
        gateway.config = new
        gateway.processor.live = live
        gateway.leases.reconfigure(new, live.state, live.router)
        gateway.degraded.reconfigure(new)
        gateway.outage.reconfigure(new, live.router)
        if gateway.fleet_reader is not None:
            gateway.fleet_reader.reconfigure(new)
        if _health_inputs(old) != _health_inputs(new):
            gateway.replace_health_monitor(new)

    def _fail(self, why: str) -> None:
        metrics.CONFIG_RELOADS.labels("failure").inc()
        log.error("routing config not reloaded, the running one stays: %s", why)

    def _signature(self) -> tuple[int, int, int] | None:
        try:
            stat = self.path.stat()
        except OSError:
            return None
        return stat.st_mtime_ns, stat.st_size, stat.st_ino

    def _read(self) -> bytes | None:
        try:
            return self.path.read_bytes()
        except OSError:
            return None

    @staticmethod
    def _digest(content: bytes | None) -> str | None:
        return None if content is None else hashlib.sha256(content).hexdigest()


def describe_change(old: Config, new: Config) -> str:
    """One line on what a reload changed: providers added and removed, pairs whose models, limits
    or features changed, and whether any other setting did."""
    old_providers = {p.name: p for p in old.providers}
    new_providers = {p.name: p for p in new.providers}
    parts = []
    added = [name for name in new_providers if name not in old_providers]
    removed = [name for name in old_providers if name not in new_providers]
    changed = [name for name in new_providers if name in old_providers and new_providers[name] != old_providers[name]]
    if added:
        parts.append("providers added: " + ", ".join(added))
    if removed:
        parts.append("providers removed: " + ", ".join(removed))
    if changed:
        parts.append("providers changed: " + ", ".join(changed))
    if [p.name for p in old.providers] != [p.name for p in new.providers] and not (added or removed):
        parts.append("priority order changed")
    if old.model_copy(update={"providers": []}) != new.model_copy(update={"providers": []}):
        parts.append("settings changed")
    return "; ".join(parts) or "no change"
