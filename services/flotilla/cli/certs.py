"""`flotilla certs --out DIR`: a CA and one mTLS certificate per role (gateway, router, worker, operator) for a
cluster without cert-manager: DIR/<role>/ holds ca.crt, tls.crt, tls.key (`kubectl create secret generic
<release>-tls-<role> --from-file=DIR/<role>`), and DIR/helm-values.yaml has the same certificates for the
chart to write those Secrets itself (`helm install ... -f DIR/helm-values.yaml`). An existing DIR/ca is
reused, so certificates issued again still trust each other; keep DIR/ca/ca.key out of the cluster."""

from __future__ import annotations

import argparse
from pathlib import Path

ROLES = ("gateway", "router", "worker", "operator")


def register(subparsers: argparse._SubParsersAction) -> None:
    certs = subparsers.add_parser("certs", help="make a CA and per-role mTLS certificates (Secrets, helm values)")
    certs.add_argument("--out", type=Path, required=True, help="directory to write into")
    certs.add_argument("--release", default="flotilla",
                       help="Helm release name: the identities are spiffe://flotilla/<role>/<release>-<role>")
    certs.set_defaults(func=run_certs)


def run_certs(args: argparse.Namespace) -> int:
    import yaml

    from flotilla.rpc.certs import ensure_ca
    from flotilla.rpc.tls import CA_FILE, CERT_FILE, KEY_FILE

    ca = ensure_ca(args.out / "ca")
    certificates: dict[str, object] = {CA_FILE: ca.cert_pem.decode()}
    for role in ROLES:
        directory = ca.write_identity(args.out / role, role, f"{args.release}-{role}")
        certificates[role] = {name: (directory / name).read_text() for name in (CERT_FILE, KEY_FILE)}
    values = args.out / "helm-values.yaml"
    values.write_text(yaml.safe_dump({"internalTLS": {"certificates": certificates}}))
    values.chmod(0o600)  # it holds private keys
    print(f"certificates for {', '.join(ROLES)} in {args.out}; chart values in {values}")
    return 0
