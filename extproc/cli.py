"""The `iris-extproc` command.

    iris-extproc serve --config PATH              run the ext_proc server
    iris-extproc drain PROVIDER [--model M] [--wait]  mark a provider degraded by hand (and wait for
                                                  its running requests to end)
    iris-extproc undrain PROVIDER [--model M]     clear that mark (automatic flags stay)
    iris-extproc status [--json] [--redis-url U]  per pair: in-flight/limit, pins/limit, state and
                                                  why; live instances; the outage policy
    iris-extproc check --config F [--envoy F] [--envoy-admin URL]
                                                  does the routing config agree with the Envoy file,
                                                  and does the running Envoy meet the minimum?
    iris-extproc envoy-config --config F          the Envoy file rendered from the routing config

Global options go before or after the command (`--log-level`). The environment gives defaults
(pydantic-settings): IRIS_CONFIG for --config, IRIS_REDIS_URL for --redis-url, IRIS_LOG_LEVEL for
--log-level; a flag given on the command line wins. A whole local gateway for trying it (Redis,
Envoy, simulated providers) is the lab's command, `iris-lab up` (irislab.cli), not this one.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from extproc.config import Config, ConfigError, ProviderKind, RedisSettings, envoy_check, load_config
from extproc.config.envoy_check import EnvoyConfigError
from extproc.config.examples import envoy_yaml
from extproc.config.schema import MAX_WORKERS
from extproc.operations import logs
from extproc.routing.degraded import DEFAULT_MANUAL_TTL_SECONDS, MANUAL, DegradedFlags
from extproc.storage.client import REDIS_FAILURES, open_redis

log = logging.getLogger("iris-extproc")

LOG_LEVELS = ("debug", "info", "warning", "error")
REDIS_URL_SCHEMES = ("redis://", "rediss://")
DRAIN_WAIT_POLL_SECONDS = 0.5
DRAIN_WAIT_PROGRESS_SECONDS = 5.0  # a progress line at least this often (seconds), and at every change
DEFAULT_DRAIN_WAIT_TIMEOUT_SECONDS = 300.0
OUTAGE_POLICIES = {
    "degrade": "only pairs without an in-flight limit (third parties) take new requests; managed pairs take none",
    "local_share": "each instance also takes its share of every managed pair's unreserved slots (divided by the live instances)",
    "fail_closed": "new requests get 503 routing_unavailable",
}


class EnvironmentDefaults(BaseSettings):
    """The defaults the environment gives the CLI's options, read by pydantic-settings:
    IRIS_CONFIG (--config, a path), IRIS_REDIS_URL (--redis-url, redis:// or rediss://) and
    IRIS_LOG_LEVEL (--log-level: debug, info, warning, error; any case), IRIS_LOG_FORMAT
    (--log-format: text, json; any case). A flag given on the command line wins. Raises
    pydantic.ValidationError for a value that cannot be one."""

    model_config = SettingsConfigDict(extra="ignore", populate_by_name=True)

    config: str | None = Field(default=None, validation_alias="IRIS_CONFIG")
    redis_url: str | None = Field(default=None, validation_alias="IRIS_REDIS_URL", pattern=r"^rediss?://")
    log_level: Literal["debug", "info", "warning", "error"] = Field(default="info", validation_alias="IRIS_LOG_LEVEL")
    log_format: Literal["text", "json"] = Field(default="text", validation_alias="IRIS_LOG_FORMAT")

    @field_validator("log_level", "log_format", mode="before")
    @classmethod
    def _any_case(cls, value):
        return value.lower() if isinstance(value, str) else value


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's help, with `(default: X)` after every option that has a default (not after
    required options, flags that are off, or help that states its default itself). Lines wrap
    between words only: a path, a URL or a hyphenated name (a default such as the config file's
    path) stays whole on one line, so it can be copied from the help as it is."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_long_words=False, break_on_hyphens=False)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or "default:" in text or not action.option_strings:
            return text
        if action.default in (None, False, argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


def package_version() -> str:
    """This package's version from its installed metadata (pyproject.toml's), or `unknown`."""
    try:
        return version("iris-extproc")
    except PackageNotFoundError:
        return "unknown"


def add_global_options(parser: argparse.ArgumentParser, defaults: EnvironmentDefaults, top_level: bool) -> None:
    """The options every command takes, before or after the subcommand (`iris-extproc --log-level
    debug status` and `iris-extproc status --log-level debug` alike; given after it, a value wins
    over one before it). Called for the top-level parser and for each subcommand's: an option
    added here once works in both places."""
    parser.add_argument(
        "--log-level", type=str.lower, choices=LOG_LEVELS, default=defaults.log_level if top_level else argparse.SUPPRESS,
        help=f"how much this command logs (default: {defaults.log_level}; environment: IRIS_LOG_LEVEL)",
    )
    parser.add_argument(
        "--log-format", type=logs.log_format, default=defaults.log_format if top_level else argparse.SUPPRESS, metavar="{text,json}",
        help=f"one line of text or one JSON object per record (default: {defaults.log_format}; environment: {logs.FORMAT_ENV})",
    )


def new_parser(prog: str, description: str, defaults: EnvironmentDefaults) -> tuple[argparse.ArgumentParser, Callable[..., argparse.ArgumentParser]]:
    """A top-level parser with `--version` and the global options, and a function
    `command(name, help)` that adds a subcommand carrying the global options too."""
    parser = argparse.ArgumentParser(prog=prog, description=description, formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}", help="print the version and exit")
    add_global_options(parser, defaults, top_level=True)
    commands = parser.add_subparsers(required=True, dest="command", metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help, description=help, formatter_class=HelpFormatter)
        add_global_options(sub, defaults, top_level=False)
        return sub

    return parser, command


def environment_defaults(prog: str) -> EnvironmentDefaults | None:
    """The environment's defaults, or None after printing one line per bad variable."""
    try:
        return EnvironmentDefaults()
    except ValidationError as exc:
        for error in exc.errors():
            print(f"{prog}: {error['loc'][0]}: {error['msg']}", file=sys.stderr)
        return None


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code: 1 when `check` finds a problem, `status`, `drain` or
    `undrain` cannot reach Redis, or `drain --wait` times out; 2 for a configuration or Envoy file
    that is missing, unreadable, invalid or in disagreement at start, a bad session secret at
    start, or a bad environment variable. Such errors are printed without a traceback (a bad
    routing config: one line per problem)."""
    defaults = environment_defaults("iris-extproc")
    if defaults is None:
        return 2
    args = _parser(defaults).parse_args(argv)
    logs.configure(args.log_level, args.log_format, worker=getattr(args, "worker_index", None))
    return run_command("iris-extproc", args.func, args)


def run_command(prog: str, func: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """`func(args)`'s exit code; a routing config or Envoy file that cannot be used is printed
    without a traceback (a bad routing config: one line per problem, others prefixed by `prog`)
    and gives 2. A reader of standard output that went away (`| head`) ends the command quietly
    with 1 (the recipe of Python's `signal` documentation: "Note on SIGPIPE")."""
    try:
        code = func(args)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the flush at exit fails no more
        return 1
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    except EnvoyConfigError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        if exc.filename is None:
            raise
        print(f"{prog}: cannot read {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2


class PairDisagrees(Exception):
    """The routing config and the Envoy file disagree; `problems` holds one sentence each."""

    def __init__(self, config_path: str, envoy_path: str, problems: list[str]):
        self.problems = problems
        super().__init__(f"{config_path} and {envoy_path} disagree:\n  " + "\n  ".join(problems))


def check_pair(config: Config, config_path: str, envoy_path: str) -> None:
    """Run envoy_check on the pair. Raises PairDisagrees, EnvoyConfigError."""
    problems = envoy_check.check_files(config, envoy_path)
    if problems:
        raise PairDisagrees(config_path, envoy_path, problems)


def _redis_url(value: str) -> str:
    if not value.startswith(REDIS_URL_SCHEMES):
        raise argparse.ArgumentTypeError(f"{value!r} is not a redis:// or rediss:// URL")
    return value


def _add_config(cmd: argparse.ArgumentParser, defaults: EnvironmentDefaults, required: bool = True, what: str = "the routing config") -> None:
    cmd.add_argument("--config", metavar="PATH", required=required and defaults.config is None, default=defaults.config,
                     help=f"{what} (YAML; environment: IRIS_CONFIG)")


def _add_redis_url(cmd: argparse.ArgumentParser, defaults: EnvironmentDefaults) -> None:
    cmd.add_argument("--redis-url", metavar="URL", type=_redis_url, default=defaults.redis_url,
                     help="the Redis to use instead of the routing config's url, cluster or sentinel (its key prefix, "
                          "auth and TLS stay; environment: IRIS_REDIS_URL)")


def _parser(defaults: EnvironmentDefaults | None = None) -> argparse.ArgumentParser:
    defaults = defaults or EnvironmentDefaults()
    parser, command = new_parser("iris-extproc", "Envoy ext_proc routing brain for an LLM gateway: admission, session pinning "
                                 "and leases in Redis.", defaults)

    serve = command("serve", "run the ext_proc gRPC server (needs the session secret, IRIS_SESSION_SECRET by default)")
    _add_config(serve, defaults)
    serve.add_argument("--envoy", metavar="PATH", help="the Envoy file this server runs behind: checked at start and at every reload")
    serve.add_argument("--event-loop", choices=["uvloop", "asyncio"], default="uvloop", help="the asyncio event loop")
    serve.add_argument("--workers", type=int, help="worker processes, worker i on server.listen's port + i (default: server.workers)")
    serve.add_argument("--worker-index", type=int, default=None, help=argparse.SUPPRESS)
    serve.set_defaults(func=_serve)

    check = command("check", "check that a routing config and an Envoy file agree, that a running Envoy meets the minimum "
                             "version, and that the session secret (when set here) is strong")
    _add_config(check, defaults)
    check.add_argument("--envoy", metavar="PATH", help="the Envoy file to check the routing config against")
    check.add_argument("--envoy-admin", metavar="URL", help="a running Envoy's admin address (http://host:port): its version "
                       "(GET /server_info) must be at least the minimum")
    check.set_defaults(func=_check)

    render = command("envoy-config", "render the Envoy bootstrap from a routing config (providers' endpoints)")
    _add_config(render, defaults)
    render.add_argument("--template", metavar="PATH", help="the bootstrap to start from (default: the shipped envoy/envoy.yaml)")
    render.add_argument("--output", metavar="PATH", help="write it here (default: standard output)")
    render.set_defaults(func=_envoy_config)

    for name, helptext in (("drain", "mark a provider degraded by hand: new traffic avoids it, pinned sessions move on"),
                           ("undrain", "clear an operator's drain (automatic flags stay)")):
        cmd = command(name, helptext)
        cmd.add_argument("provider", help="the provider's name in the routing config")
        cmd.add_argument("--model", help="only this model (default: every model of the provider)")
        cmd.add_argument("--endpoint", metavar="IP:PORT",
                         help="only this endpoint of a provider with affinity pick: placement avoids it and its "
                              "sessions move to the others at their next turn; the rest of the pool keeps serving")
        _add_config(cmd, defaults)
        _add_redis_url(cmd, defaults)
        if name == "drain":
            cmd.add_argument("--ttl-seconds", type=float, default=DEFAULT_MANUAL_TTL_SECONDS, help="how long the drain lasts, seconds")
            cmd.add_argument("--reason", default="drained by an operator", help="why, shown by status")
            cmd.add_argument("--wait", action="store_true", help="then wait until no request runs on the drained pairs "
                             "(fleet-wide), printing progress; exit code 1 if some still run after --wait-timeout")
            cmd.add_argument("--wait-timeout", type=float, default=DEFAULT_DRAIN_WAIT_TIMEOUT_SECONDS, metavar="SECONDS",
                             help="with --wait: give up after this long, seconds (the drain stays)")
        cmd.set_defaults(func=_drain if name == "drain" else _undrain)

    status = command("status", "per provider and model: in-flight requests and pins against the limits, state and why; "
                               "live instances; the outage policy")
    _add_config(status, defaults, required=False,
                what="the routing config; without it, or when it cannot be used, the pairs the live instances run are shown")
    _add_redis_url(status, defaults)
    status.add_argument("--key-prefix", metavar="PREFIX", help="the routing state's key prefix (redis.key_prefix) when no "
                        "usable routing config says it (default: the config's, else iris)")
    status.add_argument("--json", action="store_true", help="print the fleet state as one JSON document")
    status.set_defaults(func=_status)
    return parser


def _serve(args) -> int:
    from functools import partial

    from extproc.openai_api.adaptation import CredentialError
    from extproc.operations.gateway import serve
    from extproc.operations.ports import ListenError
    from extproc.operations.session_secret import SessionSecretError, session_secret
    from extproc.operations.workers import clear_stale_metrics, supervise, worker_command, worker_config
    from extproc.protocol.tracing import TracingUnavailable, otlp_span_exporter
    from extproc.storage.tls import RedisTlsError

    config = load_config(args.config)
    if args.workers is not None and not 1 <= args.workers <= MAX_WORKERS:
        print(f"iris-extproc: --workers must be from 1 to {MAX_WORKERS}", file=sys.stderr)
        return 2
    # Worker i's own settings (the workers' count, its metrics port), at start and on every reload alike.
    adjust = partial(worker_config, index=args.worker_index or 0, workers=args.workers)
    config = adjust(config)
    workers = config.server.workers
    try:  # refused before anything starts, workers included
        if args.envoy:
            check_pair(config, args.config, args.envoy)
        session_secret(config)
        if config.tracing.otlp_endpoint is not None:
            otlp_span_exporter()
        if workers > 1 and args.worker_index is None:
            command = worker_command(args.config, args.event_loop, args.log_level, workers, args.envoy, args.log_format)
            return supervise(command, [config.server.worker_listen(i) for i in range(workers)])
        if args.worker_index is None:  # a server alone: multiprocess metric files an earlier run left are not its own
            clear_stale_metrics()
        run_event_loop(serve(config, config_path=args.config, envoy_path=args.envoy, adjust=adjust, worker_index=args.worker_index or 0),
                       args.event_loop)
    except (SessionSecretError, CredentialError, PairDisagrees, ListenError, TracingUnavailable, RedisTlsError) as exc:
        print(f"iris-extproc: {exc}", file=sys.stderr)
        return 2
    return 0


def _envoy_config(args) -> int:
    """Render the bootstrap, check it against the config, print or write it. Exit code 2 when
    the template cannot carry the config, 1 when the result disagrees with it (a bug)."""
    import yaml

    from extproc.config.envoy_render import RenderError, render

    config = load_config(args.config)
    template = envoy_check.load_bootstrap(args.template or envoy_yaml())
    try:
        bootstrap = render(config, template)
    except RenderError as exc:
        print(f"iris-extproc: {exc}", file=sys.stderr)
        return 2
    problems = envoy_check.check(config, bootstrap, "the rendered bootstrap")
    if problems:
        print("iris-extproc: the rendered bootstrap disagrees with the config:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    text = f"# Rendered by `iris-extproc envoy-config --config {args.config}`: edit the routing config, not this file.\n"
    text += yaml.safe_dump(bootstrap, sort_keys=False)
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def _check(args) -> int:
    """Print whether the pair agrees, whether the running Envoy (`--envoy-admin`) is recent
    enough and whether the session secret, when set in this environment, is strong; exit code 1
    at the first of those that fails (each is still reported), 2 when the admin cannot be read."""
    from extproc.operations.session_secret import SessionSecretError, session_secret

    if args.envoy is None and args.envoy_admin is None:
        print("iris-extproc: check needs --envoy (the Envoy file), --envoy-admin (a running Envoy) or both", file=sys.stderr)
        return 2
    config = load_config(args.config)
    failed = False
    if args.envoy is not None:
        try:
            check_pair(config, args.config, args.envoy)
            print(f"ok: {args.config} and {args.envoy} agree ({len(config.providers)} providers, "
                  f"routing header {config.server.routing_header}, ext_proc on {config.server.listen})")
        except PairDisagrees as exc:
            print(exc)
            failed = True
    if args.envoy_admin is not None:
        outcome = _check_envoy_version(args.envoy_admin)
        if outcome is None:
            return 2
        failed |= not outcome
    name = config.session.secret_env
    if not os.environ.get(name):
        print(f"note: {name} (session.secret_env) is not set here; serve needs it", file=sys.stderr)
        return 1 if failed else 0
    try:
        session_secret(config)
        print(f"ok: {name} is set and strong enough")
    except SessionSecretError as exc:
        print(exc)
        failed = True
    return 1 if failed else 0


def _check_envoy_version(admin: str) -> bool | None:
    """Read `admin`/server_info and print whether that Envoy meets the minimum: True, False, or
    None (after a one-line error) when it cannot be read."""
    import json
    import urllib.error
    import urllib.request

    from extproc.config.envoy_version import (
        MINIMUM_ENVOY,
        EnvoyVersionError,
        format_version,
        version_from_server_info,
        version_problem,
    )

    url = admin.rstrip("/") + "/server_info"
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            running = version_from_server_info(json.load(answer))
    except (urllib.error.URLError, OSError, ValueError, EnvoyVersionError) as exc:
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        print(f"iris-extproc: cannot read the Envoy version from {url}: {reason}", file=sys.stderr)
        return None
    problem = version_problem(running)
    if problem is not None:
        print(f"{admin}: {problem}")
        return False
    print(f"ok: Envoy {format_version(running)} at {admin} (at least {format_version(MINIMUM_ENVOY)})")
    return True


def run_event_loop(main, event_loop: str) -> None:
    """Run `main` on uvloop (faster per message for grpc.aio: about 10 % less CPU per request
    here, bench/overhead.py) or on the standard asyncio loop."""
    if event_loop == "uvloop":
        import uvloop

        uvloop.run(main)
    else:
        asyncio.run(main)


def redis_settings(settings: RedisSettings, redis_url: str | None) -> RedisSettings:
    """`settings` with `redis_url` (a standalone redis:// or rediss:// URL) in place of its url,
    cluster or sentinel; its key prefix, auth, TLS and timeouts stay. `settings` when no URL."""
    if redis_url is None:
        return settings
    kept = settings.model_dump(exclude_unset=True, exclude={"url", "cluster", "sentinel"})
    return RedisSettings.model_validate({**kept, "url": redis_url})


def _pairs(flags: DegradedFlags, config: Config, provider: str, model: str | None) -> list[tuple[str, str]]:
    try:
        config.provider(provider)
    except KeyError:
        raise SystemExit(f"iris-extproc: no provider named {provider!r} in the configuration") from None
    pairs = flags.pairs(provider, model)
    if not pairs:
        served = config.provider(provider)
        if served.kind is ProviderKind.MANAGED:
            raise SystemExit(f"iris-extproc: {provider} serves no model {model!r} (it serves: {', '.join(served.models)})")
        raise SystemExit(f"iris-extproc: {provider} has no managed model{f' {model}' if model else ''}: unlimited providers are never degraded")
    return pairs


def _drain(args) -> int:
    return _set_manual_flags(args, drain=True)


def _undrain(args) -> int:
    return _set_manual_flags(args, drain=False)


def _set_manual_flags(args, drain: bool) -> int:
    """With `--endpoint`, `_set_endpoint_flags`. Otherwise set (drain) or clear (undrain) the
    operator's degraded flag of each pair named; with
    `--wait`, then wait for the pairs' running requests to end (`_wait_for_no_requests`). An
    undrain of a pair that was not drained says so and succeeds (idempotent). Exit code 1, with
    one line on stderr, when Redis cannot be reached."""
    config = load_config(args.config)
    settings = redis_settings(config.redis, args.redis_url)
    if args.endpoint is not None:
        return _set_endpoint_flags(args, config, settings, drain)

    async def run() -> int:
        redis = open_redis(settings)
        try:
            flags = DegradedFlags(redis, config)
            pairs = _pairs(flags, config, args.provider, args.model)
            drained_at = time.monotonic()
            for provider, model in pairs:
                if drain:
                    await flags.set(provider, model, f"manual: {args.reason}", args.ttl_seconds, MANUAL)
                    print(f"drained {provider} {model}", flush=True)
                elif await flags.clear(provider, model, MANUAL):
                    print(f"undrained {provider} {model}", flush=True)
                else:
                    print(f"{provider} {model} was not drained", flush=True)
            if drain and args.wait:
                return await _wait_for_no_requests(redis, config, pairs, drained_at, args.wait_timeout)
            return 0
        finally:
            await redis.aclose()

    return _run_against_redis(run, settings)



def _run_against_redis(run, settings) -> int:
    """Run the coroutine function `run` (an operator command against the Redis of `settings`)
    and return its exit code; 1, with one line naming Redis, when Redis cannot be reached."""
    try:
        return asyncio.run(run())
    except REDIS_FAILURES as exc:
        print(f"iris-extproc: cannot reach Redis at {_redis_address(settings)}: {exc}", file=sys.stderr)
        return 1

async def _wait_for_no_requests(redis, config: Config, pairs: list[tuple[str, str]], drained_at: float, timeout_seconds: float) -> int:
    """Poll the fleet state every DRAIN_WAIT_POLL_SECONDS until no request lease is live on any
    of `pairs` (every instance, from Redis), printing the count at every change and at least every
    DRAIN_WAIT_PROGRESS_SECONDS. A zero counts only once `server.degraded_refresh_seconds` has
    passed since the drain (`drained_at`, time.monotonic()): until every instance has refreshed its
    flags, one may still admit a request there. Exit code 0, or 1 after `timeout_seconds`
    (seconds) with requests still running. Raises RedisError."""
    from extproc.operations.fleet_state import FleetStateReader

    reader = FleetStateReader(config, redis)
    wanted = set(pairs)
    settled_at = drained_at + config.server.degraded_refresh_seconds
    last: tuple | None = None
    last_printed = float("-inf")
    while True:
        fleet = await reader.read()
        counts = {(p.provider, p.model): p.in_flight for p in fleet.pairs if (p.provider, p.model) in wanted}
        total = sum(counts.values())
        now = time.monotonic()
        waited = now - drained_at
        if total == 0 and now >= settled_at:
            print(f"no request in flight on {_pair_list(counts)} after {waited:.1f} s", flush=True)
            return 0
        running = ", ".join(f"{provider} {model}: {n}" for (provider, model), n in counts.items() if n)
        if waited >= timeout_seconds:
            print(f"iris-extproc: still {total} requests in flight after {timeout_seconds:g} s ({running}); the drain stays",
                  file=sys.stderr)
            return 1
        key = tuple(sorted(counts.items()))
        if key != last or now - last_printed >= DRAIN_WAIT_PROGRESS_SECONDS:
            print(f"waiting: {total} requests in flight ({running or 'none yet'}), {waited:.1f} s", flush=True)
            last, last_printed = key, now
        await asyncio.sleep(DRAIN_WAIT_POLL_SECONDS)


def _set_endpoint_flags(args, config: Config, settings: RedisSettings, drain: bool) -> int:
    """Set (drain) or clear (undrain) the operator's flag of one endpoint (`--endpoint`,
    `ip:port` as the provider's `endpoints` resolve) on each pair named (extproc.routing.
    endpoint_health; read by the placing scripts, so every proxy's next decision sees it). With
    `--wait`, then wait until no request runs on that endpoint. Exit code 2 (SystemExit) for a
    provider without affinity pick or an endpoint not among its own; 1 when Redis cannot be
    reached or the wait times out."""
    from extproc.config.endpoints import pick_endpoints
    from extproc.routing.endpoint_health import EndpointHealth

    provider = _provider_or_exit(config, args.provider)
    if not provider.picks:
        raise SystemExit(f"iris-extproc: {provider.name} does not have affinity pick: --endpoint names an endpoint the router picks")
    endpoints = pick_endpoints(provider.endpoints)
    if args.endpoint not in endpoints:
        raise SystemExit(f"iris-extproc: {args.endpoint} is not an endpoint of {provider.name} (its endpoints: {', '.join(endpoints)})")

    async def run() -> int:
        redis = open_redis(settings)
        try:
            pairs = _pairs(DegradedFlags(redis, config), config, provider.name, args.model)
            health = EndpointHealth(redis, config.redis.key_prefix)
            drained_at = time.monotonic()
            for name, model in pairs:
                if drain:
                    await health.set(name, model, args.endpoint, f"manual: {args.reason}", args.ttl_seconds, MANUAL)
                    print(f"drained {name} {model} endpoint {args.endpoint}", flush=True)
                elif await health.clear(name, model, args.endpoint, MANUAL):
                    print(f"undrained {name} {model} endpoint {args.endpoint}", flush=True)
                else:
                    print(f"{name} {model} endpoint {args.endpoint} was not drained", flush=True)
            if drain and args.wait:
                return await _wait_for_no_endpoint_requests(redis, health, pairs, args.endpoint, drained_at, args.wait_timeout)
            return 0
        finally:
            await redis.aclose()

    return _run_against_redis(run, settings)


def _provider_or_exit(config: Config, name: str):
    try:
        return config.provider(name)
    except KeyError:
        raise SystemExit(f"iris-extproc: no provider named {name!r} in the configuration") from None


async def _wait_for_no_endpoint_requests(redis, health, pairs: list[tuple[str, str]], endpoint: str, drained_at: float,
                                         timeout_seconds: float) -> int:
    """Poll every DRAIN_WAIT_POLL_SECONDS until no live lease counts on `endpoint` of any of
    `pairs` (the endpoint's lease zsets, against Redis time). No refresh to wait for: the
    scripts read the endpoint's flag in the admission itself. Exit code 0, or 1 after
    `timeout_seconds` (seconds). Raises RedisError."""
    last_printed = float("-inf")
    while True:
        seconds, micros = await redis.time()
        now_ms = int(seconds) * 1000 + int(micros) // 1000
        total = 0
        for provider, model in pairs:
            total += await redis.zcount(health.keys.endpoint_leases(model, provider, endpoint), f"({now_ms}", "+inf")
        waited = time.monotonic() - drained_at
        if total == 0:
            print(f"no request in flight on endpoint {endpoint} after {waited:.1f} s", flush=True)
            return 0
        if waited >= timeout_seconds:
            print(f"iris-extproc: still {total} requests in flight on endpoint {endpoint} after {timeout_seconds:g} s; "
                  "the drain stays", file=sys.stderr)
            return 1
        if time.monotonic() - last_printed >= DRAIN_WAIT_PROGRESS_SECONDS:
            print(f"waiting: {total} requests in flight on endpoint {endpoint}, {waited:.1f} s", flush=True)
            last_printed = time.monotonic()
        await asyncio.sleep(DRAIN_WAIT_POLL_SECONDS)


def _pair_list(counts: dict[tuple[str, str], int]) -> str:
    return ", ".join(f"{provider} {model}" for provider, model in counts)


def _status(args) -> int:
    """One line per (provider, model): live request leases and pins against their limits (`-`:
    no limit), the tickets waiting in its admission queue per class when the queue is on
    (docs/queue.md), the state (`healthy`, `degraded` by automatic flags, or `drained` while an
    operator's flag holds) and why, each flag with its source, reason and the time it still
    holds; then the live proxy instances and the outage policy they run (what routes while Redis
    is gone). Unlimited providers are never degraded.

    The pairs come from the routing config (`--config`); without one, or when it cannot be used
    (its problems go to stderr), from the config the live instances advertise in Redis
    (extproc.operations.fleet_state.instance_description), so `status` works while the file is
    broken. When the file's pairs or limits are not those some live instances run, one stderr
    line says so (the counts stay the fleet's, the limits shown the file's). Redis is
    `--redis-url`, else the file's `redis` (read alone when the rest is
    invalid). Exit code 1, with one line on stderr, when Redis cannot be read; 2 when neither a
    usable file nor --redis-url says where Redis is."""
    from extproc.operations.fleet_state import FleetStateReader, read_running_instances

    file_config, settings = _status_sources(args)
    if settings is None:
        return 2

    async def read():
        redis = open_redis(settings)
        try:
            running = await read_running_instances(redis, settings.key_prefix)
            config = file_config or _most_run(running)
            fleet = await FleetStateReader(config, redis).read() if config is not None else None
            return running, config, fleet
        finally:
            await redis.aclose()

    try:
        running, config, fleet = asyncio.run(read())
    except REDIS_FAILURES as exc:
        print(f"iris-extproc: cannot read the routing state from Redis at {_redis_address(settings)}: {exc}", file=sys.stderr)
        return 1
    if file_config is None:
        _say_where_pairs_come_from(running, config)
        other_limits = []
    else:
        other_limits = _instances_with_other_limits(running, file_config)
        if other_limits:
            _say_the_file_is_not_what_runs(running, file_config, other_limits, args.config)
    policy = _outage_policy(running, file_config, settings)
    if args.json:
        import orjson

        document = fleet.as_dict() if fleet is not None else {"now_ms": None, "live_instances": len(running), "pairs": []}
        document["pairs_from"] = None if config is None else ("routing config" if file_config is not None else "live instances")
        document["instances_running_other_limits"] = len(other_limits)
        document["outage_policy"] = policy
        print(orjson.dumps(document, option=orjson.OPT_INDENT_2).decode())
        return 0
    if fleet is not None:
        queues = any(pair.queued for pair in fleet.pairs)  # the admission queue is on for some model (docs/queue.md)
        queued_head = f"{'queued':<24}" if queues else ""
        print(f"{'provider':<16}{'kind':<11}{'model':<28}{'in-flight':<11}{'pins':<16}{queued_head}{'state':<10}why")
        for pair in fleet.pairs:
            why = "; ".join([*(_flag_text(f) for f in pair.flags), *(_endpoint_flag_text(f) for f in pair.endpoint_flags)])
            if pair.kind == "unlimited":
                why = "unlimited: never degraded"
            in_flight, pins = _of_limit(pair.in_flight, pair.in_flight_limit), _of_limit(pair.pins, pair.pin_limit)
            queued = f"{_queued_text(pair.queued):<24}" if queues else ""
            print(f"{pair.provider:<16}{pair.kind:<11}{pair.model:<28}{in_flight:<11}{pins:<16}{queued}{pair.state:<10}{why}".rstrip())
    print(f"live proxy instances: {fleet.live_instances if fleet is not None else len(running)}")
    print(f"outage policy: {policy['policy']} ({policy['source']}): while Redis is unreachable, {OUTAGE_POLICIES[policy['policy']]}")
    return 0


def _status_sources(args) -> tuple[Config | None, RedisSettings | None]:
    """(the routing config, or None when none is given or it cannot be used; the Redis settings
    to read, or None after an error saying --redis-url is needed). A file that cannot be used
    has its problems printed on stderr; its `redis` section is still used when it is valid."""
    if args.config is None:
        if args.redis_url is None:
            print("iris-extproc: status needs --config or --redis-url (or IRIS_CONFIG, IRIS_REDIS_URL)", file=sys.stderr)
            return None, None
        return None, redis_settings(_with_key_prefix(RedisSettings(), args.key_prefix), args.redis_url)
    try:
        config = load_config(args.config)
        return config, redis_settings(config.redis, args.redis_url)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
    except OSError as exc:
        hint = "" if args.redis_url is None else "; reading the routing state without it"
        print(f"iris-extproc: cannot read {exc.filename}: {exc.strerror}{hint}", file=sys.stderr)
        if args.redis_url is None:
            return None, None
    redis_section = _redis_section(args.config)
    if redis_section is None and args.redis_url is None:
        print("iris-extproc: pass --redis-url (or IRIS_REDIS_URL) to read the routing state without a usable routing config",
              file=sys.stderr)
        return None, None
    return None, redis_settings(_with_key_prefix(redis_section or RedisSettings(), args.key_prefix), args.redis_url)


def _with_key_prefix(settings: RedisSettings, key_prefix: str | None) -> RedisSettings:
    if key_prefix is None:
        return settings
    return RedisSettings.model_validate({**settings.model_dump(exclude_unset=True), "key_prefix": key_prefix})


def _redis_section(path: str) -> RedisSettings | None:
    """The `redis` section of the routing config at `path` when it is valid on its own (the rest
    of the file may not be), else None."""
    from extproc.config.yaml_text import YamlTextError, parse_yaml

    try:
        data = parse_yaml(Path(path).read_text(encoding="utf-8"))
        return RedisSettings.model_validate(data["redis"])
    except (OSError, UnicodeDecodeError, YamlTextError, ValidationError, KeyError, TypeError):
        return None


def _most_run(running) -> Config | None:
    """The routing config most live instances advertise (identical descriptions), or None."""
    described = Counter(i.description for i in running if i.config is not None)
    if not described:
        return None
    description, _ = described.most_common(1)[0]
    return next(i.config for i in running if i.description == description)


def _pair_limits(config: Config) -> dict[tuple[str, str], dict | None]:
    """(provider, model) -> the pair's limits as configured (None: unlimited), for every pair."""
    return {
        (provider.name, model): (entry.limits.model_dump() if entry.limits is not None else None)
        for provider in config.providers for model, entry in provider.models.items()
    }


def _instances_with_other_limits(running, file_config: Config) -> list:
    """The live instances whose advertised config has other pairs or other limits than the file."""
    expected = _pair_limits(file_config)
    return [i for i in running if i.config is not None and _pair_limits(i.config) != expected]


def _say_the_file_is_not_what_runs(running, file_config: Config, other: list, path: str) -> None:
    """One stderr line: the limits shown are the file's, and how the running ones differ (up to
    three pairs of the most common other config)."""
    expected = _pair_limits(file_config)
    described = Counter(i.description for i in other).most_common(1)[0][0]
    ran = _pair_limits(next(i.config for i in other if i.description == described))
    pairs = [pair for pair in dict.fromkeys([*expected, *ran]) if expected.get(pair, "absent") != ran.get(pair, "absent")]
    shown = ", ".join(f"{provider} {model}" for provider, model in pairs[:3]) + (", ..." if len(pairs) > 3 else "")
    print(f"iris-extproc: the limits shown are those of {path}, not those {len(other)} of the {len(running)} live instances "
          f"run (they differ on {shown}); `status --redis-url URL` without --config shows what runs", file=sys.stderr)


def _say_where_pairs_come_from(running, config: Config | None) -> None:
    if config is None:
        print("iris-extproc: no live instance advertises its routing config: no pairs to show", file=sys.stderr)
        return
    described = Counter(i.description for i in running if i.config is not None)
    if len(described) > 1:
        print(f"iris-extproc: the live instances run {len(described)} different routing configs; the pairs shown are those "
              f"{described.most_common(1)[0][1]} of them run", file=sys.stderr)
    else:
        print("iris-extproc: the pairs shown are those the live instances run", file=sys.stderr)


def _outage_policy(running, file_config: Config | None, settings: RedisSettings) -> dict:
    """What routes while Redis is gone: the policy the live instances run (the most common when
    they differ), else the routing config's, else the default. {"policy", "source", "instances":
    {policy: live instances running it}}."""
    policies = Counter(i.config.redis.outage_policy for i in running if i.config is not None)
    if policies:
        policy = policies.most_common(1)[0][0]
        if len(policies) == 1:
            source = f"run by {policies[policy]} live instance{'s' if policies[policy] > 1 else ''}"
        else:
            source = "mixed: " + ", ".join(f"{name} on {count}" for name, count in policies.most_common())
    elif file_config is not None:
        policy, source = file_config.redis.outage_policy, "the routing config's; no live instance says its own"
    else:
        policy = settings.outage_policy
        source = "the routing config's redis section" if "outage_policy" in settings.model_fields_set else "the default"
    return {"policy": policy, "source": source, "instances": dict(policies)}


def _queued_text(queued: dict[str, int]) -> str:
    """Live tickets per priority class, `interactive 3, batch 1`; `0` when none waits, `-` when the
    queue is off for the model."""
    if not queued:
        return "-"
    waiting = [f"{name} {count}" for name, count in queued.items() if count]
    return ", ".join(waiting) or "0"


def _of_limit(count: int, limit: int | None) -> str:
    return f"{count}/{'-' if limit is None else limit}"


def _redis_address(settings) -> str:
    """Where the configured Redis is, without credentials: host:port, the cluster's seed nodes,
    or the Sentinel service and its sentinels."""
    from urllib.parse import urlsplit

    if settings.cluster is not None:
        return "cluster " + ",".join(settings.cluster.nodes)
    if settings.sentinel is not None:
        return f"sentinel service {settings.sentinel.service_name} ({','.join(settings.sentinel.sentinels)})"
    parts = urlsplit(settings.url)
    return f"{parts.hostname}:{parts.port or 6379}"


def _endpoint_flag_text(flag) -> str:
    """An endpoint flag of a pick pair (extproc.routing.endpoint_health) in `status`'s why."""
    return f"endpoint {flag.endpoint} out: {_flag_text(flag)}"


def _flag_text(flag) -> str:
    if flag.ttl_seconds is None:
        return flag.reason
    seconds = flag.ttl_seconds
    if seconds < 120:
        left = f"{seconds:.1f} s"
    elif seconds < 2 * 3600:
        left = f"{seconds / 60:.0f} min"
    elif seconds < 2 * 86400:
        left = f"{seconds / 3600:.0f} h"
    else:
        left = f"{seconds / 86400:.0f} d"
    return f"{flag.reason} [{left} left]"


if __name__ == "__main__":
    sys.exit(main())
