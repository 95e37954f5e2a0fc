"""mTLS for the suites: one throwaway CA per test session (fleets get their services' certificates from it,
fleet/certs.py), and client identities for the calls tests make themselves (as an operator to a router, as
the router to a worker: what each service lets call it, router/access.py and worker/access.py)."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

import grpc

from flotilla.rpc.certs import CertificateAuthority
from flotilla.rpc.options import aio_channel, sync_channel
from flotilla.rpc.tls import InternalTLS

# Who a test speaks as, by the service it calls.
CLIENT_ROLE = {"router": "operator", "worker": "router"}


@functools.cache
def session_ca() -> CertificateAuthority:
    return CertificateAuthority.create("flotilla test session CA")


@functools.cache
def _identities_dir() -> Path:
    path = Path(tempfile.mkdtemp(prefix="flotilla-test-tls-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


@functools.cache
def identity_dir(role: str, name: str) -> Path:
    """A --tls-dir for service `name` of `role`, from the session CA."""
    return session_ca().write_identity(_identities_dir() / f"{role}-{name}", role, name)


def client_tls(role: str = "operator", name: str = "test-client") -> InternalTLS:
    return InternalTLS.from_dir(identity_dir(role, name))


def tls_args(role: str, name: str) -> list[str]:
    return ["--tls-dir", str(identity_dir(role, name))]


def channel(address: str, server_role: str = "router", client_role: str | None = None) -> grpc.Channel:
    """A blocking channel to a fleet's router or worker, as the client that service accepts."""
    return sync_channel(address, client_tls(client_role or CLIENT_ROLE[server_role]), server_role)


def aio_test_channel(address: str, server_role: str = "router", client_role: str | None = None) -> grpc.aio.Channel:
    return aio_channel(address, client_tls(client_role or CLIENT_ROLE[server_role]), server_role)
