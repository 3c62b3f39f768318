"""The `iris-lab` command: a whole gateway on this machine, for trying iris-extproc.

    iris-lab up [--config F] [--envoy F]         Redis, Envoy, ext_proc and simulated providers
    iris-lab up --demo [--exit-after-demo]       the same, driving a multi-turn conversation
    iris-lab up --config F --real-providers      Redis, Envoy and ext_proc only, in front of the
                                                 providers' `endpoints` (your own engines)

`up` prints the client URL, the routing config it runs, the metrics URL and Envoy's admin
address, and removes its work directory (logs, generated files) when it stops, unless
`--keep-work-dir`. `./dev up` and `./dev demo` run it. The global options (`--log-level`,
IRIS_LOG_LEVEL) are `iris-extproc`'s. The production command is `iris-extproc` (extproc.cli).
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
from pathlib import Path

import yaml

from extproc.cli import EnvironmentDefaults, PairDisagrees, check_pair, environment_defaults, new_parser, run_command
from extproc.config import load_config
from extproc.config.examples import envoy_yaml, example_config
from extproc.operations import logs
from irislab.demo import run_demo
from irislab.local_gateway import LocalGateway, ProviderSimulation
from irislab.processes import ProcessError


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (2 for a routing config or Envoy file that cannot be
    used or a bad environment variable, 1 when the gateway did not start)."""
    defaults = environment_defaults("iris-lab")
    if defaults is None:
        return 2
    args = _parser(defaults).parse_args(argv)
    logs.configure(args.log_level, args.log_format)
    return run_command("iris-lab", args.func, args)


def _parser(defaults: EnvironmentDefaults | None = None) -> argparse.ArgumentParser:
    parser, command = new_parser("iris-lab", "a whole iris-extproc gateway on this machine", defaults or EnvironmentDefaults())
    up = command("up", "start a local gateway: Redis, Envoy, ext_proc and simulated providers")
    up.add_argument("--config", metavar="PATH", help="routing config (default: envoy/example-config.yaml)")
    up.add_argument("--envoy", metavar="PATH", help="Envoy file (default: envoy/envoy.yaml); its ports are moved onto free ones")
    up.add_argument("--demo", action="store_true", help="drive a multi-turn conversation through it, then keep running")
    up.add_argument("--exit-after-demo", action="store_true", help="with --demo: stop once the conversation is done")
    up.add_argument("--real-providers", action="store_true",
                    help="reach every provider that has `endpoints` in the config there (no simulator), through the Envoy "
                         "bootstrap `iris-extproc envoy-config` renders")
    up.add_argument("--keep-work-dir", action="store_true",
                    help="leave the work directory (logs, the routing config copy, the Envoy file) when the gateway stops; "
                         "without it, it is removed (it is kept when the gateway fails to start)")
    up.set_defaults(func=_up)
    return parser


def _up(args) -> int:
    config_path = args.config or str(example_config())
    envoy_path = args.envoy or str(envoy_yaml())
    config = load_config(config_path)
    if not args.real_providers:
        try:
            check_pair(config, config_path, envoy_path)
        except PairDisagrees as exc:
            print(f"iris-lab: nothing started: {exc}", file=sys.stderr)
            return 2
    data = yaml.safe_load(open(config_path, encoding="utf-8"))
    simulation = ProviderSimulation(ttft_ms=30, per_token_ms=10, block_tokens=16)
    gateway = LocalGateway(config_data=data, default_simulation=simulation, envoy_source=Path(envoy_path),
                           real_providers=args.real_providers)
    try:
        gateway.__enter__()
    except ProcessError as exc:  # __enter__ stopped whatever it had started; its logs stay
        print(f"iris-lab: the local gateway did not start, everything it started is stopped (logs in {gateway.work_dir}): {exc}",
              file=sys.stderr)
        return 1
    try:
        instance = gateway.running[0]
        kept = "kept on exit" if args.keep_work_dir else "removed on exit: --keep-work-dir keeps it"
        print(f"gateway up: {gateway.url}/v1  (Redis {gateway.redis_url}, logs in {gateway.work_dir}, {kept})", flush=True)
        print(f"routing config: {instance.config_path} (use it with status, drain, check; edit it to see a hot reload)", flush=True)
        print(f"Envoy file: {instance.envoy_path} (the bootstrap Envoy runs: check --config <routing config> --envoy <this file>)",
              flush=True)
        print(f"metrics: {instance.metrics_url}  Envoy admin: http://127.0.0.1:{instance.admin_port} "
              "(/stats, /clusters, /config_dump, /server_info)", flush=True)
        if args.demo:
            run_demo(gateway.url, str(instance.config_path))
            if args.exit_after_demo:
                return 0
        print("press Ctrl-C to stop", flush=True)
        _wait_for_signal()
    finally:
        gateway.stop()
        if not args.keep_work_dir:
            shutil.rmtree(gateway.work_dir, ignore_errors=True)
    return 0


def _wait_for_signal() -> None:
    received = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: received.append(signum))
    while not received:
        signal.pause()


if __name__ == "__main__":
    sys.exit(main())
