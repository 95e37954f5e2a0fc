"""Certificates for mTLS between Flotilla's services: a CA, and one certificate per service that names its
identity (rpc/tls.py reads them). `flotilla up` and the test fleets make a throwaway CA with this; a cluster
brings its own (cert-manager, or `flotilla certs` into a Secret).

A service certificate carries:
- the URI SAN spiffe://flotilla/<role>/<name>: who the service is (the router authorizes calls by role and
  binds a worker id to the name),
- the DNS SAN <role>.flotilla.internal: the name its clients verify (they dial by IP or pod address, and
  check that the server holds a certificate for the role they meant to reach).

Keys are EC P-256: generating one takes well under a millisecond, so every service of a test fleet gets its
own certificate without slowing the suite.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from flotilla.rpc.tls import CA_FILE, CERT_FILE, KEY_FILE, ROLES, server_name, spiffe_id


@dataclass(frozen=True)
class CertificateAuthority:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    @classmethod
    def create(cls, common_name: str = "flotilla throwaway CA", valid_days: int = 365) -> CertificateAuthority:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        now = _now()
        cert = (
            x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=valid_days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )  # fmt: skip
        return cls(cert, key)

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> CertificateAuthority:
        directory = Path(directory)
        cert = x509.load_pem_x509_certificate((directory / "ca.crt").read_bytes())
        key = serialization.load_pem_private_key((directory / "ca.key").read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{directory / 'ca.key'}: expected an EC key")
        return cls(cert, key)

    def save(self, directory: str | os.PathLike[str]) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "ca.crt").write_bytes(self.cert_pem)
        _write_private(directory / "ca.key", _key_pem(self.key))

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, role: str, name: str, valid_days: int = 90) -> tuple[bytes, bytes]:
        """(certificate PEM, private key PEM) for the service `name` of `role`."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {role!r}")
        if not name or "/" in name:
            raise ValueError(f"bad service name {name!r}")
        key = ec.generate_private_key(ec.SECP256R1())
        now = _now()
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name),
                                     x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role)]))
            .issuer_name(self.cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=valid_days))
            .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(spiffe_id(role, name)),
                                                        x509.DNSName(server_name(role))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False)
            .sign(self.key, hashes.SHA256())
        )  # fmt: skip
        return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)

    def write_identity(self, directory: str | os.PathLike[str], role: str, name: str) -> Path:
        """ca.crt, tls.crt and tls.key for one service in `directory` (what --tls-dir reads); returns it."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        cert, key = self.issue(role, name)
        (directory / CA_FILE).write_bytes(self.cert_pem)
        (directory / CERT_FILE).write_bytes(cert)
        _write_private(directory / KEY_FILE, key)
        return directory


def ensure_ca(directory: str | os.PathLike[str]) -> CertificateAuthority:
    """The CA kept in `directory` (ca.crt, ca.key), made on first use."""
    directory = Path(directory)
    if (directory / "ca.key").exists():
        return CertificateAuthority.load(directory)
    ca = CertificateAuthority.create()
    ca.save(directory)
    return ca


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())  # fmt: skip


def _write_private(path: Path, data: bytes) -> None:
    """A key file only its owner can read, never readable by others even for a moment."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.replace(tmp, path)
