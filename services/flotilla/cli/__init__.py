"""`flotilla` command line: one subcommand module per area, each exposing `register(subparsers)`."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# Before torch loads OpenMP: threads that finish early sleep instead of spinning. On a machine whose cores
# are shared with the gateway and router (one-machine fleets), spinning made a worker's steps 4.5x slower
# under contention; on a quiet machine the two policies measured the same (loadtest/bench_engine.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Subcommand modules; each defines register(subparsers) and sets a `func(args) -> int` default.
SUBCOMMAND_MODULES = ("flotilla.cli.model", "flotilla.cli.serve", "flotilla.cli.gateway", "flotilla.cli.up",
                      "flotilla.cli.keys", "flotilla.cli.usage", "flotilla.cli.probe", "flotilla.cli.certs")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flotilla", description="Flotilla LLM serving fleet")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    from flotilla.fleet.lifeline import exit_with_launcher

    exit_with_launcher()  # a service started by `flotilla up` (or a test's fleet) goes when its launcher does
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
