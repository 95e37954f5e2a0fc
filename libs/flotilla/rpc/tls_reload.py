"""Certificate files that change under a running service (cert-manager renews a mounted Secret in place, a
`flotilla certs` run rewrites a directory): new connections use the files as they are now, without a restart.

Servers: grpc's dynamic SSL server credentials call `fetch` each time a connection is about to be accepted; it
stats the three files (cheap) and, once one changed, reads them and hands gRPC the new key pair and CA bundle
(the CA also decides which client certificates new connections accept). Connections already open keep the
handshake they made. A half-written set (a key that does not match its certificate, a file that does not
parse) is skipped until it is whole: the service keeps serving the certificate it had.

Clients: grpc fixes a channel's credentials when the channel is made; channels made after a renewal present
the renewed certificate (`InternalTLS.channel_credentials` reads the current files), one made before keeps the
certificate it was made with for its life.
"""

from __future__ import annotations

import functools
import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

if TYPE_CHECKING:
    from flotilla.rpc.tls import InternalTLS

logger = logging.getLogger(__name__)


class CertificateFiles:
    """One --tls-dir, reread when its files change."""

    def __init__(self, directory: Path):
        from flotilla.rpc.tls import CA_FILE, CERT_FILE, KEY_FILE, InternalTLS

        self._paths = [directory / name for name in (CA_FILE, CERT_FILE, KEY_FILE)]
        self._lock = threading.Lock()
        self._stamp = self._stat()
        self._current = InternalTLS.from_dir(directory, reload=False)
        self.version = 0  # +1 per certificate set taken over
        self._served_version = 0

    def current(self) -> InternalTLS:
        """The files' certificate set as it is now (the last whole one)."""
        with self._lock:
            self._refresh()
            return self._current

    def initial_configuration(self) -> grpc.ServerCertificateConfiguration:
        return _configuration(self.current())

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """grpc's certificate configuration fetcher: a new configuration once the files changed, else None
        (gRPC keeps the one it has). Called on gRPC's threads; never raises."""
        try:
            with self._lock:
                self._refresh()
                if self.version == self._served_version:
                    return None
                self._served_version = self.version
                current = self._current
            logger.info("serving the renewed certificate from %s", self._paths[1].parent)
            return _configuration(current)
        except Exception:
            logger.exception("reloading the certificate from %s failed; keeping the current one", self._paths[1].parent)
            return None

    def _stat(self) -> tuple | None:
        try:  # stat follows the symlinks of a mounted Secret, whose ..data link is swapped on renewal
            return tuple((s.st_mtime_ns, s.st_size, s.st_ino) for s in (path.stat() for path in self._paths))
        except OSError:
            return None

    def _refresh(self) -> None:
        stamp = self._stat()
        if stamp is None or stamp == self._stamp:
            return
        from flotilla.rpc.tls import InternalTLS

        try:
            candidate = InternalTLS(*(path.read_bytes() for path in self._paths))
            problem = _mismatch(candidate)
        except (OSError, ValueError) as error:
            problem = str(error)
        if problem is not None:  # mid-write, most likely: try again at the next look
            logger.warning("certificate files in %s are not a usable set yet (%s)", self._paths[1].parent, problem)
            return
        self._stamp, self._current = stamp, candidate
        self.version += 1


@functools.cache
def certificate_files(directory: str) -> CertificateFiles:
    """One watcher per directory, shared by a process's server and channels."""
    return CertificateFiles(Path(directory))


def _configuration(tls: InternalTLS) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration([(tls.key, tls.cert)], root_certificates=tls.ca)


def _mismatch(tls: InternalTLS) -> str | None:
    """None when the CA bundle parses and the key belongs to the certificate; else what is wrong."""
    try:
        x509.load_pem_x509_certificates(tls.ca)
        cert = x509.load_pem_x509_certificate(tls.cert)
        key = serialization.load_pem_private_key(tls.key, password=None)
    except ValueError as error:
        return f"does not parse: {error}"
    raw = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if cert.public_key().public_bytes(*raw) != key.public_key().public_bytes(*raw):
        return "tls.key does not belong to tls.crt"
    return None
