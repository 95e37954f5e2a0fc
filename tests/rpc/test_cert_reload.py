"""Certificate reload under a live router process: its certificate renewed in place, then the whole CA
rotated. New connections get the renewed certificate and are checked against the new CA within moments, an
open connection keeps working, the process never restarts; a client's InternalTLS made before the rotation
opens channels with the rotated certificate. A half-written set is not taken over (rpc/tls_reload.py)."""

from __future__ import annotations

import os
import shutil
import socket
import ssl
from pathlib import Path

import grpc
import pytest
from cryptography import x509

from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.api.router.v1 import router_pb2_grpc
from flotilla.fleet.process import ServiceProcess
from flotilla.rpc.certs import CertificateAuthority
from flotilla.rpc.options import sync_channel
from flotilla.rpc.tls import CA_FILE, CERT_FILE, KEY_FILE, InternalTLS
from flotilla.rpc.tls_reload import CertificateFiles

from tests.support.waiting import wait_until


def _rotate(ca: CertificateAuthority, directory: Path, role: str, name: str, staging: Path) -> None:
    """Replace the files one by one, key first (a moment when key and certificate do not match)."""
    ca.write_identity(staging, role, name)
    for file_name in (KEY_FILE, CA_FILE, CERT_FILE):
        os.replace(staging / file_name, directory / file_name)
    shutil.rmtree(staging)


def _served_identity(address: str, client_dir: Path) -> str:
    """The URI SAN of the certificate the server presents to a new connection."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # we only read which certificate it serves
    context.load_cert_chain(client_dir / CERT_FILE, client_dir / KEY_FILE)
    context.set_alpn_protocols(["h2"])
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as raw, context.wrap_socket(raw) as tls:
        cert = x509.load_der_x509_certificate(tls.getpeercert(binary_form=True))
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return san.get_values_for_type(x509.UniformResourceIdentifier)[0]


def _list_workers(address: str, tls: InternalTLS) -> grpc.StatusCode:
    channel = sync_channel(address, tls, "router")
    try:
        router_pb2_grpc.RouterServiceStub(channel).ListWorkers(rpb.ListWorkersRequest(), timeout=5)
        return grpc.StatusCode.OK
    except grpc.RpcError as error:
        return error.code()
    finally:
        channel.close()


@pytest.fixture
def router(tmp_path: Path):
    ca = CertificateAuthority.create("before")
    tls_dir = ca.write_identity(tmp_path / "router-tls", "router", "router-one")
    process = ServiceProcess("router", ["router", "--host", "127.0.0.1", "--model", "tiny", "--tls-dir", str(tls_dir)],
                             tmp_path / "router.log", tmp_path / "router.port")
    process.start()
    try:
        process.wait_port(60)
        yield ca, tls_dir, process
    finally:
        process.stop()


def test_a_live_router_follows_renewed_and_rotated_certificates(router, tmp_path: Path):
    old_ca, tls_dir, process = router
    pid, address = process.popen.pid, process.address
    operator_dir = old_ca.write_identity(tmp_path / "operator", "operator", "op")
    operator = InternalTLS.from_dir(operator_dir)  # follows its files, like a service's own
    assert _served_identity(address, operator_dir) == "spiffe://flotilla/router/router-one"
    held = sync_channel(address, InternalTLS.from_dir(operator_dir, reload=False), "router")
    held_stub = router_pb2_grpc.RouterServiceStub(held)
    held_stub.ListWorkers(rpb.ListWorkersRequest(), timeout=5)  # an open connection from before

    # Renewal: same CA, a new certificate and key.
    _rotate(old_ca, tls_dir, "router", "router-two", tmp_path / "staging")
    wait_until(lambda: _served_identity(address, operator_dir) == "spiffe://flotilla/router/router-two", 10,
               "new connections to get the renewed certificate", interval_s=0.05)  # fmt: skip
    assert _list_workers(address, operator) == grpc.StatusCode.OK

    # Rotation to a new CA: the router's certificate and trust, then the operator's certificate.
    new_ca = CertificateAuthority.create("after")
    stale_client = InternalTLS.from_dir(operator_dir, reload=False)  # keeps the old CA's certificate
    _rotate(new_ca, tls_dir, "router", "router-three", tmp_path / "staging")
    _rotate(new_ca, operator_dir, "operator", "op", tmp_path / "staging")
    wait_until(lambda: _list_workers(address, operator) == grpc.StatusCode.OK and
               _served_identity(address, operator_dir) == "spiffe://flotilla/router/router-three", 10,
               "a client of the new CA to be served", interval_s=0.05)  # fmt: skip
    assert _list_workers(address, stale_client) == grpc.StatusCode.UNAVAILABLE  # the old CA is not trusted now
    held_stub.ListWorkers(rpb.ListWorkersRequest(), timeout=5)  # the connection from before still works
    held.close()
    assert process.popen.poll() is None and process.popen.pid == pid  # never restarted


def test_a_half_written_set_is_not_taken_over(tmp_path: Path):
    ca = CertificateAuthority.create()
    directory = ca.write_identity(tmp_path / "tls", "worker", "w-1")
    files = CertificateFiles(directory)
    before = files.current()
    (directory / KEY_FILE).write_bytes(ca.issue("worker", "w-2")[1])  # a new key, the old certificate
    assert files.current() == before and files.fetch() is None
    cert, key = ca.issue("worker", "w-2")
    (directory / KEY_FILE).write_bytes(key)
    (directory / CERT_FILE).write_bytes(cert)
    assert files.current().cert == cert and files.fetch() is not None
    assert files.fetch() is None  # nothing new since
