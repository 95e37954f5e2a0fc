"""mTLS between Flotilla's services: credentials from a directory of certificate files, the caller's identity
from its certificate, and a server interceptor that lets each method be called by the roles listed for it.

`InternalTLS` None means insecure (plaintext, anyone may call anything): the command-line services get there
only through --insecure-internal, which logs a warning. Identities are spiffe://flotilla/<role>/<name>, in the
certificate's URI SAN (rpc/certs.py issues them; any CA that writes the same SAN works, e.g. cert-manager).
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc

logger = logging.getLogger(__name__)

ROLES = ("router", "worker", "gateway", "operator")
TRUST_DOMAIN = "flotilla"
# cert-manager's Secret layout: a directory (or mounted Secret) with these three files is one identity.
CA_FILE, CERT_FILE, KEY_FILE = "ca.crt", "tls.crt", "tls.key"

INSECURE_WARNING = ("internal gRPC traffic is NOT authenticated or encrypted (--insecure-internal): anyone who "
                    "reaches this service can call it; use it only on a trusted machine")


def spiffe_id(role: str, name: str) -> str:
    return f"spiffe://{TRUST_DOMAIN}/{role}/{name}"


def server_name(role: str) -> str:
    """The DNS name a client verifies when it dials a service of this role (rpc/certs.py puts it in the SAN)."""
    return f"{role}.{TRUST_DOMAIN}.internal"


@dataclass(frozen=True)
class Identity:
    role: str
    name: str

    def __str__(self) -> str:
        return spiffe_id(self.role, self.name)


@dataclass(frozen=True)
class InternalTLS:
    """The CA (bundle) that signs every service's certificate, and this service's own certificate and key (PEM).
    From a directory (`source`), servers and new channels follow its files as they are renewed (tls_reload.py)."""

    ca: bytes
    cert: bytes
    key: bytes = field(repr=False)  # never in a log line or a traceback's locals
    source: str = field(default="", compare=False)  # the directory whose files are followed; "": fixed

    @classmethod
    def from_dir(cls, directory: str | os.PathLike[str], reload: bool = True) -> InternalTLS:
        """ca.crt, tls.crt, tls.key: the layout of a cert-manager Secret, mounted as a directory."""
        directory = Path(directory)
        try:
            files = [(directory / name).read_bytes() for name in (CA_FILE, CERT_FILE, KEY_FILE)]
        except OSError as error:
            raise ValueError(f"TLS directory {directory}: {error.strerror}: {error.filename}") from None
        return cls(*files, source=str(directory.resolve()) if reload else "")

    def server_credentials(self) -> grpc.ServerCredentials:
        if self.source:  # each new connection gets the files' current certificate and CA
            from flotilla.rpc.tls_reload import certificate_files

            files = certificate_files(self.source)
            return grpc.dynamic_ssl_server_credentials(files.initial_configuration(), files.fetch,
                                                       require_client_authentication=True)  # fmt: skip
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)  # fmt: skip

    def channel_credentials(self) -> grpc.ChannelCredentials:
        tls = self
        if self.source:  # a channel made now presents the certificate the files hold now
            from flotilla.rpc.tls_reload import certificate_files

            tls = certificate_files(self.source).current()
        return grpc.ssl_channel_credentials(tls.ca, tls.key, tls.cert)


def channel_target_options(tls: InternalTLS | None, server_role: str) -> list[tuple[str, str]]:
    """The server's certificate must be one for `server_role`: services dial addresses (IPs, pod names),
    so the name checked is the role's, not the address's."""
    if tls is None:
        return []
    if server_role not in ROLES:
        raise ValueError(f"unknown role {server_role!r}")
    return [("grpc.ssl_target_name_override", server_name(server_role))]


def from_flags(tls_dir: str | None, insecure: bool, service: str) -> InternalTLS | None:
    """The internal transport a command line asked for: certificates from --tls-dir, or (only when asked for
    explicitly) none, with a warning. Exits with one line when neither or both were given."""
    if insecure and tls_dir:
        raise SystemExit(f"flotilla {service}: --tls-dir and --insecure-internal exclude each other")
    if insecure:
        logger.warning(INSECURE_WARNING)
        return None
    if not tls_dir:
        raise SystemExit(f"flotilla {service}: internal gRPC needs mTLS certificates: --tls-dir DIR (or "
                         "$FLOTILLA_TLS_DIR) with ca.crt, tls.crt and tls.key; --insecure-internal turns "
                         "authentication off")
    try:
        return InternalTLS.from_dir(tls_dir)
    except ValueError as error:
        raise SystemExit(f"flotilla {service}: {error}") from None


def peer_identity(context: grpc.aio.ServicerContext) -> Identity | None:
    """The caller's identity from its client certificate; None on a plaintext connection or without a
    Flotilla identity in the certificate."""
    auth = context.auth_context()
    for uri in auth.get("peer_spiffe_id", ()) or auth.get("peer_uri", ()):
        identity = parse_identity(uri.decode(errors="replace"))
        if identity is not None:
            return identity
    return None


def parse_identity(uri: str) -> Identity | None:
    prefix = f"spiffe://{TRUST_DOMAIN}/"
    if not uri.startswith(prefix):
        return None
    role, _, name = uri[len(prefix):].partition("/")
    if role not in ROLES or not name or "/" in name:
        return None
    return Identity(role, name)


class RoleAuthorization(grpc.aio.ServerInterceptor):
    """Every call's method must be listed in `policy` (full method name -> roles that may call it) and its
    caller's certificate must name one of them; anything else is PERMISSION_DENIED before the handler runs.
    Unlisted methods are refused: a method added later is closed until someone decides who may call it."""

    def __init__(self, policy: Mapping[str, Collection[str]]):
        self._policy = {method: frozenset(roles) for method, roles in policy.items()}

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        roles = self._policy.get(handler_call_details.method, frozenset())
        return _guarded(handler, lambda context: _check(context, roles, handler_call_details.method))


def _check(context: grpc.aio.ServicerContext, roles: frozenset[str], method: str) -> str | None:
    """None when the caller may call `method`; else why not."""
    identity = peer_identity(context)
    if identity is None:
        return "a client certificate with a Flotilla identity is required"
    if identity.role not in roles:
        logger.warning("refused %s to %s", method, identity)
        return f"{identity.role} identities may not call {method.rsplit('/', 1)[-1]}"
    return None


def _guarded(handler: grpc.RpcMethodHandler, refusal: Callable[[grpc.aio.ServicerContext], str | None]):
    """The same handler, with `refusal` checked before its behaviour runs."""
    if handler.unary_unary:
        behavior, factory = handler.unary_unary, grpc.unary_unary_rpc_method_handler
    elif handler.unary_stream:
        behavior, factory = handler.unary_stream, grpc.unary_stream_rpc_method_handler
    elif handler.stream_unary:
        behavior, factory = handler.stream_unary, grpc.stream_unary_rpc_method_handler
    else:
        behavior, factory = handler.stream_stream, grpc.stream_stream_rpc_method_handler

    if inspect.isasyncgenfunction(behavior):
        async def checked(request, context):
            why = refusal(context)
            if why is not None:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
            async for response in behavior(request, context):
                yield response
    else:
        async def checked(request, context):
            why = refusal(context)
            if why is not None:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
            return await behavior(request, context)

    return factory(checked, request_deserializer=handler.request_deserializer,
                   response_serializer=handler.response_serializer)
