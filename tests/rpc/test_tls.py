"""Certificates and identities for mTLS (rpc/certs.py, rpc/tls.py), without a network: what a service
certificate says, which URIs are identities, which flags make a transport."""

from __future__ import annotations

import stat

import pytest
from cryptography import x509

from flotilla.rpc.certs import CertificateAuthority, ensure_ca
from flotilla.rpc.tls import Identity, InternalTLS, from_flags, parse_identity


def test_a_service_certificate_names_its_identity_and_the_role_clients_verify(tmp_path):
    ca = CertificateAuthority.create()
    directory = ca.write_identity(tmp_path / "w", "worker", "worker-3")
    cert = x509.load_pem_x509_certificate((directory / "tls.crt").read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == ["spiffe://flotilla/worker/worker-3"]
    assert san.get_values_for_type(x509.DNSName) == ["worker.flotilla.internal"]
    cert.verify_directly_issued_by(ca.cert)
    assert stat.S_IMODE((directory / "tls.key").stat().st_mode) == 0o600
    tls = InternalTLS.from_dir(directory)
    assert tls.ca == ca.cert_pem and b"PRIVATE KEY" in tls.key
    with pytest.raises(ValueError):
        ca.issue("admin", "x")  # not a role any service checks for


def test_the_ca_is_kept_and_reused(tmp_path):
    first = ensure_ca(tmp_path)
    assert ensure_ca(tmp_path).cert == first.cert
    assert stat.S_IMODE((tmp_path / "ca.key").stat().st_mode) == 0o600


@pytest.mark.parametrize(("uri", "identity"), [
    ("spiffe://flotilla/worker/w-1", Identity("worker", "w-1")),
    ("spiffe://flotilla/operator/autoscaler", Identity("operator", "autoscaler")),
    ("spiffe://flotilla/admin/x", None),  # unknown role
    ("spiffe://other/worker/w-1", None),  # another trust domain
    ("spiffe://flotilla/worker/", None),
    ("spiffe://flotilla/worker/a/b", None),
    ("https://flotilla/worker/w-1", None),
])
def test_identities_are_spiffe_ids_of_a_known_role(uri, identity):
    assert parse_identity(uri) == identity


def test_flags_need_certificates_or_an_explicit_insecure_choice(tmp_path, caplog):
    with pytest.raises(SystemExit, match="--tls-dir DIR"):
        from_flags(None, False, "router")
    with pytest.raises(SystemExit, match="exclude each other"):
        from_flags(str(tmp_path), True, "router")
    with pytest.raises(SystemExit, match="ca.crt"):
        from_flags(str(tmp_path), False, "router")
    assert from_flags(None, True, "router") is None
    assert "NOT authenticated" in caplog.text
