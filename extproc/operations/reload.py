"""Hot reload of the routing config: on SIGHUP and when the file changes.

`ConfigReloader` watches the file of a running ext_proc server and hands every new config that
can be used to a `ConfigReceiver` (the gateway, extproc.operations.gateway, implements it); the
reloader never edits the gateway itself. It polls the file every `server.reload_poll_seconds`
(its mtime, size and inode, then a SHA-256 of the content when they change) and reloads at once
on SIGHUP. A reload reads and validates the whole file (and, with `serve --envoy`, checks it
against the Envoy file), keeps the running values of the restart-only fields
(extproc.config.schema.RESTART_ONLY: the listen address, Redis URL and key prefix, ...) with a
log line saying a restart is needed, then calls `ConfigReceiver.apply_config`, which reads the
providers' API keys and swaps everything built from the config in one step (see Gateway).

A file that cannot be used (unreadable, invalid, disagreeing with the Envoy file, a key that
cannot be read) keeps the running config: one log line and `iris_config_reloads_total{result=
"failure"}`; so does an unexpected error while reloading (logged with its traceback). The
watcher runs supervised (extproc.supervision, task `config_reload`): nothing ends hot reload.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from extproc import metrics
from extproc.config import Config, ConfigError, envoy_check, parse_config, restart_only_fields
from extproc.config.envoy_check import EnvoyConfigError
from extproc.config.yaml_text import YamlTextError, parse_yaml
from extproc.openai_api.adaptation import CredentialError
from extproc.supervision import run_every

log = logging.getLogger(__name__)

RELOAD_TASK = "config_reload"  # the watcher's name in iris_background_task_restarts_total{task}

# The settings sections whose fields may be restart-only (extproc.config.schema.RESTART_ONLY).
SETTINGS_SECTIONS = ("server", "redis", "session", "tracing")


class ConfigReceiver(Protocol):
    """Where a reloaded config goes: the running server."""

    @property
    def config(self) -> Config:
        """The running config."""

    def apply_config(self, new: Config) -> None:
        """Build everything `new` needs and swap it in at once. Raises
        extproc.openai_api.adaptation.CredentialError when an API key cannot be read (nothing
        is swapped then)."""


def keep_restart_only(running: Config, new: Config) -> tuple[Config, list[str]]:
    """`new` with the RESTART_ONLY fields of `running`, and the names of those that differed."""
    kept = []
    sections = {}
    for section in SETTINGS_SECTIONS:
        old_settings, new_settings = getattr(running, section), getattr(new, section)
        names = restart_only_fields(type(old_settings))
        changed = {name: getattr(old_settings, name) for name in names if getattr(old_settings, name) != getattr(new_settings, name)}
        kept += [f"{section}.{name}" for name in changed]
        if changed:
            sections[section] = new_settings.model_copy(update=changed)
    return (new.model_copy(update=sections) if sections else new), kept


class ReloadError(Exception):
    """A new routing config that cannot be used; the message is one line."""


class ConfigReloader:
    """Reloads `path` into `receiver` on `request()` (SIGHUP) and on a change of the file.
    `envoy_path`: the Envoy file a new config must agree with (envoy_check), re-read each time.
    `adjust`: what this process changes in the file's config before running it (`serve --workers`:
    worker i's metrics port, extproc.operations.workers.worker_config); a new config is adjusted
    the same way before it is compared with the running one and checked, so only a real change of
    a restart-only field is reported."""

    def __init__(
        self, receiver: ConfigReceiver, path: str | os.PathLike[str], envoy_path: str | os.PathLike[str] | None = None,
        adjust: Callable[[Config], Config] | None = None,
    ):
        self.receiver = receiver
        self.path = Path(path)
        self.envoy_path = envoy_path
        self.adjust = adjust
        self.reloads = 0  # successful reloads so far
        self._wake = asyncio.Event()
        self._seen = self._signature()
        self._tried = self._digest(self._read())  # the content of the running config (or the last bad try)

    def request(self) -> None:
        """Reload as soon as possible, even if the file looks unchanged (SIGHUP)."""
        self._wake.set()

    async def run_forever(self) -> None:
        """Watch the file (`watch_once`, back to back) until cancelled, supervised as every
        background loop is (extproc.supervision, task `config_reload`): a step that raises is
        logged, counted and restarted, so no error ends hot reload."""
        await run_every(RELOAD_TASK, self.watch_once, 0)

    async def watch_once(self) -> None:
        """Wait for SIGHUP or the next poll (`server.reload_poll_seconds`; 0: SIGHUP only), then
        reload when the file changed, or at once on SIGHUP."""
        poll = self.receiver.config.server.reload_poll_seconds
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
            return
        self._seen = signature
        content = self._read()
        if content is None:
            if forced:
                self._fail(f"cannot read {self.path}")
            return
        digest = self._digest(content)
        if forced or digest != self._tried:
            self._tried = digest
            self.reload(content)

    def reload(self, content: bytes) -> bool:
        """Validate `content` (the file's bytes) and swap it in. Returns whether it was applied;
        a failure is logged and counted, and the running config stays."""
        old = self.receiver.config
        try:
            new, kept = self._prepare(content)
            self.receiver.apply_config(new)
        except (ReloadError, CredentialError) as exc:
            self._fail(str(exc))
            return False
        except Exception:  # a bug, not a bad file: the running config stays, and reloading goes on
            metrics.CONFIG_RELOADS.labels("failure").inc()
            log.exception("routing config not reloaded, the running one stays: unexpected error reading %s", self.path)
            return False
        self.reloads += 1
        metrics.CONFIG_RELOADS.labels("success").inc()
        metrics.CONFIG_LAST_SUCCESS.set(time.time())
        for name in kept:
            log.warning("routing config: %s changed in %s: it needs a restart, the running value stays", name, self.path)
        log.info("routing config reloaded from %s (reload %d): %s", self.path, self.reloads, describe_change(old, new))
        return True

    def _prepare(self, content: bytes) -> tuple[Config, list[str]]:
        try:
            data = parse_yaml(content.decode("utf-8"))
            new = parse_config(data, source=str(self.path))
        except UnicodeDecodeError:
            raise ReloadError(f"{self.path}: not UTF-8 text") from None
        except YamlTextError as exc:
            raise ReloadError(f"{self.path}: not valid YAML: {exc}") from None
        except ConfigError as exc:
            raise ReloadError(f"invalid configuration {self.path}: {'; '.join(exc.problems)}") from None
        if self.adjust is not None:
            new = self.adjust(new)
        new, kept = keep_restart_only(self.receiver.config, new)
        if self.envoy_path is not None:
            try:
                problems = envoy_check.check_files(new, self.envoy_path)
            except EnvoyConfigError as exc:
                raise ReloadError(str(exc)) from None
            if problems:
                raise ReloadError(f"{self.path} disagrees with {self.envoy_path}: {'; '.join(problems)}")
        return new, kept

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
