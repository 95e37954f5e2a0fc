"""Process plumbing shared by the services: stop on SIGTERM/SIGINT, announce the bound port."""

from __future__ import annotations

import asyncio
import signal
import sys

from flotilla.rpc.options import address, write_port_file


def stop_on_signals(stop: asyncio.Event) -> None:
    """Set `stop` on SIGTERM or SIGINT (graceful stop) instead of dying mid-request."""
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(signum, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread, or no signals on this platform
            pass


def announce(service: str, host: str, port: int, port_file: str | None) -> None:
    """Print the address (first line a launcher can parse) and write the port file once serving."""
    print(f"flotilla {service} listening on {address(host, port)}", file=sys.stdout, flush=True)
    if port_file:
        write_port_file(port_file, port)
