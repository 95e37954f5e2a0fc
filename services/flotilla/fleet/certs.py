"""mTLS for a fleet on one machine: one CA (a throwaway, kept in <state dir>/tls/ca unless given) and a
certificate directory per service, <state dir>/tls/<service>, that its --tls-dir points at."""

from __future__ import annotations

from pathlib import Path

from flotilla.rpc.certs import CertificateAuthority, ensure_ca
from flotilla.rpc.tls import InternalTLS


class FleetCerts:
    def __init__(self, state_dir: Path, ca: CertificateAuthority | None = None, insecure: bool = False):
        """insecure: no certificates; every service runs --insecure-internal (and warns)."""
        self._dir = Path(state_dir) / "tls"
        self._ca = ca
        self.insecure = insecure

    @property
    def ca(self) -> CertificateAuthority:
        if self._ca is None:
            self._ca = ensure_ca(self._dir / "ca")
        return self._ca

    def args(self, role: str, name: str) -> list[str]:
        """The flags that give service `name` (of `role`) its identity, issued now."""
        if self.insecure:
            return ["--insecure-internal"]
        return ["--tls-dir", str(self.ca.write_identity(self._dir / name, role, name))]

    def client(self, role: str, name: str) -> InternalTLS | None:
        """An identity for a client in this process (the local autoscaler calls the router as an operator)."""
        if self.insecure:
            return None
        return InternalTLS.from_dir(self.ca.write_identity(self._dir / name, role, name))
