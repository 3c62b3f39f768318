"""The `iris-lab` command: a whole gateway on this machine, for trying iris-extproc.

    iris-lab up [--config F] [--envoy F]         Redis, Envoy, ext_proc and simulated providers
    iris-lab up --demo [--exit-after-demo]       the same, driving a multi-turn conversation
    iris-lab up --config F --real-providers      Redis, Envoy and ext_proc only, in front of the
                                                 providers' `endpoints` (your own engines)

`./dev up` and `./dev demo` run it. The production command is `iris-extproc` (extproc.cli).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

import yaml

from extproc.cli import PairDisagrees, check_pair, run_command
from extproc.config import load_config
from extproc.config.examples import envoy_yaml, example_config
from irislab.demo import run_demo
from irislab.local_gateway import LocalGateway, ProviderSimulation
from irislab.processes import ProcessError


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (2 for a routing config or Envoy file that cannot be
    used, 1 when the gateway did not start)."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_command("iris-lab", args.func, args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="iris-lab", description="a whole iris-extproc gateway on this machine")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    commands = parser.add_subparsers(required=True, dest="command")
    up = commands.add_parser("up", help="start a local gateway: Redis, Envoy, ext_proc and simulated providers")
    up.add_argument("--config", help="routing config (default: envoy/example-config.yaml)")
    up.add_argument("--envoy", help="Envoy file (default: envoy/envoy.yaml); its ports are moved onto free ones")
    up.add_argument("--demo", action="store_true", help="drive a multi-turn conversation through it, then keep running")
    up.add_argument("--exit-after-demo", action="store_true", help="with --demo: stop once the conversation is done")
    up.add_argument("--real-providers", action="store_true",
                    help="reach every provider that has `endpoints` in the config there (no simulator), through the Envoy "
                         "bootstrap `iris-extproc envoy-config` renders")
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
    try:
        gateway = LocalGateway(config_data=data, default_simulation=simulation, envoy_source=Path(envoy_path),
                               real_providers=args.real_providers).__enter__()
    except ProcessError as exc:  # __enter__ stopped whatever it had started
        print(f"iris-lab: the local gateway did not start, everything it started is stopped: {exc}", file=sys.stderr)
        return 1
    try:
        print(f"gateway up: {gateway.url}/v1  (Redis {gateway.redis_url}, logs in {gateway.work_dir}, left there on exit)", flush=True)
        print(f"routing config: {gateway.running[0].config_path} (use it with status, drain, check; edit it to see a hot reload)", flush=True)
        if args.demo:
            run_demo(gateway.url, str(gateway.running[0].config_path))
            if args.exit_after_demo:
                return 0
        print("press Ctrl-C to stop", flush=True)
        _wait_for_signal()
    finally:
        gateway.stop()
    return 0


def _wait_for_signal() -> None:
    received = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: received.append(signum))
    while not received:
        signal.pause()


if __name__ == "__main__":
    sys.exit(main())
