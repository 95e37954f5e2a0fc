"""`flotilla models list | alias | rollout | promote | rollback | status`: the router's model registry at run
time (router/model_routes.py), over the router's gRPC API. Every change prints the route it left.

With several routers (--router repeated or a comma list; `flotilla up --routers N`'s port files) a change is made
on every router, in order, so that whichever router owns the model routes it the same way; it stops at the
first router that refuses it (and says which). list and status read the model's owner (rpc/router_ownership.py),
where its traffic is."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from flotilla.cli.router_flags import add_router_flag, router_addresses
from flotilla.cli.tls_flags import add_tls_flags

EXIT_REFUSED = 1


def register(subparsers: argparse._SubParsersAction) -> None:
    models = subparsers.add_parser("models", help="model versions, aliases and rollouts in a running router")
    add_router_flag(models, "router host:port (default: $FLOTILLA_ROUTER_ADDRESS, else the routers of "
                    "`flotilla up` in --state-dir); a change is made on every router")
    models.add_argument("--state-dir", default=os.environ.get("FLOTILLA_STATE_DIR", ".flotilla"),
                        help="where `flotilla up` wrote its port files (default %(default)s)")
    models.add_argument("--timeout-s", type=float, default=5.0)
    models.add_argument("--json", action="store_true", help="print the router's answer as JSON")
    add_tls_flags(models)  # an operator certificate; default next to `flotilla up`: one from its state dir's CA
    commands = models.add_subparsers(dest="models_command", required=True)
    commands.add_parser("list", help="every model name: current version, rollout, versions, aliases")
    alias = commands.add_parser("alias", help="point an alias at a model name or name@version")
    alias.add_argument("alias")
    alias.add_argument("target", nargs="?", default="", help="name or name@version")
    alias.add_argument("--delete", action="store_true", help="remove the alias")
    rollout = commands.add_parser("rollout", help="send a share of a model's conversations to a new version "
                                                  "(run again to change the share)")
    rollout.add_argument("model", help="model name or an alias of one")
    rollout.add_argument("version", help="the candidate version (a unique prefix is enough)")
    rollout.add_argument("--weight", type=float, required=True, metavar="PERCENT", help="0..100")
    promote = commands.add_parser("promote", help="the rollout's candidate becomes the current version")
    promote.add_argument("model")
    rollback = commands.add_parser("rollback", help="end a rollout (all to the current version), or after a "
                                                    "promotion make the previous version current again")
    rollback.add_argument("model")
    status = commands.add_parser("status", help="compare a model's versions: TTFT/TPOT, errors, cancels, output")
    status.add_argument("model", help="model name or alias")
    status.add_argument("--window-s", type=float, default=600.0)
    models.set_defaults(func=run_models)


def _router_channel(args: argparse.Namespace, address: str):
    """Changing routes is the operator's right (router/access.py): with --tls-dir that certificate, with
    --insecure-internal plaintext, else an operator identity from `flotilla up`'s CA in --state-dir."""
    from flotilla.rpc.options import sync_channel
    from flotilla.rpc.tls import InternalTLS

    if args.tls_dir or args.insecure_internal:
        tls = InternalTLS.from_dir(args.tls_dir) if args.tls_dir else None
    elif (Path(args.state_dir) / "tls" / "ca").is_dir():
        from flotilla.fleet.certs import FleetCerts

        tls = FleetCerts(Path(args.state_dir)).client("operator", "flotilla-models-cli")
    else:
        raise SystemExit("flotilla models: give --tls-dir (an operator certificate) or --insecure-internal")
    return sync_channel(address, tls, "router")


def run_models(args: argparse.Namespace) -> int:
    import grpc  # here, not at import: `flotilla --help` does not pay for it

    from flotilla.api.router.v1 import router_pb2 as rpb
    from flotilla.api.router.v1 import router_pb2_grpc

    command = args.models_command
    addresses = routers_of(args)
    if not addresses:
        print("flotilla models: no router: pass --router HOST:PORT (or run it next to `flotilla up`)", file=sys.stderr)
        return 2
    if command == "alias" and not args.delete and not args.target:
        print("flotilla models alias: give a TARGET or --delete", file=sys.stderr)
        return 2
    if command in ("list", "status"):  # one answer: the model's owner's (where its traffic and stats are)
        from flotilla.rpc.router_ownership import owner_order

        addresses = owner_order(addresses, getattr(args, "model", ""))[:1]
    answer = None
    for address in addresses:
        with _router_channel(args, address) as channel:
            stub = router_pb2_grpc.RouterServiceStub(channel)
            calls = {
                "list": lambda: stub.ListModelRoutes(rpb.ListModelRoutesRequest(), timeout=args.timeout_s),
                "alias": lambda: stub.SetModelAlias(rpb.SetModelAliasRequest(
                    alias=args.alias, target="" if args.delete else args.target), timeout=args.timeout_s),
                "rollout": lambda: stub.SetModelRollout(rpb.SetModelRolloutRequest(
                    model=args.model, version=args.version, weight_percent=args.weight), timeout=args.timeout_s),
                "promote": lambda: stub.PromoteModel(rpb.PromoteModelRequest(model=args.model),
                                                     timeout=args.timeout_s),
                "rollback": lambda: stub.RollbackModel(rpb.RollbackModelRequest(model=args.model),
                                                       timeout=args.timeout_s),
                "status": lambda: stub.GetModelStatus(rpb.GetModelStatusRequest(
                    model=args.model, window_s=args.window_s), timeout=args.timeout_s),
            }
            try:
                reply = calls[command]()
            except grpc.RpcError as err:
                where = f" (router {address}; the routers before it took the change)" if address != addresses[0] else ""
                print(f"flotilla models {command}: {err.code().name}: {err.details()}{where}", file=sys.stderr)
                return EXIT_REFUSED
        answer = reply if answer is None else answer  # what the first router left is printed
    if args.json:
        from google.protobuf.json_format import MessageToDict

        print(json.dumps(MessageToDict(answer, preserving_proto_field_name=True), indent=1))
    elif command == "list":
        print_list(answer)
    elif command == "status":
        print_status(answer)
    else:
        print(answer.change.detail)
        if answer.HasField("route"):
            print_route(answer.route)
    return 0


def routers_of(args: argparse.Namespace) -> tuple[str, ...]:
    if args.router or os.environ.get("FLOTILLA_ROUTER_ADDRESS"):
        return router_addresses(args.router or os.environ["FLOTILLA_ROUTER_ADDRESS"])
    from flotilla.rpc.options import read_port_file

    ports = Path(args.state_dir) / "ports"  # router.port, or router-0.port, router-1.port, ...
    port_files = [ports / "router.port", *sorted(ports.glob("router-[0-9]*.port"), key=lambda p: p.name)]
    found = (read_port_file(path) for path in port_files if not path.name.endswith(".metrics.port"))
    return tuple(f"127.0.0.1:{port}" for port in found if port is not None)


def short(version: str) -> str:
    return version[:12]


def print_route(route) -> None:
    split = f"{short(route.current_version)}"
    if route.candidate_version:
        split = (f"{short(route.current_version)} {100 - route.candidate_weight_percent:g}% / "
                 f"{short(route.candidate_version)} {route.candidate_weight_percent:g}% (rollout)")
    aliases = f"  aliases: {', '.join(route.aliases)}" if route.aliases else ""
    print(f"{route.name}: {split or '(no version yet)'}{'' if route.managed else '  (unmanaged)'}{aliases}")
    for version in route.versions:
        print(f"  {short(version.version)}  workers {version.num_healthy_active}/{version.num_workers} active")


def print_list(answer) -> None:
    for route in answer.routes:
        print_route(route)
    for alias in answer.aliases:
        print(f"alias {alias.alias} -> {alias.target}")


def print_status(answer) -> None:
    print_route(answer.route)
    print(f"last {answer.window_s:g} s:")
    header = ("version", "role", "weight", "requests", "errors", "cancels", "ttft p50/p95/p99 ms",
              "tpot p50/p95/p99 ms", "out tok", "inflight")
    rows = [header]
    for v in answer.versions:
        rows.append((short(v.version), v.role, f"{v.weight_percent:g}%", str(v.num_requests),
                     f"{100 * v.error_rate:.1f}%", f"{100 * v.cancel_rate:.1f}%",
                     "/".join(f"{1000 * x:.0f}" for x in (v.ttft_p50_s, v.ttft_p95_s, v.ttft_p99_s)),
                     "/".join(f"{1000 * x:.1f}" for x in (v.tpot_p50_s, v.tpot_p95_s, v.tpot_p99_s)),
                     f"{v.mean_output_tokens:.1f}", str(v.num_inflight)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    if answer.HasField("golden"):
        g = answer.golden
        if not g.done:
            print(f"golden check {short(g.candidate_version)} vs {short(g.baseline_version)}: running")
        elif g.error:
            print(f"golden check {short(g.candidate_version)} vs {short(g.baseline_version)}: failed: {g.error}")
        else:
            print(f"golden check {short(g.candidate_version)} vs {short(g.baseline_version)}: {g.num_identical} of "
                  f"{g.num_prompts} greedy answers identical, common prefix {g.mean_common_prefix_tokens:.1f} of "
                  f"{g.num_tokens} tokens")
    for change in answer.recent_changes[-5:]:
        at = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(change.at_unix_s))
        print(f"{at}Z {change.action}: {change.detail}")
