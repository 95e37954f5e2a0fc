"""--router, the same on every service and command that dials routers: repeatable, each a host:port or a comma
list of them (`--router a:1 --router b:2` = `--router a:1,b:2`). Kept free of grpc imports (`flotilla --help`)."""

from __future__ import annotations

import argparse
from collections.abc import Iterable


def add_router_flag(parser: argparse.ArgumentParser, help: str, required: bool = False) -> None:
    parser.add_argument("--router", action="append", default=None, required=required, metavar="HOST:PORT[,...]",
                        help=f"{help}; repeat it or give a comma list for several routers")


def router_addresses(values: Iterable[str] | str | None) -> tuple[str, ...]:
    """Every address the flags gave, in order, each once."""
    if values is None:
        return ()
    if isinstance(values, str):
        values = [values]
    addresses = [part.strip() for value in values for part in value.split(",")]
    return tuple(dict.fromkeys(address for address in addresses if address))
