"""gRPC channel and server options shared by every Flotilla process, and port helpers."""

from __future__ import annotations

import os
import socket
from collections.abc import Collection, Mapping
from pathlib import Path

import grpc

from flotilla.rpc.tls import InternalTLS, RoleAuthorization, channel_target_options

MAX_MESSAGE_BYTES = 64 << 20  # long prompts travel as token ids: 64 MiB is ~16M tokens

# Keepalive pings find a dead peer (a killed worker) within seconds even on an idle stream.
CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # A restarted peer (a router the launcher or Kubernetes brought back) is dialled again within 2 s, not after
    # gRPC's default backoff of up to 2 minutes: workers register with it and gateways find it again.
    ("grpc.max_reconnect_backoff_ms", 2_000),
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


def aio_channel(address: str, tls: InternalTLS | None = None, server_role: str = "") -> grpc.aio.Channel:
    """A channel to a service of `server_role` (its certificate is checked for that role); plaintext when
    `tls` is None (--insecure-internal)."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    options = [*CHANNEL_OPTIONS, *channel_target_options(tls, server_role)]
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=options)


def sync_channel(address: str, tls: InternalTLS | None = None, server_role: str = "") -> grpc.Channel:
    """aio_channel's blocking twin (the autoscaler's thread, exec probes, tests)."""
    if tls is None:
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    options = [*CHANNEL_OPTIONS, *channel_target_options(tls, server_role)]
    return grpc.secure_channel(address, tls.channel_credentials(), options=options)


def aio_server(tls: InternalTLS | None = None, policy: Mapping[str, Collection[str]] | None = None
               ) -> grpc.aio.Server:
    """With `tls`, every call is checked against `policy` (method -> roles allowed, rpc/tls.py) before its
    handler runs; without, anyone may call anything."""
    interceptors = [RoleAuthorization(policy or {})] if tls is not None else []
    return grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)


def bind(server: grpc.aio.Server, host: str, port: int, tls: InternalTLS | None = None) -> int:
    """Bind host:port (0 = any free port) and return the port actually bound; raise if binding failed. With
    `tls`, only clients with a certificate from its CA get past the handshake."""
    target = f"{_bracketed(host)}:{port}"
    bound = server.add_insecure_port(target) if tls is None else server.add_secure_port(target,
                                                                                        tls.server_credentials())
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
