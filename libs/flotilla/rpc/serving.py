"""Process plumbing shared by the services: the event loop, stop on SIGTERM/SIGINT, announce the bound port."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Coroutine
from typing import Any

from flotilla.rpc.options import address, write_port_file


def run_service(main: Coroutine[Any, Any, Any]) -> Any:
    """asyncio.run(main) on uvloop (a faster loop, in C; grpc.aio and uvicorn both run on it) unless
    FLOTILLA_EVENT_LOOP=asyncio asks for the standard library's loop."""
    choice = os.environ.get("FLOTILLA_EVENT_LOOP", "uvloop")
    if choice == "uvloop":
        import uvloop

        return uvloop.run(main)
    if choice != "asyncio":
        raise SystemExit(f"FLOTILLA_EVENT_LOOP must be uvloop or asyncio, not {choice!r}")
    return asyncio.run(main)


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
