"""The `iris-extproc` command.

    iris-extproc serve --config PATH          run the ext_proc server
    iris-extproc drain PROVIDER [--model M]   mark a provider degraded by hand
    iris-extproc undrain PROVIDER [--model M] clear that mark (automatic flags stay)
    iris-extproc status [--json]              per pair: in-flight/limit, pins/limit, state and why
    iris-extproc check --config F --envoy F   does the routing config agree with the Envoy file?
    iris-extproc envoy-config --config F      the Envoy file rendered from the routing config

A whole local gateway for trying it (Redis, Envoy, simulated providers) is the lab's command,
`iris-lab up` (irislab.cli), not this one.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from extproc.config import Config, ConfigError, ProviderKind, envoy_check, load_config
from extproc.config.envoy_check import EnvoyConfigError
from extproc.config.examples import envoy_yaml
from extproc.routing.degraded import DEFAULT_MANUAL_TTL_SECONDS, MANUAL, DegradedFlags
from extproc.storage.client import REDIS_FAILURES, open_redis

log = logging.getLogger("iris-extproc")


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code: 1 when `check` finds the pair in disagreement, 2 for a
    configuration or Envoy file that is missing, unreadable, invalid or in disagreement at start.
    Such errors are printed without a traceback (a bad routing config: one line per problem)."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_command("iris-extproc", args.func, args)


def run_command(prog: str, func: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """`func(args)`'s exit code; a routing config or Envoy file that cannot be used is printed
    without a traceback (a bad routing config: one line per problem, others prefixed by `prog`)
    and gives 2."""
    try:
        return func(args)
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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="iris-extproc", description=__doc__.split("\n")[1].strip())
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    commands = parser.add_subparsers(required=True, dest="command")

    serve = commands.add_parser("serve", help="run the ext_proc gRPC server")
    serve.add_argument("--config", required=True)
    serve.add_argument("--envoy", help="the Envoy file this server runs behind: checked at start and at every reload")
    serve.add_argument("--event-loop", choices=["uvloop", "asyncio"], default="uvloop")
    serve.add_argument("--workers", type=int, default=1, help="worker processes sharing the port (SO_REUSEPORT)")
    serve.add_argument("--worker-index", type=int, default=None, help=argparse.SUPPRESS)
    serve.set_defaults(func=_serve)

    check = commands.add_parser("check", help="check that a routing config and an Envoy file agree")
    check.add_argument("--config", required=True)
    check.add_argument("--envoy", required=True)
    check.set_defaults(func=_check)

    render = commands.add_parser("envoy-config", help="render the Envoy bootstrap from a routing config (providers' endpoints)")
    render.add_argument("--config", required=True)
    render.add_argument("--template", help="the bootstrap to start from (default: the shipped envoy/envoy.yaml)")
    render.add_argument("--output", help="write it here (default: standard output)")
    render.set_defaults(func=_envoy_config)

    for name, helptext in (("drain", "mark a provider degraded (new traffic avoids it)"), ("undrain", "clear a drain")):
        cmd = commands.add_parser(name, help=helptext)
        cmd.add_argument("provider")
        cmd.add_argument("--model", help="only this model (default: every model of the provider)")
        cmd.add_argument("--config", required=True)
        if name == "drain":
            cmd.add_argument("--ttl-seconds", type=float, default=DEFAULT_MANUAL_TTL_SECONDS)
            cmd.add_argument("--reason", default="drained by an operator")
        cmd.set_defaults(func=_drain if name == "drain" else _undrain)

    status = commands.add_parser("status", help="per provider and model: in-flight requests and pins against the limits, state and why")
    status.add_argument("--config", required=True)
    status.add_argument("--json", action="store_true", help="print the fleet state as one JSON document")
    status.set_defaults(func=_status)
    return parser


def _serve(args) -> int:
    from extproc.openai_api.adaptation import CredentialError
    from extproc.operations.gateway import SecretMissing, serve

    config = load_config(args.config)
    if args.workers < 1:
        print("iris-extproc: --workers must be >= 1", file=sys.stderr)
        return 2
    if args.workers > 1 and args.worker_index is None:
        from extproc.operations.workers import supervise, worker_command

        if args.envoy:
            try:
                check_pair(config, args.config, args.envoy)
            except PairDisagrees as exc:
                print(f"iris-extproc: {exc}", file=sys.stderr)
                return 2
        return supervise(worker_command(args.config, args.event_loop, args.log_level, args.envoy), args.workers)
    adjust = None
    if args.worker_index:
        from functools import partial

        from extproc.operations.workers import worker_config

        # Worker i's own settings (its metrics port), at start and on every reload alike.
        adjust = partial(worker_config, index=args.worker_index)
        config = adjust(config)
    try:
        if args.envoy:
            check_pair(config, args.config, args.envoy)
        run_event_loop(serve(config, config_path=args.config, envoy_path=args.envoy, adjust=adjust), args.event_loop)
    except (SecretMissing, CredentialError, PairDisagrees) as exc:
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
    """Print whether the pair agrees; exit code 1 when it does not."""
    config = load_config(args.config)
    try:
        check_pair(config, args.config, args.envoy)
    except PairDisagrees as exc:
        print(exc)
        return 1
    print(
        f"ok: {args.config} and {args.envoy} agree ({len(config.providers)} providers, "
        f"routing header {config.server.routing_header}, ext_proc on {config.server.listen})"
    )
    return 0


def run_event_loop(main, event_loop: str) -> None:
    """Run `main` on uvloop (faster per message for grpc.aio: about 10 % less CPU per request
    here, bench/overhead.py) or on the standard asyncio loop."""
    if event_loop == "uvloop":
        import uvloop

        uvloop.run(main)
    else:
        asyncio.run(main)


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
    """Set (drain) or clear (undrain) the operator's degraded flag of each pair named."""

    async def run():
        config = load_config(args.config)
        redis = open_redis(config.redis)
        try:
            flags = DegradedFlags(redis, config)
            for provider, model in _pairs(flags, config, args.provider, args.model):
                if drain:
                    await flags.set(provider, model, f"manual: {args.reason}", args.ttl_seconds, MANUAL)
                else:
                    await flags.clear(provider, model, MANUAL)
                print(f"{'drained' if drain else 'undrained'} {provider} {model}")
        finally:
            await redis.aclose()

    asyncio.run(run())
    return 0


def _status(args) -> int:
    """One line per (provider, model): live request leases and pins against their limits (`-`:
    no limit), the tickets waiting in its admission queue per class when the queue is on
    (docs/queue.md), the state (`healthy`, `degraded` by automatic flags, or `drained` while an
    operator's flag holds) and why, each flag with its source, reason and the time it still
    holds; then the live proxy instances. Unlimited providers are never degraded. Exit code 1,
    with one line on stderr, when Redis cannot be read."""

    from extproc.operations.fleet_state import FleetStateReader

    config = load_config(args.config)

    async def read():
        redis = open_redis(config.redis)
        try:
            return await FleetStateReader(config, redis).read()
        finally:
            await redis.aclose()

    try:
        fleet = asyncio.run(read())
    except REDIS_FAILURES as exc:
        print(f"iris-extproc: cannot read the routing state from Redis at {_redis_address(config.redis)}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        import orjson

        print(orjson.dumps(fleet.as_dict(), option=orjson.OPT_INDENT_2).decode())
        return 0
    queues = any(pair.queued for pair in fleet.pairs)  # the admission queue is on for some model (docs/queue.md)
    queued_head = f"{'queued':<24}" if queues else ""
    print(f"{'provider':<16}{'kind':<11}{'model':<28}{'in-flight':<11}{'pins':<16}{queued_head}{'state':<10}why")
    for pair in fleet.pairs:
        why = "; ".join(_flag_text(f) for f in pair.flags)
        if pair.kind == "unlimited":
            why = "unlimited: never degraded"
        in_flight, pins = _of_limit(pair.in_flight, pair.in_flight_limit), _of_limit(pair.pins, pair.pin_limit)
        queued = f"{_queued_text(pair.queued):<24}" if queues else ""
        print(f"{pair.provider:<16}{pair.kind:<11}{pair.model:<28}{in_flight:<11}{pins:<16}{queued}{pair.state:<10}{why}".rstrip())
    print(f"live proxy instances: {fleet.live_instances}")
    return 0


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
