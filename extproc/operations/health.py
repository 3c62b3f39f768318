"""Automatic degradation of managed providers: active health checks, passive failure counting
and a load gauge. Every ext_proc instance runs them; the state lives in Redis as degraded flags
(extproc.routing.degraded), one source each, so every instance routes by the same flags within one
refresh interval and one source never clears another's (nor an operator's drain).

- Active (`health`): a GET of the provider's `health_check.url` every `interval_seconds`. After
  `failures_before_degraded` failures in a row this instance sets the provider's health flag on
  every model, renewing it at every check while it fails, with a TTL of `flag_ttl_intervals`
  intervals (or timeouts, if longer): a checker that dies stops renewing and the flag expires. After
  `successes_before_healthy` successes in a row this instance clears it. A provider is degraded
  while any instance sees it failing.
- Passive (`passive`): an upstream 5xx answer (Envoy answers 503 itself on a connection failure
  or a reset before the response headers) is recorded in the pair's sliding window in Redis, over
  every instance (lua/upstream_failure.lua, one round trip per failure, none per success). When
  the window holds `degradation.passive.failures`, the pair is degraded for `cooldown_seconds`.
- Load (`load`): a gauge read from the provider's Prometheus endpoint; over `threshold` the
  pair is degraded until the gauge is back at or below `recover_below`.
- Connect (`connect`): a request whose connection the provider refused or reset before the
  response headers degrades its pair at once for `degradation.connect.ttl_seconds`, so the
  session's next turn repins instead of meeting the same dead provider until the active check
  notices. The pair's next 2xx response or a healthy check of the provider clears it.

On a provider with affinity `pick`, every source judges each endpoint instead of the pair: the
check and the load gauge are sent to each endpoint, and a failure counts against the endpoint
that answered (Envoy's `upstream.address`); their flags (extproc.routing.endpoint_health) take
only that endpoint out of placement, and the pair is degraded once every endpoint is out. The
load gauge also records each engine's count of requests, a load term of placement.

Unlimited providers are never degraded (the spec): they get no checks and no failure counting.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from urllib.parse import urlsplit, urlunsplit

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis

from extproc import metrics
from extproc.config import Config, HealthCheck, LoadGauge, LoadSignal, Provider, ProviderKind
from extproc.config.endpoints import pick_endpoints
from extproc.routing.degraded import CONNECT, HEALTH, LOAD, PASSIVE, DegradedFlags
from extproc.routing.endpoint_health import EndpointHealth
from extproc.routing.state import script_source
from extproc.storage.client import REDIS_FAILURES, LuaScript, in_own_task
from extproc.storage.keys import Keyspace
from extproc.supervision import run_every

log = logging.getLogger(__name__)

# Passive failure recording: one queue of this many failures, drained by this many writers, so a
# burst of 5xx costs a bounded amount of memory and of Redis connections beside the hot path.
PASSIVE_QUEUE_SIZE = 1024
PASSIVE_WRITERS = 2


class Streak:
    """Consecutive check results of one provider: degraded after `failures_before_degraded`
    failures in a row, healthy again after `successes_before_healthy` successes in a row."""

    def __init__(self, failures_before_degraded: int, successes_before_healthy: int):
        self.failures_before_degraded = failures_before_degraded
        self.successes_before_healthy = successes_before_healthy
        self.degraded = False
        self.failures = 0
        self.successes = 0

    def record(self, ok: bool) -> bool:
        """Count one result; returns whether the provider is degraded now."""
        if ok:
            self.successes, self.failures = self.successes + 1, 0
            if self.degraded and self.successes >= self.successes_before_healthy:
                self.degraded = False
        else:
            self.failures, self.successes = self.failures + 1, 0
            if self.failures >= self.failures_before_degraded:
                self.degraded = True
        return self.degraded


def gauge_values(text: str, metric: str, model_label: str | None, upstream_names: dict[str, str]) -> dict[str, float]:
    """Per model, one gauge read from a Prometheus text exposition: the sum of the samples named
    `metric`, or with `model_label`, of those whose label equals the model's upstream name
    (`upstream_names`: model -> upstream name). A model without samples reads 0. Raises
    ValueError for text that does not parse."""
    return signal_values(text, [metric], model_label, upstream_names)[metric]


def signal_values(text: str, metrics_read: list[str], model_label: str | None, upstream_names: dict[str, str]) -> dict[str, dict[str, float]]:
    """`gauge_values` of every metric in `metrics_read` from one parse of `text`: metric -> model
    -> value. Raises ValueError for text that does not parse."""
    totals = dict.fromkeys(metrics_read, 0.0)
    by_label: dict[str, dict[str, float]] = {metric: {} for metric in metrics_read}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name not in totals:
                continue
            totals[sample.name] += sample.value
            if model_label is not None:
                label = sample.labels.get(model_label)
                if label is not None:
                    by_label[sample.name][label] = by_label[sample.name].get(label, 0.0) + sample.value
    if model_label is None:
        return {metric: {model: totals[metric] for model in upstream_names} for metric in metrics_read}
    return {metric: {model: by_label[metric].get(name, 0.0) for model, name in upstream_names.items()} for metric in metrics_read}


def over_threshold(value: float, was_over: bool, threshold: float, recover_below: float) -> bool:
    """Whether a load gauge reading keeps (or puts) its pair degraded: above `threshold`, or
    still above `recover_below` after being over (hysteresis)."""
    return value > threshold or (was_over and value > recover_below)


def saturation(signals: list[LoadSignal], values: dict[str, float], over: dict[tuple[str, str], bool], model: str) -> list[str]:
    """Why `model` is saturated by one reading (`values`: metric -> value): one text per signal
    over its threshold (with its hysteresis, kept in `over`: (model, metric) -> over), [] when
    none is."""
    saturated = []
    for signal in signals:
        key = (model, signal.metric)
        value = values[signal.metric]
        over[key] = over_threshold(value, over.get(key, False), signal.threshold, signal.recovers_at)
        if over[key]:
            reason = f"{signal.metric}={value:g} (degraded above {signal.threshold:g}"
            saturated.append(reason + (f", until <= {signal.recovers_at:g})" if signal.recovers_at != signal.threshold else ")"))
    return saturated


def display_url(url: str) -> str:
    """`url` without user info and query, for reasons and logs (they may hold secrets)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


class HealthMonitor:
    """The automatic degradation sources of one ext_proc instance. `start()` begins the active
    and load checks, `observe()` feeds the passive one, `close()` stops everything."""

    def __init__(self, config: Config, redis: Redis, flags: DegradedFlags):
        self.config = config
        self.redis = redis
        self.flags = flags
        self.keys = Keyspace(config.redis.key_prefix)
        self.passive = config.degradation.passive
        self._ttl_intervals = config.degradation.flag_ttl_intervals
        self._record = LuaScript(script_source("upstream_failure"))
        self._managed = {p.name for p in config.providers if p.kind is ProviderKind.MANAGED}
        self._tasks: set[asyncio.Task] = set()
        self._http: aiohttp.ClientSession | None = None
        # Passive failures to write: (provider, model, what, endpoint or None: the pair's).
        self._failures: asyncio.Queue[tuple[str, str, str, str | None]] = asyncio.Queue(maxsize=PASSIVE_QUEUE_SIZE)
        self.endpoints = EndpointHealth(redis, config.redis.key_prefix)
        self._picks = {p.name for p in config.providers if p.kind is ProviderKind.MANAGED and p.picks}

    def start(self) -> None:
        """Start the passive check's writers and one supervised task per configured health
        check and load gauge (managed providers only), each restarted after any exception
        (extproc.supervision)."""
        if self.passive.enabled and self._managed:
            for i in range(PASSIVE_WRITERS):
                self._spawn(run_every(f"passive_writer_{i}", self._write_one_failure, 0))
        checks = [p for p in self.config.providers if p.name in self._managed and (p.health_check or p.load)]
        if not checks:
            return
        # A fresh connection per probe: a probe also checks that the provider accepts connections.
        self._http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
        for provider in checks:
            if provider.health_check is not None:
                interval = provider.health_check.interval_seconds
                # Affinity pick: the check against each endpoint, whose flag takes only it out.
                steps = [(f"health:{provider.name}:{e}", _EndpointCheckTask(self, provider, provider.health_check, e).step)
                         for e in pick_endpoints(provider.endpoints)] if provider.name in self._picks else [
                         (f"health:{provider.name}", _HealthCheckTask(self, provider, provider.health_check).step)]
                for name, step in steps:
                    # Backoff at most one interval: a restarted check renews the flag before its TTL.
                    self._spawn(run_every(name, step, interval, max_backoff_seconds=interval))
            if provider.load is not None:
                interval = provider.load.interval_seconds
                # Affinity pick: each endpoint's engine read on its own, its flag takes only it out.
                steps = [(f"load:{provider.name}:{e}", _EndpointLoadTask(self, provider, provider.load, e).step)
                         for e in pick_endpoints(provider.endpoints)] if provider.name in self._picks else [
                         (f"load:{provider.name}", _LoadGaugeTask(self, provider, provider.load).step)]
                for name, step in steps:
                    self._spawn(run_every(name, step, interval, max_backoff_seconds=interval))

    async def close(self) -> None:
        """Stop the checks and any failure still being recorded (a lost record only delays a
        degradation)."""
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._http is not None:
            await self._http.close()

    def observe(self, provider: Provider, model: str, status: int | None, endpoint: str | None = None) -> None:
        """Passive check: the response status of a request sent to (provider, model), or None
        when the stream ended without response headers. A 5xx is queued for the writers (the
        response is never delayed); with the queue full it is dropped and counted in
        iris_upstream_failures_dropped_total. Anything else is ignored. On a pair with affinity
        pick, `endpoint` (`ip:port`, the host that answered) counts the failure against that
        endpoint alone (its burst takes the endpoint out, not the pair)."""
        if status is None or status < 500 or not self.passive.enabled or provider.name not in self._managed:
            return
        metrics.child(metrics.UPSTREAM_FAILURES, provider.name, model).inc()
        endpoint = endpoint if provider.name in self._picks else None
        try:
            self._failures.put_nowait((provider.name, model, f"status {status}", endpoint))
        except asyncio.QueueFull:
            metrics.FAILURES_DROPPED.inc()

    async def _write_one_failure(self) -> None:
        provider, model, what, endpoint = await self._failures.get()
        if endpoint is None:
            await self.record_failure(provider, model, what)
        else:
            await self.record_endpoint_failure(provider, model, endpoint, what)

    async def record_endpoint_failure(self, provider: str, model: str, endpoint: str, what: str) -> bool:
        """Record one failure of a pick pair's endpoint (`ip:port`) in Redis; returns whether it
        took the endpoint out (the pair's passive settings: failures within the window, out for
        the cool-down). A Redis error is logged and answered False."""
        passive = self.passive
        try:
            out = await self.endpoints.record_failure(
                provider, model, endpoint, what, passive.window_seconds, passive.failures, passive.cooldown_seconds
            )
            if out:
                await self.flags.refresh()  # every endpoint out degrades the pair: seen here at once
        except REDIS_FAILURES as exc:
            log.warning("upstream failure of %s %s endpoint %s not recorded: %s", provider, model, endpoint, exc)
            return False
        if out:
            metrics.child(metrics.DEGRADATIONS, provider, PASSIVE).inc()
            log.warning("%s %s endpoint %s out for %g s: %s", provider, model, endpoint, passive.cooldown_seconds, what)
        return out

    async def connection_failed(self, provider: Provider, model: str, what: str, endpoint: str | None = None) -> None:
        """Connect source: Envoy could not reach (provider, model) (connection refused or reset
        before the response headers; `what` is Envoy's response code details). Degrades the
        pair at once, in Redis and in this instance's snapshot, so the next decision here avoids
        it; every other instance sees it at its next refresh. On a pair with affinity pick and a
        known `endpoint` (`ip:port`), takes only that endpoint out instead (every proxy's next
        placement avoids it; it comes back when its TTL ends or the endpoint's health check
        passes). Awaited by the caller (one Redis round trip on a failed request only, two when
        an endpoint goes out); a Redis error is logged, never raised."""
        connect = self.config.degradation.connect
        if not connect.enabled or provider.name not in self._managed:
            return
        if endpoint is not None and provider.name in self._picks:
            await self._endpoint_connect_failed(provider, model, what, endpoint)
            return
        reason = f"connect: {what[:200]}"
        try:
            await in_own_task(self.flags.set(provider.name, model, reason, connect.ttl_seconds, CONNECT))
        except REDIS_FAILURES as exc:
            log.warning("connect failure of %s %s not recorded: %s", provider.name, model, exc)
            return
        metrics.child(metrics.DEGRADATIONS, provider.name, CONNECT).inc()
        log.warning("%s %s degraded for %g s: %s", provider.name, model, connect.ttl_seconds, reason)

    async def _endpoint_connect_failed(self, provider: Provider, model: str, what: str, endpoint: str) -> None:
        connect = self.config.degradation.connect
        reason = f"connect: {what[:200]}"
        try:
            await in_own_task(self.endpoints.set(provider.name, model, endpoint, reason, connect.ttl_seconds, CONNECT))
            await in_own_task(self.flags.refresh())  # every endpoint out degrades the pair: seen here at once
        except REDIS_FAILURES as exc:
            log.warning("connect failure of %s %s endpoint %s not recorded: %s", provider.name, model, endpoint, exc)
            return
        metrics.child(metrics.DEGRADATIONS, provider.name, CONNECT).inc()
        log.warning("%s %s endpoint %s out for %g s: %s", provider.name, model, endpoint, connect.ttl_seconds, reason)

    def succeeded(self, provider: Provider, model: str) -> None:
        """A 2xx response of (provider, model): clears the pair's connect flag if this instance's
        snapshot holds one (in the background; nothing is sent to Redis otherwise)."""
        if CONNECT in self.flags.flags(provider.name, model):
            self._spawn(self._clear_connect([(provider.name, model)]))

    async def _clear_connect(self, pairs: list[tuple[str, str]]) -> None:
        try:
            await self.flags.clear_many(pairs, CONNECT)
        except REDIS_FAILURES as exc:
            log.warning("connect flag of %s not cleared: %s", pairs, exc)

    async def record_failure(self, provider: str, model: str, what: str) -> bool:
        """Record one failure of the pair in Redis; returns whether it degraded the pair.
        A Redis error is logged and answered False (a lost observation only delays detection)."""
        passive = self.passive
        reason = f"passive: {passive.failures} upstream failures within {passive.window_seconds:g} s (last: {what})"
        keys = [self.keys.upstream_failures(model, provider), self.keys.degraded(model, provider, PASSIVE)]
        args = [uuid.uuid4().hex, round(passive.window_seconds * 1000), passive.failures,
                round(passive.cooldown_seconds * 1000), reason]
        try:
            degraded, _ = await self._record(self.redis, keys, args)
        except REDIS_FAILURES as exc:
            log.warning("upstream failure of %s %s not recorded: %s", provider, model, exc)
            return False
        if degraded:
            metrics.child(metrics.DEGRADATIONS, provider, PASSIVE).inc()
            log.warning("%s %s degraded for %g s: %s", provider, model, passive.cooldown_seconds, reason)
            try:
                await self.flags.refresh()  # this instance avoids it at once, not at the next tick
            except REDIS_FAILURES:
                pass
        return bool(degraded)

    def _spawn(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _probe(self, url: str, shown: str, timeout_seconds: float) -> tuple[bool, str]:
        try:
            timeout = aiohttp.ClientTimeout(total=timeout_seconds)
            async with self._http.get(url, timeout=timeout, allow_redirects=False) as response:
                return 200 <= response.status < 300, f"GET {shown} -> {response.status}"
        except asyncio.TimeoutError:
            return False, f"GET {shown}: no answer within {timeout_seconds:g} s"
        except aiohttp.ClientError as exc:
            return False, f"GET {shown}: {type(exc).__name__}"


class _HealthCheckTask:
    """One provider's active health check; `step()` is one probe and its effect on the flag.
    The streak lives here, so a step restarted after an exception keeps it (and the flag)."""

    def __init__(self, monitor: HealthMonitor, provider: Provider, check: HealthCheck):
        self.monitor = monitor
        self.provider = provider
        self.check = check
        self.streak = Streak(check.failures_before_degraded, check.successes_before_healthy)
        self.pairs = monitor.flags.pairs(provider.name)
        # A failing probe may take its whole timeout: the TTL covers the longer of the two.
        self.ttl = max(check.interval_seconds, check.timeout_seconds) * monitor._ttl_intervals
        self.url = display_url(check.url)
        self.last_failure = ""
        self.must_clear = False

    async def step(self) -> None:
        check, streak, name = self.check, self.streak, self.provider.name
        ok, detail = await self.monitor._probe(check.url, self.url, check.timeout_seconds)
        metrics.child(metrics.HEALTH_CHECKS, name, "ok" if ok else "failed").inc()
        was_degraded = streak.degraded
        if not ok:
            self.last_failure = detail
        try:
            if streak.record(ok):
                if ok:
                    reason = (f"health: recovering, {streak.successes} of {check.successes_before_healthy} "
                              f"successes (last failure: {self.last_failure})")
                else:
                    reason = f"health: {detail} ({streak.failures} failures in a row)"
                await self.monitor.flags.set_many(self.pairs, reason, self.ttl, HEALTH)
                if not was_degraded:
                    metrics.child(metrics.DEGRADATIONS, name, HEALTH).inc()
                    log.warning("%s degraded: %s", name, reason)
            elif was_degraded or self.must_clear:
                self.must_clear = True
                await self.monitor.flags.clear_many(self.pairs, HEALTH)
                self.must_clear = False
                log.warning("%s healthy again: %s", name, detail)
            if ok and (connected := [pair for pair in self.pairs if CONNECT in self.monitor.flags.flags(*pair)]):
                await self.monitor.flags.clear_many(connected, CONNECT)
        except REDIS_FAILURES as exc:
            log.warning("health state of %s not written: %s", name, exc)


def endpoint_check_url(url: str, endpoint: str) -> str:
    """The health check `url` sent to one endpoint (`ip:port`) of a pick pool: its scheme, path
    and query against the endpoint's address (user info dropped)."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, endpoint, parts.path, parts.query, ""))


class _EndpointCheckTask:
    """The active check of one endpoint of a provider with affinity pick: the provider's health
    check URL against the endpoint's address, with the check's streak settings; its `health`
    flag (extproc.routing.endpoint_health) takes the endpoint out of placement on every model of
    the provider, and a passing check clears it and the endpoint's `connect` flags."""

    def __init__(self, monitor: HealthMonitor, provider: Provider, check: HealthCheck, endpoint: str):
        self.monitor = monitor
        self.check = check
        self.endpoint = endpoint
        self.pairs = monitor.flags.pairs(provider.name)
        self.streak = Streak(check.failures_before_degraded, check.successes_before_healthy)
        self.ttl = max(check.interval_seconds, check.timeout_seconds) * monitor._ttl_intervals
        self.url = endpoint_check_url(check.url, endpoint)
        self.shown = display_url(self.url)
        self.last_failure = ""
        self.must_clear = False

    async def step(self) -> None:
        check, streak, endpoints = self.check, self.streak, self.monitor.endpoints
        ok, detail = await self.monitor._probe(self.url, self.shown, check.timeout_seconds)
        provider = self.pairs[0][0] if self.pairs else ""
        metrics.child(metrics.HEALTH_CHECKS, provider, "ok" if ok else "failed").inc()
        was_out = streak.degraded
        if not ok:
            self.last_failure = detail
        try:
            if streak.record(ok):
                reason = (f"health: recovering, {streak.successes} of {check.successes_before_healthy} successes "
                          f"(last failure: {self.last_failure})") if ok else f"health: {detail} ({streak.failures} failures in a row)"
                for name, model in self.pairs:
                    await endpoints.set(name, model, self.endpoint, reason, self.ttl, HEALTH)
                if not was_out:
                    metrics.child(metrics.DEGRADATIONS, provider, HEALTH).inc()
                    log.warning("%s endpoint %s out: %s", provider, self.endpoint, reason)
                    await self.monitor.flags.refresh()  # every endpoint out degrades the pair: seen here at once
            elif was_out or self.must_clear:
                self.must_clear = True
                for name, model in self.pairs:
                    await endpoints.clear(name, model, self.endpoint, HEALTH)
                self.must_clear = False
                log.warning("%s endpoint %s healthy again: %s", provider, self.endpoint, detail)
                await self.monitor.flags.refresh()
            if ok:
                for name, model in self.pairs:
                    await endpoints.clear(name, model, self.endpoint, CONNECT)
        except REDIS_FAILURES as exc:
            log.warning("health state of %s endpoint %s not written: %s", provider, self.endpoint, exc)


class _GaugeReader:
    """Reads one Prometheus endpoint of a load gauge (`url`, text format) within the gauge's
    timeout, and keeps the time of its last successful reading to tell when it is stale."""

    def __init__(self, monitor: HealthMonitor, gauge: LoadGauge, url: str, metrics_read: list[str],
                 upstream_names: dict[str, str], stale_after: float | None):
        self.monitor = monitor
        self.gauge = gauge
        self.url = url
        self.shown = display_url(url)
        self.metrics_read = metrics_read
        self.upstream_names = upstream_names
        self.stale_after = stale_after  # seconds, None: never stale
        self.reachable = True
        self.last_read = time.monotonic()

    async def read(self, what: str) -> dict[str, dict[str, float]] | None:
        """One reading: metric -> model -> value (signal_values), or None when the endpoint did
        not answer 2xx with parseable text in time (logged once per outage, naming `what`)."""
        try:
            timeout = aiohttp.ClientTimeout(total=self.gauge.timeout_seconds)
            async with self.monitor._http.get(self.url, timeout=timeout, allow_redirects=False) as response:
                response.raise_for_status()
                text = await response.text()
            values = signal_values(text, self.metrics_read, self.gauge.label(), self.upstream_names)
        except (asyncio.TimeoutError, aiohttp.ClientError, ValueError) as exc:
            if self.reachable:
                log.warning("load of %s not read from %s: %s", what, self.shown, type(exc).__name__)
            self.reachable = False
            return None
        self.reachable, self.last_read = True, time.monotonic()
        return values

    def stale_reason(self) -> str | None:
        """The flag's reason when no reading succeeded for `stale_after` seconds, else None."""
        stale_for = time.monotonic() - self.last_read
        if self.stale_after is None or stale_for <= self.stale_after:
            return None
        return f"load: no reading of {self.shown} for {stale_for:.0f} s (stale after {self.stale_after:g} s)"


class _LoadGaugeTask:
    """One provider's load gauge; `step()` is one reading and its effect on the flags: a pair is
    saturated while any of the gauge's signals is over its threshold (each with its hysteresis),
    and, with `stale_after_seconds`, while no reading succeeded for that long (fail closed)."""

    def __init__(self, monitor: HealthMonitor, provider: Provider, gauge: LoadGauge):
        self.monitor = monitor
        self.provider = provider
        self.signals = gauge.all_signals()
        self.upstream_names = {model: entry.upstream_model or model for model, entry in provider.models.items()}
        self.ttl = max(gauge.interval_seconds, gauge.timeout_seconds) * monitor._ttl_intervals
        self.reader = _GaugeReader(monitor, gauge, gauge.url, [s.metric for s in self.signals], self.upstream_names,
                                   gauge.stale_after(picks=False))
        self.over: dict[tuple[str, str], bool] = {}  # (model, metric) -> over its threshold
        self.flagged: dict[str, bool] = {}  # model -> its LOAD flag is held

    async def step(self) -> None:
        values = await self.reader.read(self.provider.name)
        if values is None:
            # Unknown load: renew nothing, so a held flag expires within its TTL, unless the
            # reading is stale past stale_after_seconds (fail closed).
            if reason := self.reader.stale_reason():
                await self._write(lambda model: self._set(model, reason))
            return
        await self._write(lambda model: self._apply(model, {signal.metric: values[signal.metric][model] for signal in self.signals}))

    async def _write(self, per_model) -> None:
        for model in self.upstream_names:
            try:
                await per_model(model)
            except REDIS_FAILURES as exc:
                log.warning("load state of %s not written: %s", self.provider.name, exc)

    async def _apply(self, model: str, values: dict[str, float]) -> None:
        saturated = saturation(self.signals, values, self.over, model)
        if saturated:
            await self._set(model, "load: " + "; ".join(saturated))
        elif self.flagged.get(model):
            await self.monitor.flags.clear(self.provider.name, model, LOAD)
            self.flagged[model] = False
            log.warning("%s %s load back under every threshold: %s", self.provider.name, model,
                        ", ".join(f"{metric}={value:g}" for metric, value in values.items()))

    async def _set(self, model: str, reason: str) -> None:
        name = self.provider.name
        await self.monitor.flags.set(name, model, reason, self.ttl, LOAD)
        if not self.flagged.get(model):
            metrics.child(metrics.DEGRADATIONS, name, LOAD).inc()
            log.warning("%s %s degraded: %s", name, model, reason)
        self.flagged[model] = True


class _EndpointLoadTask:
    """The load gauge of one endpoint of a provider with affinity pick: the gauge's URL against
    the endpoint's address. Per model, a signal over its threshold (with its hysteresis) or no
    reading for `stale_after` seconds sets the endpoint's `load` flag (extproc.routing.
    endpoint_health: out of placement, only its sessions move), and the first reading under
    every threshold clears it; every reading also records the engine's count of requests (the
    sum of the gauge's `engine_in_flight` metrics) that placement weighs as load."""

    def __init__(self, monitor: HealthMonitor, provider: Provider, gauge: LoadGauge, endpoint: str):
        self.monitor = monitor
        self.provider = provider
        self.endpoint = endpoint
        self.signals = gauge.all_signals()
        self.in_flight = gauge.engine_in_flight()
        self.metrics = list(dict.fromkeys([s.metric for s in self.signals] + list(self.in_flight)))
        self.upstream_names = {model: entry.upstream_model or model for model, entry in provider.models.items()}
        self.ttl = max(gauge.interval_seconds, gauge.timeout_seconds) * monitor._ttl_intervals
        self.reader = _GaugeReader(monitor, gauge, endpoint_check_url(gauge.url, endpoint), self.metrics, self.upstream_names,
                                   gauge.stale_after(picks=True))
        self.over: dict[tuple[str, str], bool] = {}
        self.flagged: dict[str, bool] = {}  # model -> the endpoint's LOAD flag is held

    async def step(self) -> None:
        values = await self.reader.read(f"{self.provider.name} endpoint {self.endpoint}")
        if values is None:
            if reason := self.reader.stale_reason():
                await self._write(lambda model: self._set(model, reason))
            return
        await self._write(lambda model: self._apply(model, {metric: values[metric][model] for metric in self.metrics}))

    async def _write(self, per_model) -> None:
        for model in self.upstream_names:
            try:
                await per_model(model)
            except REDIS_FAILURES as exc:
                log.warning("load state of %s endpoint %s not written: %s", self.provider.name, self.endpoint, exc)

    async def _apply(self, model: str, values: dict[str, float]) -> None:
        endpoints, name = self.monitor.endpoints, self.provider.name
        if self.in_flight:
            requests = sum(values[metric] for metric in self.in_flight)
            await endpoints.write_readings(name, model, {self.endpoint: requests}, self.ttl)
        saturated = saturation(self.signals, values, self.over, model)
        if saturated:
            await self._set(model, "load: " + "; ".join(saturated))
        elif self.flagged.get(model):
            await endpoints.clear(name, model, self.endpoint, LOAD)
            self.flagged[model] = False
            await self.monitor.flags.refresh()
            log.warning("%s %s endpoint %s load back under every threshold", name, model, self.endpoint)

    async def _set(self, model: str, reason: str) -> None:
        name = self.provider.name
        await self.monitor.endpoints.set(name, model, self.endpoint, reason, self.ttl, LOAD)
        if not self.flagged.get(model):
            metrics.child(metrics.DEGRADATIONS, name, LOAD).inc()
            log.warning("%s %s endpoint %s out: %s", name, model, self.endpoint, reason)
            await self.monitor.flags.refresh()  # every endpoint out degrades the pair: seen here at once
        self.flagged[model] = True
