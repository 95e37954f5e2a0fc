"""`flotilla probe worker|router ADDRESS`: a Kubernetes exec probe over gRPC. Exit 0 when the service answers
and (worker) says it is ready: model loaded, engine running and, where the worker runs the golden-output
check, that check passing (WorkerService.Health); exit 1 otherwise, with one line saying why. With --tls-dir (or
$FLOTILLA_TLS_DIR, set in the pods) it calls with the pod's own certificate, as the service itself would."""

from __future__ import annotations

import argparse
import os
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    probe = subparsers.add_parser("probe", help="exec probe: is a worker ready, does a router answer (gRPC)")
    probe.add_argument("service", choices=("worker", "router"))
    probe.add_argument("address", nargs="?", default="127.0.0.1:50051", help="host:port (default %(default)s)")
    probe.add_argument("--timeout-s", type=float, default=2.0)
    probe.add_argument("--tls-dir", default=os.environ.get("FLOTILLA_TLS_DIR") or None,
                       help="mTLS certificate directory (default $FLOTILLA_TLS_DIR; none: plaintext)")
    probe.set_defaults(func=run_probe)


def run_probe(args: argparse.Namespace) -> int:
    import grpc  # here, not at import: `flotilla --help` and the other subcommands do not pay for it

    try:
        reason = check(args.service, args.address, args.timeout_s, args.tls_dir)
    except grpc.RpcError as error:
        reason = f"{args.service} at {args.address} unreachable: {error.code().name}"
    if reason:
        print(reason, file=sys.stderr)
        return 1
    return 0


def check(service: str, address: str, timeout_s: float, tls_dir: str | None = None) -> str:
    """'' when healthy, else why not; raises grpc.RpcError when the call fails."""
    from flotilla.rpc.options import sync_channel
    from flotilla.rpc.tls import InternalTLS

    tls = InternalTLS.from_dir(tls_dir) if tls_dir else None
    with sync_channel(address, tls, service) as channel:
        if service == "worker":
            from flotilla.api.worker.v1 import worker_pb2, worker_pb2_grpc

            health = worker_pb2_grpc.WorkerServiceStub(channel).Health(worker_pb2.HealthRequest(), timeout=timeout_s)
            return "" if health.ready else f"worker {health.worker_id or address} is not ready"
        from flotilla.api.router.v1 import router_pb2, router_pb2_grpc

        router_pb2_grpc.RouterServiceStub(channel).ListModels(router_pb2.ListModelsRequest(), timeout=timeout_s)
        return ""
