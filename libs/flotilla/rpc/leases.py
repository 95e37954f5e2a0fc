"""Placement leases: the router signs, workers check (shared secret, HMAC-SHA256).

A lease names one request on one worker until an expiry; its token is an HMAC over exactly those (lease id,
worker id, request id, expiry) with a secret that the router and its workers read from a file (`flotilla
up` writes one into its state dir; the chart mounts a Secret). A worker with the secret serves a Generate
stream only when its request carries a lease for this worker and request whose token matches and whose
expiry has not passed when the stream opens: a forged token, one for another worker or request, or a stale
one is refused. The expiry bounds only the time between the grant and the stream's start; the stream itself
runs as long as it needs (the router releases the lease when its Acquire stream ends).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path

from flotilla.api.common.v1 import common_pb2 as pb

MIN_SECRET_BYTES = 16


def _message(lease_id: str, worker_id: str, request_id: str, expires_unix_s: float) -> bytes:
    return f"{lease_id}\n{worker_id}\n{request_id}\n{expires_unix_s:.3f}".encode()


def sign(secret: bytes, lease_id: str, worker_id: str, request_id: str, expires_unix_s: float) -> str:
    return hmac.new(secret, _message(lease_id, worker_id, request_id, expires_unix_s), hashlib.sha256).hexdigest()


class LeaseSigner:
    """The router's half: a signed Lease for a request on a worker, valid for `ttl_s` from now."""

    def __init__(self, secret: bytes, ttl_s: float = 30.0, clock: Callable[[], float] = time.time):
        self._secret = secret
        self._ttl_s = ttl_s
        self._clock = clock

    def grant(self, request_id: str, worker_id: str, worker_address: str, model: str,
              prefill_worker_address: str = "") -> pb.Lease:
        lease_id = secrets.token_hex(8)
        expires = round(self._clock() + self._ttl_s, 3)
        return pb.Lease(lease_id=lease_id, worker_id=worker_id, worker_address=worker_address, model=model,
                        prefill_worker_address=prefill_worker_address, expires_unix_s=expires,
                        token=sign(self._secret, lease_id, worker_id, request_id, expires))


class LeaseVerifier:
    """A worker's half: why a request's lease is not valid here, or None when it is."""

    def __init__(self, secret: bytes, worker_id: str, clock: Callable[[], float] = time.time):
        self._secret = secret
        self._worker_id = worker_id
        self._clock = clock

    def refusal(self, request: pb.GenerateRequest) -> str | None:
        if not request.HasField("lease"):
            return "the request carries no placement lease"
        lease = request.lease
        if lease.worker_id != self._worker_id:
            return f"the lease is for worker {lease.worker_id!r}, not this one"
        expected = sign(self._secret, lease.lease_id, lease.worker_id, request.request_id, lease.expires_unix_s)
        if not hmac.compare_digest(expected, lease.token):
            return "the lease's token does not match (forged, or for another request)"
        if lease.expires_unix_s < self._clock():
            return "the lease has expired"
        return None


def read_secret(path: str | os.PathLike[str]) -> bytes:
    """The shared secret in a file (surrounding whitespace dropped); ValueError when it is too short."""
    secret = Path(path).read_bytes().strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"lease secret in {path} is shorter than {MIN_SECRET_BYTES} bytes")
    return secret


def ensure_secret_file(path: str | os.PathLike[str]) -> Path:
    """A secret file at `path`, created (owner-only, random) when missing: what `flotilla up` gives its router
    and workers."""
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_hex(32) + "\n")
    return path
