"""gRPC channel and server options shared by every Flotilla process, and port helpers."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import grpc

MAX_MESSAGE_BYTES = 64 << 20  # long prompts travel as token ids: 64 MiB is ~16M tokens

# Keepalive pings find a dead peer (a killed worker) within seconds even on an idle stream.
CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]

SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
    # Without this, two servers could both bind one port on Linux and split the traffic.
    ("grpc.so_reuseport", 0),
]


def aio_channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


def aio_server() -> grpc.aio.Server:
    return grpc.aio.server(options=SERVER_OPTIONS)


def bind(server: grpc.aio.Server, host: str, port: int) -> int:
    """Bind host:port (0 = any free port) and return the port actually bound; raise if binding failed."""
    bound = server.add_insecure_port(f"{_bracketed(host)}:{port}")
    if bound == 0:
        raise OSError(f"could not bind {host}:{port}")
    return bound


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago. Racy by nature: prefer port 0 and --port-file where possible."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def write_port_file(path: str | os.PathLike[str], port: int) -> None:
    """Write the port atomically, so that a launcher polling the file never reads half of it."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(f"{port}\n")
    os.replace(tmp, target)


def read_port_file(path: str | os.PathLike[str]) -> int | None:
    """The port written by write_port_file, or None while the file does not exist yet."""
    try:
        return int(Path(path).read_text().strip())
    except FileNotFoundError:
        return None


def address(host: str, port: int) -> str:
    return f"{_bracketed(host)}:{port}"


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
