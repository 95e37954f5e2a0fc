"""--tls-dir / --insecure-internal, the same on every service that speaks internal gRPC (rpc/tls.py reads
them). Kept free of grpc imports: `flotilla --help` stays fast."""

from __future__ import annotations

import argparse
import os


def add_tls_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tls-dir", default=os.environ.get("FLOTILLA_TLS_DIR") or None,
                        help="mTLS for internal gRPC: a directory with ca.crt, tls.crt and tls.key (a mounted "
                             "cert-manager Secret as is; `flotilla certs` makes them); default $FLOTILLA_TLS_DIR")
    parser.add_argument("--insecure-internal", action="store_true",
                        help="plaintext internal gRPC, nobody authenticated (a trusted machine only; logs a warning)")


def internal_tls(args: argparse.Namespace, service: str):
    """The InternalTLS the flags ask for, or None for --insecure-internal; exits when neither is given."""
    from flotilla.rpc.tls import from_flags

    return from_flags(args.tls_dir, args.insecure_internal, service)
