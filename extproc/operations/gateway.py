"""The runner: wires every part of the ext_proc server in one place (`Gateway`), starts it, and
runs it until SIGTERM or SIGINT (`serve`), then drains.

Background loops (extproc.supervision): the degraded-flag refresh, the instance heartbeat (which
also watches the routing state's epoch), while the Redis breaker is open, the Redis probe, and
the re-resolution of pick providers' DNS names (extproc.routing.endpoint_refresh).
The drain sequence is docs/operations.md "Draining".
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import time
from collections.abc import Callable

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc import metrics
from extproc.config import Config
from extproc.operations import exporter, grpc_logs
from extproc.operations.fleet_state import CachedFleetState, FleetStateReader, instance_description, on_loop
from extproc.operations.health import HealthMonitor
from extproc.operations.ports import ListenError, unavailable
from extproc.operations.reload import ConfigReloader
from extproc.operations.session_secret import session_secret
from extproc.protocol.live import build_live
from extproc.protocol.stream import ExternalProcessor
from extproc.protocol.tracing import start_tracing
from extproc.routing.degraded import DegradedFlags
from extproc.routing.endpoint_refresh import EndpointRefresh
from extproc.routing.lease_table import LeaseTable
from extproc.routing.outage import InstanceRegistry, OutagePolicy, RedisBreaker
from extproc.routing.queue import Wakeups
from extproc.storage.client import REDIS_FAILURES, open_redis
from extproc.storage.pipelined import PipelinedRedis, open_pipelined
from extproc.storage.tls import RedisTlsError, is_tls_failure
from extproc.supervision import run_every

log = logging.getLogger(__name__)

GRPC_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# The services grpc.health.v1.Health reports on: the whole server ("") and the one Envoy uses.
EXT_PROC_SERVICE = external_processor_pb2.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name
HEALTH_SERVICES = ("", EXT_PROC_SERVICE)


class Gateway:
    """The running server, wired in one place: the Redis clients (redis-py, and the pipelined
    hot-path client of the routing scripts unless `redis.hot_path_client` is `redis-py`: one
    each per process, shared by every config a reload builds), the degraded flags, the live
    routing config, the lease table with its outage policy and breaker, the health monitor, the
    tracer (extproc.protocol.tracing, when tracing is on), the stream loop
    (extproc.protocol.stream) and the gRPC server with its health service. It is the
    ConfigReceiver of extproc.operations.reload. Use `serve()`.

    `worker_index`: which worker of `server.workers` this is; it listens on
    `server.worker_listen(worker_index)`. Raises ListenError when that address cannot be bound."""

    def __init__(self, config: Config, secret: bytes, worker_index: int = 0):
        self.config = config
        self.listen = config.server.worker_listen(worker_index)
        self.redis = open_redis(config.redis)
        self.hot_path = open_hot_path(config)
        self.secret = secret
        self.degraded = DegradedFlags(self.redis, config)
        self.wakeups = Wakeups()  # the admission queue's wake-ups (docs/queue.md), for every config
        live = build_live(config, self.redis, self.degraded, secret, self.wakeups, self.hot_path)
        self.registry = InstanceRegistry(self.redis, config.redis.key_prefix, ttl_seconds=config.redis.instance_heartbeat_seconds * 5)
        self.registry.description = instance_description(config)  # what `iris-extproc status` shows without a file
        self.breaker = RedisBreaker(self.redis, config.redis.breaker_failures_in_a_row)
        self.outage = OutagePolicy(config, live.router, self.registry)
        self.leases = LeaseTable(config, live.state, live.router, self.outage, self.breaker)
        self.health = HealthMonitor(config, self.redis, self.degraded)
        self.endpoint_refresh = EndpointRefresh(lambda: self.leases.state)  # the live state's DNS names
        self.tracer = start_tracing(config.tracing)  # restart-only: None while tracing is off
        self.processor = ExternalProcessor(live, self.leases, self.breaker, observer=self.health, tracer=self.tracer)
        self._retired_monitors: set[asyncio.Task] = set()
        self.fleet_reader: FleetStateReader | None = None  # the metrics' reader, when metrics are served
        self.server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", GRPC_MAX_MESSAGE_BYTES),
                # Off (grpcio's default on Linux is on): a port another process holds is an error,
                # not a port shared with it; each worker has its own (extproc.operations.ports).
                ("grpc.so_reuseport", 0),
            ]
        )
        ext_proc_grpc.add_ExternalProcessorServicer_to_server(self.processor, self.server)
        self.serving = grpc_health.aio.HealthServicer()
        self.draining = False
        health_pb2_grpc.add_HealthServicer_to_server(self.serving, self.server)
        try:
            self.port = self.server.add_insecure_port(self.listen)
        except RuntimeError:
            raise ListenError(f"cannot listen on {', '.join(unavailable([self.listen])) or self.listen}") from None
        self._background: list[asyncio.Task] = []

    async def start(self) -> None:
        """Reach Redis with both clients, load scripts and flags when Redis is there (it may
        come later), start serving. Raises RedisTlsError when a client's TLS handshake with
        Redis fails (a configuration error, not an outage: extproc.storage.tls)."""
        await self._first_contact()
        self.leases.start()
        try:
            await self.leases.state.load_scripts()
            await self.leases.refresh_epoch()
            await self.degraded.refresh()
        except REDIS_FAILURES as exc:
            log.warning("redis not reachable at start-up, continuing: %s", exc)
        # Supervised (extproc.supervision): a step that raises is restarted, counted and logged.
        redis = self.config.redis
        self._background += [
            asyncio.create_task(self.degraded.run_refresher(self.config.server.degraded_refresh_seconds)),
            asyncio.create_task(run_every("heartbeat", self._heartbeat_once, redis.instance_heartbeat_seconds)),
            asyncio.create_task(run_every("redis_probe", self._probe_once, redis.probe_interval_seconds)),
            asyncio.create_task(run_every("queue_wakeups", self._listen_for_wakeups, redis.probe_interval_seconds)),
            asyncio.create_task(run_every("endpoint_refresh", self.endpoint_refresh.run, 0,
                                          max_backoff_seconds=self.config.routing.placement.dns_refresh_seconds)),
        ]
        sample = exporter.track_process_gauges(lambda: self.breaker.is_open, lambda: self.leases.local_leases)
        if sample is not None:  # several workers: their files, written once a second
            self._background.append(asyncio.create_task(run_every("metrics_sample", sample, exporter.SAMPLE_SECONDS)))
        self.health.start()
        for service in HEALTH_SERVICES:
            await self.serving.set(service, health_pb2.HealthCheckResponse.SERVING)
        await self.server.start()
        freeze_start_up_heap()
        log.info("ext_proc server listening on %s", self.listen)

    async def _first_contact(self) -> None:
        """A PING by each client (redis-py, and the hot path's when it has its own). An
        unreachable Redis is logged (it may come later); a failed TLS
        handshake raises RedisTlsError, so that a wrong CA never runs as a Redis outage."""
        pings = [("redis-py", self.redis.ping)]
        if self.hot_path is not None:
            pings.append(("pipelined", lambda: self.hot_path.execute("PING")))
        for name, ping in pings:
            try:
                await ping()
            except REDIS_FAILURES as exc:
                if is_tls_failure(exc):
                    raise RedisTlsError(f"redis: the {name} client's TLS handshake failed (redis.tls_ca_file: "
                                        f"{self.config.redis.tls_ca_file or 'the system certificates'}): {exc}") from exc
                log.warning("redis not reachable at start-up, continuing: %s", exc)
                return

    async def _heartbeat_once(self) -> None:
        """Keep this instance registered, so every instance knows the live count, and watch the
        routing state's epoch (a change adopts every lease held: extproc.routing.lease_table)."""
        try:
            await self.registry.heartbeat()
            if not self.breaker.fleet_open:
                await self.leases.refresh_epoch()
            self.breaker.record_success()
        except REDIS_FAILURES as exc:
            metrics.REDIS_ERRORS.labels("heartbeat").inc()
            self.breaker.record_failure(exc)

    async def _listen_for_wakeups(self) -> None:
        """The admission queue's pub/sub subscription (extproc.routing.queue.Wakeups.listen): one
        connection for the wake-up channels of the models whose queue is on; after a failure it is
        opened again (meanwhile waiters poll)."""
        await self.wakeups.listen(self.redis, self._wakeup_channels)

    def _wakeup_channels(self) -> tuple[str, ...]:
        config = self.config
        keys = self.leases.state.keys
        return tuple(keys.queue_wake(m) for m in config.models() if config.routing.queue.enabled(m))

    async def _probe_once(self) -> None:
        """While a scope of the breaker is open (the fleet's, or a model's), the lease table tries
        to recover each: what Redis serves again adopts what is held and routes through Redis
        again, what it does not stays open (scripts reload by themselves on NOSCRIPT)."""
        if not self.breaker.is_open:
            return
        try:
            await self.degraded.refresh()
        except REDIS_FAILURES as exc:  # a dead shard's flags: its models stay open, the others recover
            log.info("degraded flags not refreshed before the recovery: %s", exc)
        try:
            adopted = await self.leases.recover()
        except REDIS_FAILURES:
            return
        if adopted or not self.breaker.is_open:
            log.info("shared routing resumed (%s still open); %d local leases adopted into Redis",
                     sorted(self.breaker.open_models) or "no model", adopted)

    def apply_config(self, new: Config) -> None:
        """ConfigReceiver: build everything `new` needs (API keys read), then swap it in without
        awaiting, so no stream sees half of it. The live config goes to the stream loop; the lease
        table decides with the new state and router (every lease it holds renews, adopts and
        releases through the state it was admitted with); the degraded flags and the outage policy
        are reconfigured in place; the health monitor is replaced only when its checks changed;
        the metrics' fleet-state reader reads the new pairs. Raises CredentialError (nothing
        swapped)."""
        live = build_live(new, self.redis, self.degraded, self.secret, self.wakeups, self.hot_path)
        old, self.config = self.config, new
        self.processor.apply(live)
        self.leases.reconfigure(new, live.state, live.router)
        self.degraded.reconfigure(new)
        self.outage.reconfigure(new, live.router)
        self.registry.description = instance_description(new)
        if self.fleet_reader is not None:
            self.fleet_reader.reconfigure(new)
        if _health_inputs(old) != _health_inputs(new):
            self.replace_health_monitor(new)

    def replace_health_monitor(self, config: Config) -> None:
        """Start a HealthMonitor for `config` and stop the running one."""
        old, self.health = self.health, HealthMonitor(config, self.redis, self.degraded)
        self.processor.observer = self.health
        self.health.start()
        task = asyncio.get_running_loop().create_task(old.close())
        self._retired_monitors.add(task)
        task.add_done_callback(self._retired_monitors.discard)

    async def drain(self, delay_seconds: float | None = None) -> None:
        """The drain sequence (docs/operations.md "Draining"): report NOT_SERVING on grpc.health.v1.Health,
        keep serving for `delay_seconds` (default `server.drain_delay_seconds`) while Envoy's
        health check takes this server out of rotation, then take no new stream and let open ones
        finish within `server.drain_grace_seconds` (both seconds), release what is left, stop
        the background tasks and wait for them to end, close the Redis clients. A background
        task cancelled in the middle of a Redis call and left running past the clients' close
        could leave a send that never ran, on which the event loop's close then waited forever
        (issue 29 item 17: a gateway drained right after its start, grpc's poller engine)."""
        self.draining = True
        settings = self.config.server
        delay = settings.drain_delay_seconds if delay_seconds is None else delay_seconds
        log.info("draining: NOT_SERVING, still taking streams for %s s", delay)
        await self.serving.enter_graceful_shutdown()
        await asyncio.sleep(delay)
        log.info("draining: no new streams, up to %s s for open ones", settings.drain_grace_seconds)
        self.wakeups.close()  # requests waiting in the admission queue take their next step now
        await self.server.stop(settings.drain_grace_seconds)
        await self.leases.drain()
        await self.health.close()
        if self.tracer is not None:
            await self.tracer.close()  # the spans still queued, for 2 s at most
        for task in self._background:
            task.cancel()
        if self._background:  # they end before the clients they use close: no send left behind
            await asyncio.wait(self._background, timeout=BACKGROUND_STOP_SECONDS)
        try:
            await self.registry.leave()
        except REDIS_FAILURES:
            pass
        if self.hot_path is not None:
            await self.hot_path.aclose()
        await self.redis.aclose()


HOT_PATH_CALLS_PER_CONNECTION = 8
# How long a drain waits for its cancelled background tasks to end (seconds): a step cancelled in
# the middle of a Redis call ends in milliseconds; the bound only keeps a drain from hanging.
BACKGROUND_STOP_SECONDS = 5.0


def freeze_start_up_heap() -> None:
    """Collect the start-up garbage, then move every object alive (modules, the Envoy types, the
    config, the gateway's parts, ~84,000 objects) to the collector's permanent generation
    (`gc.freeze`): they live as long as the process, and a full collection no longer walks them.
    Each full collection stalled the event loop, and every request in flight, for 28-56 ms;
    frozen, for under 5 ms (docs/results/issue24/README.md "Where the rest goes"). Objects built later, a
    reload's config included, are collected as before; the first config's are freed by reference
    counting once a reload replaces them, though a cycle among them would stay."""
    gc.collect()
    gc.freeze()


def open_hot_path(config: Config) -> PipelinedRedis | None:
    """The client the routing scripts go over (config `redis.hot_path_client`): a PipelinedRedis
    for `config.redis` (its deadline `socket_timeout_seconds`), or None for `redis-py` (they
    share the redis-py client then). Nothing is contacted yet. Raises ConfigError when a password
    variable is unset.

    At most HOT_PATH_CALLS_PER_CONNECTION x `max_connections` calls wait on Redis at once; one
    more is refused at once (429): where redis-py's pool lets a burst wait for a free connection,
    one pipelined connection carries the whole burst, so the cap bounds a stalled Redis's backlog,
    not an ordinary burst of arrivals."""
    if config.redis.hot_path_client == "redis-py":
        return None
    return open_pipelined(config.redis, max_in_flight=HOT_PATH_CALLS_PER_CONNECTION * config.redis.max_connections)


def _health_inputs(config: Config) -> tuple:
    """What the HealthMonitor is built from: a monitor is replaced only when this changes."""
    providers = tuple(
        (p.name, p.kind, p.health_check, p.load, tuple((m, e.upstream_model) for m, e in p.models.items())) for p in config.providers
    )
    return providers, config.degradation, config.redis.key_prefix


async def serve(
    config: Config, config_path: str | None = None, envoy_path: str | None = None, adjust: Callable[[Config], Config] | None = None,
    worker_index: int = 0,
) -> None:
    """Run the ext_proc server until SIGTERM or SIGINT, then drain and return. With `config_path`
    (the file `config` was read from) the routing config is reloaded on SIGHUP and when the file
    changes (extproc.operations.reload), checked against `envoy_path` when given. `adjust`: what
    turned the file's config into `config` (`serve --workers`: worker i's metrics port), applied
    to every reloaded one too. `worker_index`: this worker's index, which picks its port
    (`server.worker_listen`).

    Raises session_secret.SessionSecretError, adaptation.CredentialError, ports.ListenError,
    storage.tls.RedisTlsError."""
    grpc_logs.quiet_peer_gone_errors()
    gateway = Gateway(config, session_secret(config), worker_index)
    await gateway.start()
    try:
        await _serve_started(gateway, config, config_path, envoy_path, adjust)
    except BaseException:
        # A failure after start (say, the metrics port taken) must not leave the gRPC server and
        # background tasks running: the process would never exit.
        if not gateway.draining:
            await asyncio.shield(gateway.drain(delay_seconds=0))
        raise


async def _serve_started(
    gateway: Gateway, config: Config, config_path: str | None, envoy_path: str | None, adjust: Callable[[Config], Config] | None = None,
) -> None:
    """`serve` once the gateway runs: signals, reload, metrics, then the drain on SIGTERM."""
    metrics.CONFIG_LAST_SUCCESS.set(time.time())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    metrics_server = None
    watcher = None
    if config_path is not None:
        reloader = ConfigReloader(gateway, config_path, envoy_path, adjust=adjust)
        loop.add_signal_handler(signal.SIGHUP, reloader.request)
        watcher = asyncio.create_task(reloader.run_forever())
    if config.server.metrics_listen:
        # Reads at most one a second, on this loop; a scrape waits for it in the metrics thread.
        gateway.fleet_reader = FleetStateReader(config, gateway.redis)
        read = on_loop(gateway.fleet_reader, loop, 2 * config.redis.socket_timeout_seconds + 1)
        fleet = CachedFleetState(read)
        metrics_server, _ = exporter.start_metrics_server(config.server.metrics_listen, exporter.metrics_registry(fleet))
        log.info("metrics on http://%s/metrics", config.server.metrics_listen)
    await stop.wait()
    if watcher is not None:
        watcher.cancel()
    await gateway.drain()
    if metrics_server is not None:
        metrics_server.shutdown()
