"""A whole gateway on this machine: Redis, simulated providers, ext_proc servers and Envoys.

`iris-lab up`, the integration tests and the benchmarks all start the gateway through
`LocalGateway`: every process binds 127.0.0.1 on a free port and is stopped by its pid. With
`instances > 1`, several Envoy + ext_proc pairs share one Redis and the same providers, as
several proxy replicas would in production.
"""

from __future__ import annotations

import os
import secrets
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import yaml

from extproc.config import Config, IdentitySource, Provider, envoy_check, envoy_render, parse_config
from extproc.config.endpoints import dns_name
from extproc.config.examples import example_config
from irislab import envoy_config
from irislab.processes import (
    ManagedProcess,
    ProcessError,
    StartedTogether,
    envoy_binary,
    free_port,
    free_port_range,
    spawn,
    start_redis,
    wait_for_port,
)

EXAMPLE_CONFIG = example_config()


class GatewayConfigError(ProcessError):
    """The routing config and the Envoy file disagree (extproc.config.envoy_check): nothing was started."""


@dataclass
class ProviderSimulation:
    """How to simulate one provider: delays in milliseconds (`prefill_ms_per_token`: per prompt
    token missing from the prefix cache), prefix-cache size in blocks, and its capacity:
    `max_num_seqs` generations at once, the others wait (0: no limit), each token slower by
    `decode_ms_per_running_seq` for every other generation running (see irislab.simulator).

    By default the simulator behaves as the routing config says the provider does: it serves
    only the provider's model names (`upstream_model` where set) and, for a provider with
    `credentials`, demands that key (an unset key variable gets a random key for the run).
    `served_models` / `api_key_env` override that. With `tls_cert` and `tls_key` (PEM files) it
    serves HTTPS. `gzip`: it compresses its answers when the request accepts it, as public APIs
    do."""

    ttft_ms: float = 20
    per_token_ms: float = 2
    prefill_ms_per_token: float = 0
    block_tokens: int = 512
    cache_blocks: int = 4096
    max_num_seqs: int = 0
    decode_ms_per_running_seq: float = 0
    api_key_env: str | None = None
    served_models: list[str] | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    gzip: bool = False


def simulator_argv(name: str, port: int, sim: ProviderSimulation) -> list[str]:
    """The command that runs simulated provider `name` on 127.0.0.1:`port` with `sim`'s timing,
    cache and capacity (credentials, served models and TLS are added by the caller)."""
    return [
        sys.executable, "-m", "irislab.simulator", "--name", name, "--port", str(port),
        "--ttft-ms", str(sim.ttft_ms), "--per-token-ms", str(sim.per_token_ms),
        "--prefill-ms-per-token", str(sim.prefill_ms_per_token),
        "--block-tokens", str(sim.block_tokens), "--cache-blocks", str(sim.cache_blocks),
        "--max-num-seqs", str(sim.max_num_seqs), "--decode-ms-per-running-seq", str(sim.decode_ms_per_running_seq),
    ]


@dataclass
class Instance:
    """One proxy replica: an Envoy (its bootstrap at `envoy_path`) and its ext_proc servers
    (`extprocs`, the endpoints of its `extproc` cluster; `extproc` is the first, `config_path`
    and `metrics_port` are its own)."""

    index: int
    envoy: ManagedProcess
    extproc: ManagedProcess
    listener_port: int
    admin_port: int
    config_path: Path
    metrics_port: int
    envoy_path: Path
    extprocs: list[ManagedProcess] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listener_port}"

    @property
    def metrics_url(self) -> str:
        """The ext_proc server's Prometheus endpoint."""
        return f"http://127.0.0.1:{self.metrics_port}/metrics"


@dataclass
class LocalGateway(StartedTogether):
    """Starts and stops a local gateway. Use as a context manager or call start()/stop().

    `config_data`: routing configuration as a dict (default: envoy/example-config.yaml); its
    redis URL, listen address and metrics address are overwritten (each instance gets free ports;
    `Instance.metrics_url` is its Prometheus endpoint). `simulations`: per provider name, else
    `default_simulation`.
    `env`: extra environment for the ext_proc servers (for example provider API keys).
    `extproc_servers`: ext_proc servers behind each Envoy (the endpoints of its `extproc`
    cluster, health-checked by Envoy), sharing the instance's Redis and providers. `workers`:
    each server's `server.workers` (None: the config's), worker i on its first port + i, every
    port an endpoint of the `extproc` cluster (use it, not `--workers` in `extproc_args`).
    `replicas`: per provider name, how many simulators make its pool (default 1): each replica is
    an endpoint of the provider's cluster (and of its `sessionless_cluster`), named
    `<provider>-r<i>` in `x-simulator-name`. `engines`: per provider name, the base URLs of
    servers already running on 127.0.0.1 (real engines: llama-server) that make its pool instead
    of simulators; the config's health-check and load URLs of such a provider are kept as given.
    A simulated provider with affinity `pick` gets its simulators as `endpoints` (whatever the
    config lists) and the rendered bootstrap (its override_host cluster).
    `real_providers`: every provider with `endpoints` in the config is reached there, through
    the bootstrap `iris-extproc envoy-config` renders (extproc.config.envoy_render), and gets no
    simulator; the others are simulated as usual."""

    config_data: dict[str, Any] | None = None
    instances: int = 1
    extproc_servers: int = 1
    simulations: dict[str, ProviderSimulation] = field(default_factory=dict)
    default_simulation: ProviderSimulation = field(default_factory=ProviderSimulation)
    work_dir: Path | None = None
    redis_url: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    envoy_source: Path = envoy_config.DEFAULT_ENVOY_YAML
    extproc_args: list[str] = field(default_factory=list)  # more `iris-extproc serve` options, e.g. --event-loop asyncio
    workers: int | None = None
    envoy_concurrency: int = 1  # Envoy worker threads: each opens its own ext_proc connection
    replicas: dict[str, int] = field(default_factory=dict)
    engines: dict[str, list[str]] = field(default_factory=dict)
    real_providers: bool = False

    def __post_init__(self):
        self.work_dir = Path(self.work_dir or tempfile.mkdtemp(prefix="iris-gateway-"))
        self.secret = secrets.token_hex(32)  # a strong session secret: serve refuses a weak one
        self.redis: ManagedProcess | None = None
        self.providers: dict[str, ManagedProcess] = {}  # each simulated provider's first replica
        self.pools: dict[str, list[ManagedProcess]] = {}  # every replica of each simulated provider
        self.running: list[Instance] = []
        self.config: Config | None = None
        self.started: list[ManagedProcess] = []  # every process started, in order, for stop()

    @property
    def url(self) -> str:
        """The first instance's client URL."""
        return self.running[0].url

    def provider_url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.providers[name].port}"

    @property
    def _picks(self) -> bool:
        """Whether a provider has affinity pick: Envoy's cluster must then be the rendered one
        (override_host over the simulated replicas, extproc.config.envoy_render.render_pick), and
        the provider's `endpoints` in the config become its simulators' URLs."""
        return any(p.picks for p in self.config.providers)

    def replica_urls(self, name: str) -> list[str]:
        """The base URL of each replica of simulated provider `name`; for a provider whose
        configured `endpoints` are one DNS name (a headless Service: extproc.config.endpoints.
        dns_name), that name on each replica's port (a name such as `localhost` that resolves
        to the simulators' 127.0.0.1; one replica: a name has one port)."""
        configured = next((p.endpoints for p in self.config.providers if p.name == name), [])
        named = dns_name(configured)
        host = named[0] if named is not None else "127.0.0.1"
        return [f"http://{host}:{process.port}" for process in self.pools[name]]

    def start(self) -> None:
        """Start Redis (unless `redis_url` was given, or the config names a Redis Cluster or
        Sentinel: those are used as they are), the providers, then each instance.

        Raises GatewayConfigError before starting anything when the routing config and the Envoy
        file disagree (ports aside: they are all moved here), config.ConfigError for a bad
        routing config, ProcessError when a process does not start (call stop() to stop the
        others; the context manager does)."""
        if "--workers" in self.extproc_args:
            raise ValueError("LocalGateway(workers=N), not --workers in extproc_args: the Envoy file must list every worker's port")
        data = yaml.safe_load(EXAMPLE_CONFIG.read_text()) if self.config_data is None else self.config_data
        if self.workers is not None:
            data = {**data, "server": {**data.get("server", {}), "workers": self.workers}}
        self.config = parse_config(data)
        if self.real_providers or self._picks:  # the bootstrap is rendered from the config: the template only has to carry it
            try:
                envoy_render.render(self.config, envoy_config.load_envoy_yaml(self.envoy_source))
            except envoy_render.RenderError as exc:
                raise GatewayConfigError(str(exc)) from None
        else:
            template = self._as_configured(envoy_config.load_envoy_yaml(self.envoy_source))
            problems = envoy_check.check(self.config, template, str(self.envoy_source), addresses=False)
            if problems:
                raise GatewayConfigError("; ".join(problems))
        if self.real_providers:
            self.engines = {**{p.name: p.endpoints for p in self.config.providers if p.endpoints}, **self.engines}
        external = self.config.redis.cluster is not None or self.config.redis.sentinel is not None
        if self.redis_url is None and not external:
            self.redis = self._track(start_redis(self.work_dir / "redis"))
            self.redis_url = f"redis://127.0.0.1:{self.redis.port}/0"
        for provider in self.config.providers:
            if provider.name in self.engines:
                continue
            count = self.replicas.get(provider.name, 1)
            pool = [self._start_simulator(provider.name, replica=i if count > 1 else None) for i in range(count)]
            self.pools[provider.name] = pool
            self.providers[provider.name] = pool[0]
        for index in range(self.instances):
            self.running.append(self._start_instance(index, data))
        for pool in self.pools.values():
            for process in pool:
                wait_for_port(process.port, process=process.popen)

    def stop(self) -> None:
        """Stop every process this gateway started, newest first, including those of an
        instance whose start failed half-way."""
        for process in reversed(self.started):
            process.stop()
        self.running.clear()

    def _track(self, process: ManagedProcess) -> ManagedProcess:
        self.started.append(process)
        return process

    def stop_redis(self) -> None:
        """Stop the gateway's Redis (an outage). Its state is gone: it runs without persistence."""
        self.redis.stop()

    def start_redis_again(self) -> None:
        """Start a new, empty Redis on the same port (a restart without persistence)."""
        self.redis = self._track(start_redis(self.work_dir / "redis", port=self.redis.port))

    def extproc_env(self) -> dict[str, str]:
        return {**os.environ, "IRIS_SESSION_SECRET": self.secret, **self.env}

    def restart_provider(self, name: str) -> None:
        """Start simulated provider `name` again on its port (after a `kill()`, as a crashed
        provider coming back); returns once it accepts connections."""
        old = self.providers[name]
        old.stop()
        process = self._start_simulator(name, port=old.port)
        self.providers[name] = self.pools[name][0] = process
        wait_for_port(process.port, process=process.popen)

    def _start_simulator(self, name: str, port: int | None = None, replica: int | None = None) -> ManagedProcess:
        sim = self.simulations.get(name, self.default_simulation)
        port = port or free_port()
        argv = simulator_argv(name if replica is None else f"{name}-r{replica}", port, sim)
        provider = self.config.provider(name)
        served = sim.served_models
        if served is None:
            served = [entry.upstream_model or model for model, entry in provider.models.items()]
        if served:
            argv += ["--model", *served]
        env = self.extproc_env()
        key_env = sim.api_key_env or self._simulated_key_env(provider, env)
        if key_env:
            argv += ["--api-key-env", key_env]
        if sim.tls_cert is not None:
            argv += ["--tls-cert", str(sim.tls_cert), "--tls-key", str(sim.tls_key)]
        if sim.gzip:
            argv.append("--gzip")
        label = name if replica is None else f"{name}-r{replica}"
        process = self._track(spawn(f"provider-{label}", argv, self.work_dir, env=env))
        process.port = port
        return process

    def _simulated_key_env(self, provider: Provider, env: dict[str, str]) -> str | None:
        """The variable holding the key the simulator of `provider` demands (its credentials'
        variable, given a random key when unset; a key file's content under a private name)."""
        credentials = provider.credentials
        if credentials is None:
            return None
        if credentials.api_key_env is not None:
            if not env.get(credentials.api_key_env):
                self.env[credentials.api_key_env] = env[credentials.api_key_env] = secrets.token_urlsafe(24)
            return credentials.api_key_env
        private = f"IRIS_SIMULATED_KEY_{provider.name.upper().replace('-', '_').replace('.', '_')}"
        env[private] = Path(credentials.api_key_file).read_text().strip()
        return private

    def _checks_on_simulators(self, data: dict[str, Any], client: str) -> list[dict[str, Any]]:
        """The providers of `data` with their health-check and load URLs sent to the simulators;
        a health check says which ext_proc server it comes from (`?client=<client>`)."""
        providers = []
        for entry in data["providers"]:
            entry = dict(entry)
            if entry["name"] in self.engines:
                providers.append(entry)
                continue
            if self.config.provider(entry["name"]).picks:  # the router picks among the simulated replicas themselves
                entry["endpoints"] = self.replica_urls(entry["name"])
            port = self.providers[entry["name"]].port
            for name in ("health_check", "load"):
                if entry.get(name):
                    url = urlsplit(entry[name]["url"])._replace(netloc=f"127.0.0.1:{port}")
                    if name == "health_check":
                        url = url._replace(query=f"client={client}")
                    entry[name] = {**entry[name], "url": urlunsplit(url)}
            providers.append(entry)
        return providers

    def _extproc_config(self, name: str, data: dict[str, Any]) -> tuple[Path, int, int]:
        """The routing config of ext_proc server `name` (its health checks say so:
        `?client=<name>`) on free gRPC and metrics ports: (its path, its first grpc port, metrics
        port); its workers take the first grpc port and the next `server.workers` - 1."""
        grpc_port = free_port_range(self.config.server.workers)
        metrics_port = free_port()  # one metrics port, whatever `server.workers` says
        config = dict(data)
        config["redis"] = {**data.get("redis", {})}
        if self.redis_url is not None:
            config["redis"]["url"] = self.redis_url
        config["server"] = {**data.get("server", {}), "listen": f"127.0.0.1:{grpc_port}", "metrics_listen": f"127.0.0.1:{metrics_port}"}
        config["providers"] = self._checks_on_simulators(data, name)
        config_path = self.work_dir / f"routing-{name.removeprefix('extproc-')}.yaml"
        config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        return config_path, grpc_port, metrics_port

    def _start_instance(self, index: int, data: dict[str, Any]) -> Instance:
        listener_port, admin_port = free_port(), free_port()
        names = [f"extproc-{index}"] + [f"extproc-{index}-{k}" for k in range(1, self.extproc_servers)]
        configs = [self._extproc_config(name, data) for name in names]
        workers = self.config.server.workers
        cluster_ports: dict[str, int | list[int]] = {"extproc": [port + i for _, port, _ in configs for i in range(workers)]}
        for provider in self.config.providers:
            if provider.name in self.engines:
                ports = [urlsplit(url).port for url in self.engines[provider.name]]
            else:
                ports = [process.port for process in self.pools[provider.name]]
            for cluster in filter(None, (provider.cluster, provider.sessionless_cluster)):
                cluster_ports[cluster] = ports if len(ports) > 1 else ports[0]
        if self.real_providers or self._picks:
            bootstrap = self._rendered_bootstrap(listener_port, admin_port, cluster_ports)
        else:
            bootstrap = envoy_config.render(listener_port, admin_port, cluster_ports, source=self.envoy_source)
        bootstrap = self._as_configured(bootstrap)
        envoy_path = envoy_config.write(bootstrap, self.work_dir / f"envoy-{index}.yaml")
        extprocs = []
        for name, (config_path, grpc_port, metrics_port) in zip(names, configs):
            # `serve --envoy` checks the pair again, addresses included, as a deployment would.
            extproc = self._track(spawn(
                name,
                [sys.executable, "-m", "extproc.cli", "serve", "--config", str(config_path), "--envoy", str(envoy_path), *self.extproc_args],
                self.work_dir,
                env=self.extproc_env(),
            ))
            extproc.port = grpc_port
            extproc.extra["metrics_port"] = metrics_port
            extproc.extra["ports"] = [grpc_port + i for i in range(workers)]
            extprocs.append(extproc)
        for extproc in extprocs:
            for port in extproc.extra["ports"]:
                _wait_until_up(extproc, port)
            _wait_until_up(extproc, extproc.extra["metrics_port"])
        envoy = self._track(spawn(
            f"envoy-{index}",
            [envoy_binary(), "-c", str(envoy_path), "-l", "warning", "--concurrency", str(self.envoy_concurrency), "--disable-hot-restart",
             "--file-flush-interval-msec", "200"],  # the access log within 0.2 s, not Envoy's default 10 s
            self.work_dir,
        ))
        envoy.port = listener_port
        _wait_until_up(envoy)
        config_path, _, metrics_port = configs[0]
        return Instance(index, envoy, extprocs[0], listener_port, admin_port, config_path, metrics_port, envoy_path, extprocs)

    def _as_configured(self, bootstrap: dict[str, Any]) -> dict[str, Any]:
        """`bootstrap` (modified in place) as this gateway's config needs it: when its ext_proc
        filter forwards only some headers (`forward_rules`, as envoy/envoy.yaml does), the ones
        this config reads, as `iris-extproc envoy-config` renders them
        (envoy_render.forward_read_headers); then the stand-in authentication."""
        if any(
            "forward_rules" in (f.get("typed_config") or {})
            for manager in envoy_check.connection_managers(bootstrap) for f in manager.get("http_filters") or []
            if f.get("name") == envoy_check.EXT_PROC_FILTER
        ):
            envoy_render.forward_read_headers(bootstrap, self.config)
        return self._with_stand_in_authentication(bootstrap)

    def _with_stand_in_authentication(self, bootstrap: dict[str, Any]) -> dict[str, Any]:
        """`bootstrap` with the lab's stand-in for an authenticating filter for each trusted
        identity header of the config that the Envoy file does not strip itself
        (envoy_config.with_stand_in_authentication): the tests' clients claim their identity in
        that header, as a verified token's claim would set it."""
        session = self.config.session
        if IdentitySource.TRUSTED_HEADER not in session.identity_sources:
            return bootstrap
        headers = envoy_config.unstripped_identity_headers(bootstrap, session.trusted_identity_headers)
        return envoy_config.with_stand_in_authentication(bootstrap, headers) if headers else bootstrap

    def _rendered_bootstrap(self, listener_port: int, admin_port: int, cluster_ports: dict[str, int | list[int]]) -> dict[str, Any]:
        """The bootstrap `iris-extproc envoy-config` renders from the config, the simulated
        providers' endpoints being their simulators, on this instance's ports. Each provider
        keeps the affinity the config gives it (endpoints added here must not make a provider
        without them pick: the ext_proc server's config does not)."""
        endpoints = dict(self.engines)
        for name in self.pools:
            endpoints[name] = self.replica_urls(name)
        providers = [p.model_copy(update={"endpoints": endpoints.get(p.name, p.endpoints), "affinity": p.session_affinity})
                     for p in self.config.providers]
        config = self.config.model_copy(update={"providers": providers})
        bootstrap = envoy_render.render(config, envoy_config.load_envoy_yaml(self.envoy_source))
        return envoy_config.render_onto(bootstrap, listener_port, admin_port, {"extproc": cluster_ports["extproc"]})


def _wait_until_up(process: ManagedProcess, port: int | None = None) -> None:
    """Wait for `process` to listen on `port` (default: its port). Raises ProcessError naming it,
    with the last line of its log (for `iris-extproc serve`: its one-line error)."""
    try:
        wait_for_port(port or process.port, process=process.popen)
    except ProcessError as exc:
        lines = process.log_tail(2000).strip().splitlines()
        raise ProcessError(f"{process.name} did not start ({exc}): {lines[-1] if lines else 'no output'}") from None
