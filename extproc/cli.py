"""The `iris-extproc` command.

    iris-extproc serve --config PATH          run the ext_proc server
    iris-extproc up [--demo]                  a whole local gateway (Redis, Envoy, providers)
    iris-extproc drain PROVIDER [--model M]   mark a provider degraded by hand
    iris-extproc undrain PROVIDER [--model M] clear that mark (automatic flags stay)
    iris-extproc status                       providers, models, their state and why
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from extproc.config import Config, ConfigError, load_config
from extproc.degraded import DEFAULT_MANUAL_TTL_SECONDS, MANUAL, DegradedFlags
from extproc.redis_client import open_redis

log = logging.getLogger("iris-extproc")


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (2 for a bad configuration)."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="iris-extproc", description=__doc__.split("\n")[1].strip())
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    commands = parser.add_subparsers(required=True, dest="command")

    serve = commands.add_parser("serve", help="run the ext_proc gRPC server")
    serve.add_argument("--config", required=True)
    serve.add_argument("--event-loop", choices=["uvloop", "asyncio"], default="uvloop")
    serve.add_argument("--workers", type=int, default=1, help="worker processes sharing the port (SO_REUSEPORT)")
    serve.add_argument("--worker-index", type=int, default=None, help=argparse.SUPPRESS)
    serve.set_defaults(func=_serve)

    up = commands.add_parser("up", help="start a local gateway: Redis, Envoy, ext_proc and simulated providers")
    up.add_argument("--config", help="routing config (default: envoy/example-config.yaml)")
    up.add_argument("--demo", action="store_true", help="drive a multi-turn conversation through it, then keep running")
    up.add_argument("--exit-after-demo", action="store_true", help="with --demo: stop once the conversation is done")
    up.set_defaults(func=_up)

    for name, helptext in (("drain", "mark a provider degraded (new traffic avoids it)"), ("undrain", "clear a drain")):
        cmd = commands.add_parser(name, help=helptext)
        cmd.add_argument("provider")
        cmd.add_argument("--model", help="only this model (default: every model of the provider)")
        cmd.add_argument("--config", required=True)
        if name == "drain":
            cmd.add_argument("--ttl-seconds", type=float, default=DEFAULT_MANUAL_TTL_SECONDS)
            cmd.add_argument("--reason", default="drained by an operator")
        cmd.set_defaults(func=_drain if name == "drain" else _undrain)

    status = commands.add_parser("status", help="list providers with their state and why")
    status.add_argument("--config", required=True)
    status.set_defaults(func=_status)
    return parser


def _serve(args) -> int:
    from extproc.adaptation import CredentialError
    from extproc.server import SecretMissing, serve

    config = load_config(args.config)
    if args.workers < 1:
        print("iris-extproc: --workers must be >= 1", file=sys.stderr)
        return 2
    if args.workers > 1 and args.worker_index is None:
        from extproc.workers import supervise, worker_command

        return supervise(worker_command(args.config, args.event_loop, args.log_level), args.workers)
    if args.worker_index and config.server.metrics_listen:
        from extproc.workers import worker_metrics_listen

        server = config.server.model_copy(update={"metrics_listen": worker_metrics_listen(config.server.metrics_listen, args.worker_index)})
        config = config.model_copy(update={"server": server})
    try:
        run_event_loop(serve(config), args.event_loop)
    except (SecretMissing, CredentialError) as exc:
        print(f"iris-extproc: {exc}", file=sys.stderr)
        return 2
    return 0


def run_event_loop(main, event_loop: str) -> None:
    """Run `main` on uvloop (faster per message for grpc.aio: about 10 % less CPU per request
    here, bench/overhead.py) or on the standard asyncio loop."""
    if event_loop == "uvloop":
        import uvloop

        uvloop.run(main)
    else:
        asyncio.run(main)


def _up(args) -> int:
    import yaml

    from irislab.local_gateway import LocalGateway, ProviderSimulation

    data = yaml.safe_load(open(args.config)) if args.config else None
    simulation = ProviderSimulation(ttft_ms=30, per_token_ms=10, block_tokens=16)
    with LocalGateway(config_data=data, default_simulation=simulation) as gateway:
        print(f"gateway up: {gateway.url}/v1  (Redis {gateway.redis_url}, logs in {gateway.work_dir})", flush=True)
        if args.demo:
            from irislab.demo import run_demo

            run_demo(gateway.url, str(gateway.running[0].config_path))
            if args.exit_after_demo:
                return 0
        print("press Ctrl-C to stop", flush=True)
        _wait_for_signal()
    return 0


def _wait_for_signal() -> None:
    received = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: received.append(signum))
    while not received:
        signal.pause()


def _pairs(flags: DegradedFlags, config: Config, provider: str, model: str | None) -> list[tuple[str, str]]:
    try:
        config.provider(provider)
    except KeyError:
        raise SystemExit(f"iris-extproc: no provider named {provider!r} in the configuration") from None
    pairs = flags.pairs(provider, model)
    if not pairs:
        raise SystemExit(f"iris-extproc: {provider} has no managed model {model or ''}: unlimited providers are never degraded")
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
    """One line per (provider, model): its state and why. `degraded` (automatic flags only) or
    `drained` (an operator's flag, whatever else holds); each flag with its source, reason and
    the seconds it still holds. Unlimited providers are never degraded."""

    async def run():
        config = load_config(args.config)
        redis = open_redis(config.redis)
        try:
            flags = await DegradedFlags(redis, config).describe()
        finally:
            await redis.aclose()
        print(f"{'provider':<16}{'kind':<11}{'model':<28}{'state':<10}why")
        for provider in config.providers_in_priority_order():
            for model in provider.models:
                held = flags.get((provider.name, model), [])
                state = "healthy"
                if held:
                    state = "drained" if any(f.source == MANUAL for f in held) else "degraded"
                why = "; ".join(_flag_text(f) for f in held)
                if provider.kind.value == "unlimited":
                    why = "unlimited: never degraded"
                print(f"{provider.name:<16}{provider.kind.value:<11}{model:<28}{state:<10}{why}".rstrip())

    asyncio.run(run())
    return 0


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
