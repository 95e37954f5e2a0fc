"""Placement leases (rpc/leases.py): what the router signs a worker accepts; a forged, expired, other
worker's or other request's lease, or none, it refuses."""

from __future__ import annotations

import pytest

from flotilla.api.common.v1 import common_pb2 as pb
from flotilla.rpc.leases import LeaseSigner, LeaseVerifier, ensure_secret_file, read_secret

pytestmark = pytest.mark.unit

SECRET = b"0123456789abcdef0123456789abcdef"
NOW = 1_000_000.0


def _request(lease: pb.Lease | None, request_id: str = "req-1") -> pb.GenerateRequest:
    request = pb.GenerateRequest(request_id=request_id)
    if lease is not None:
        request.lease.CopyFrom(lease)
    return request


def _lease(worker_id: str = "worker-0", request_id: str = "req-1", secret: bytes = SECRET) -> pb.Lease:
    signer = LeaseSigner(secret, ttl_s=30.0, clock=lambda: NOW)
    return signer.grant(request_id, worker_id, "127.0.0.1:1", "m@v1")


def _refusal(request: pb.GenerateRequest, now: float = NOW + 1) -> str | None:
    return LeaseVerifier(SECRET, "worker-0", clock=lambda: now).refusal(request)


def test_a_lease_the_router_signed_for_this_worker_and_request_is_accepted():
    lease = _lease()
    assert lease.expires_unix_s == NOW + 30 and lease.model == "m@v1" and len(lease.token) == 64
    assert _refusal(_request(lease)) is None


@pytest.mark.parametrize("request_, why", [
    (_request(None), "no placement lease"),
    (_request(_lease(worker_id="worker-1")), "for worker 'worker-1'"),
    (_request(_lease(request_id="req-2")), "does not match"),  # another request's lease
    (_request(_lease(secret=b"another-secret-of-32-bytes......")), "does not match"),  # forged
])
def test_a_lease_not_signed_for_this_worker_and_request_is_refused(request_, why):
    assert why in _refusal(request_)


def test_a_changed_expiry_or_an_expired_lease_is_refused():
    stretched = _lease()
    stretched.expires_unix_s += 3600  # the token covers the expiry
    assert "does not match" in _refusal(_request(stretched))
    assert "expired" in _refusal(_request(_lease()), now=NOW + 31)


def test_the_secret_file_is_made_once_owner_only_and_read_back(tmp_path):
    path = ensure_secret_file(tmp_path / "state" / "lease-secret")
    secret = read_secret(path)
    assert len(secret) == 64 and path.stat().st_mode & 0o777 == 0o600
    assert read_secret(ensure_secret_file(path)) == secret  # not replaced
    (tmp_path / "short").write_text("abc\n")
    with pytest.raises(ValueError, match="shorter than"):
        read_secret(tmp_path / "short")
