"""TLS, mTLS and a bearer token for every pdgrpc gRPC server and client.

What each process presents, and to whom, is in docs/security.md. In short:

* ``--tls-cert``/``--tls-key``: the process serves TLS with this certificate and presents
  it, as a client certificate, on every call it makes inside the cluster.
* ``--tls-ca``: the CA that peers' certificates must chain to. A server given it asks
  every client for a certificate (mTLS); a client checks servers against it (else
  against the system roots).
* ``--auth-token-file``: a bearer token (for clusters without a PKI). Servers refuse a
  call without ``authorization: Bearer <token>`` with UNAUTHENTICATED; clients send it
  on every call. ``grpc.health.v1.Health`` stays open (load-balancer probes).
* ``--auth-roles-file``: the SHA-256 digests of one token per role: a server given it
  takes any of these tokens, and the token names its caller's role.
* Roles (:mod:`pdgrpc.rpc.roles`): a caller's certificate or token names its role, and
  each RPC takes only the roles of :data:`~pdgrpc.rpc.roles.CALLERS`; another role is
  refused PERMISSION_DENIED before its request is read.
* ``--insecure``: allow a listener on an address other than loopback with neither TLS
  nor a token (logged as a warning at start-up). Without it such a server refuses to start.
* ``--public-tls-cert``/``--public-tls-key`` (router): the public ``GenerateService``
  serves server-only TLS with this certificate; no client certificate, no token. Its
  calls inside the cluster still use the flags above.

Certificates and keys are PEM files; grpc's own SSL credentials do the TLS. A process's
entry point calls :func:`install` once with :func:`security_from_args`; :func:`start_server`
(``pdgrpc.rpc.server``) and :class:`~pdgrpc.rpc.channels.ChannelPool` use the installed
:class:`Security` unless given another.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import hmac
import inspect
import ipaddress
import logging
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterator, Sequence

import grpc

from pdgrpc.errors import ConfigError
from pdgrpc.rpc.limits import HandlerWrapper
from pdgrpc.rpc.loopback_peer import LocalUsers
from pdgrpc.rpc.roles import GATEWAY, OPEN_METHODS, ROLE_URI, ROLES, callers
from pdgrpc.rpc.tls_files import check_ca, check_server_pair

__all__ = [
    "AUTH_HEADER",
    "BEARER",
    "Security",
    "add_security_arguments",
    "current",
    "gateway_handler_wrapper",
    "install",
    "is_loopback",
    "loopback_address",
    "parse_roles",
    "peer_identity",
    "read_secret",
    "require_caller",
    "security_argv",
    "security_from_args",
    "token_digest",
]

log = logging.getLogger("pdgrpc.rpc.security")

AUTH_HEADER = "authorization"
# The scheme before the token in the AUTH_HEADER value, as HTTP spells bearer tokens.
BEARER = "Bearer "


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read {str(path)!r}: {exc.strerror or exc}") from None


def read_secret(path: Path, flag: str) -> bytes:
    """The bytes of the secret file ``flag`` names; ConfigError naming the flag when it
    cannot be read, or when group or others may read or write it: a secret other users
    can read is no secret. A blank file is returned as is (its caller names it)."""
    data = _read(path, flag)
    mode = path.stat().st_mode & 0o777
    if data.strip() and mode & 0o077:
        raise ConfigError(f"{flag} {str(path)!r} is open to group or others (mode {mode:o}): chmod 600 it")
    return data


@dataclasses.dataclass(frozen=True)
class Security:
    """One process's gRPC security settings (see the module doc). ``Security()`` is plaintext
    without a token, allowed on loopback only."""

    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None
    token_file: Path | None = None
    roles_file: Path | None = None
    insecure: bool = False
    public_cert: Path | None = None
    public_key: Path | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ConfigError("--tls-cert and --tls-key go together: give both or neither")
        if (self.public_cert is None) != (self.public_key is None):
            raise ConfigError("--public-tls-cert and --public-tls-key go together: give both or neither")
        if self.token_file is not None and not self.token:
            raise ConfigError(f"--auth-token-file {str(self.token_file)!r} is empty")

    @property
    def tls(self) -> bool:
        return self.cert is not None

    @property
    def token(self) -> str:
        """The bearer token ('' when none); surrounding whitespace is not part of it."""
        if self.token_file is None:
            return ""
        return read_secret(self.token_file, "--auth-token-file").decode("utf-8", "replace").strip()

    @property
    def authenticated(self) -> bool:
        """Whether a server with these settings refuses callers that prove nothing."""
        return (self.tls and self.ca is not None) or self.token_file is not None or self.roles_file is not None

    def public(self) -> "Security":
        """The settings of the router's public port: server-only TLS when a public
        certificate is given, else the same as inside the cluster."""
        if self.public_cert is None:
            return self
        return Security(cert=self.public_cert, key=self.public_key, insecure=self.insecure)

    # ---- servers ------------------------------------------------------------------------

    def server_credentials(self) -> Any:
        """``grpc.ServerCredentials`` for TLS (None: plaintext)."""
        if self.cert is None or self.key is None:
            return None
        pair = [(_read(self.key, "--tls-key"), _read(self.cert, "--tls-cert"))]
        if self.ca is None:
            return grpc.ssl_server_credentials(pair)
        return grpc.ssl_server_credentials(pair, root_certificates=_read(self.ca, "--tls-ca"), require_client_auth=True)

    def server_handler_wrapper(self) -> HandlerWrapper | None:
        """What a server wraps each of its handlers in, once, as they are added (see
        ``pdgrpc.rpc.limits.UndecodableIsInvalidArgument``): the caller's check (its
        token, and its role against :data:`pdgrpc.rpc.roles.CALLERS`) where the server
        authenticates, else nothing (None)."""
        if not self.authenticated:
            return None
        digests = None if self.roles_file is None else parse_roles(_read(self.roles_file, "--auth-roles-file"), "--auth-roles-file")
        gate = _Gate(self.token, digests, mtls=self.tls and self.ca is not None)
        return lambda handler, method: require_caller(handler, method, gate.check(method))

    def check_listen(self, host: str, what: str) -> None:
        """Refuse a non-loopback listener that is neither encrypted nor authenticated
        (unless ``insecure``); warn when ``insecure`` lets one start."""
        if is_loopback(host) or self.tls or self.token_file is not None or self.roles_file is not None:
            return
        if not self.insecure:
            raise ConfigError(
                f"{what}: refusing to listen on {host!r} without TLS or a token: give --tls-cert/--tls-key "
                "(and --tls-ca for client certificates) or --auth-token-file, listen on 127.0.0.1, "
                "or pass --insecure to accept anyone on the network"
            )
        log.warning("%s: listening on %s with neither TLS nor a token (--insecure): anyone who can reach it can call it", what, host)

    # ---- clients ------------------------------------------------------------------------

    def channel(self, target: str, options: Sequence[tuple[str, Any]] = (), interceptors: Sequence[Any] = ()) -> grpc.aio.Channel:
        """A ``grpc.aio`` channel to ``target`` presenting these credentials."""
        chain = [*interceptors, *self.client_interceptors()]
        if self.tls or self.ca is not None:
            creds = grpc.ssl_channel_credentials(
                root_certificates=_read(self.ca, "--tls-ca") if self.ca is not None else None,
                private_key=_read(self.key, "--tls-key") if self.key is not None else None,
                certificate_chain=_read(self.cert, "--tls-cert") if self.cert is not None else None,
            )
            return grpc.aio.secure_channel(target, creds, options=list(options), interceptors=chain or None)
        return grpc.aio.insecure_channel(target, options=list(options), interceptors=chain or None)

    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        """What each call carries to prove its caller where no interceptor runs (the local
        socket, :mod:`pdgrpc.rpc.local`): the bearer token, if any."""
        token = self.token
        return ((AUTH_HEADER, BEARER + token),) if token else ()

    def client_interceptors(self) -> list[Any]:
        token = self.token
        if not token:
            return []
        return [kind(token) for kind in (_TokenSendUnaryUnary, _TokenSendUnaryStream, _TokenSendStreamUnary, _TokenSendStreamStream)]


_INSTALLED = Security()


def install(security: Security) -> None:
    """Make ``security`` this process's default (servers and channel pools)."""
    global _INSTALLED
    _INSTALLED = security


def current() -> Security:
    """This process's default :class:`Security` (plaintext, loopback only, until :func:`install`)."""
    return _INSTALLED


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def peer_identity(context: grpc.aio.ServicerContext) -> str:
    """Who called: the client certificate's subject (``cn:<common name>``) under mTLS,
    else the peer's host (``host:<address>``, port left out)."""
    auth = context.auth_context() or {}
    names = auth.get("x509_common_name") or auth.get("x509_subject_alternative_name")
    if names:
        return "cn:" + b",".join(sorted(names)).decode("utf-8", "replace")
    peer = context.peer() or ""
    kind, _, rest = peer.partition(":")
    host = rest.rsplit(":", 1)[0] if kind in ("ipv4", "ipv6") else rest
    return f"host:{host.strip('[]')}"


# ---- who called, and may they --------------------------------------------------------


_DENIED = f"missing or wrong bearer token (send '{AUTH_HEADER}: Bearer <token>'; see --auth-token-file)"
Refusal = tuple[grpc.StatusCode, str]
Check = Callable[[Any], "Refusal | None"]


def token_digest(token: str) -> str:
    """The hex SHA-256 of a bearer token, as ``--auth-roles-file`` lists it."""
    return hashlib.sha256(token.encode()).hexdigest()


def parse_roles(data: bytes, flag: str) -> dict[bytes, str]:
    """The digest -> role table of a roles file (``<role> <hex sha-256 of its token>`` a
    line; blank lines and ``#`` comments skipped); ConfigError naming ``flag`` and the line."""
    out: dict[bytes, str] = {}
    for n, line in enumerate(data.decode("utf-8", "replace").splitlines(), start=1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) != 2 or words[0] not in ROLES:
            raise ConfigError(f"{flag} line {n}: expected '<role> <sha-256 hex>' with a role of {', '.join(ROLES)}, got {line.strip()!r}")
        try:
            digest = bytes.fromhex(words[1])
        except ValueError:
            digest = b""
        if len(digest) != hashlib.sha256().digest_size:
            raise ConfigError(f"{flag} line {n}: {words[1]!r} is not a SHA-256 digest in hex (64 hex digits)")
        out[digest] = words[0]
    if not out:
        raise ConfigError(f"{flag} lists no role")
    return out


def _bearer(context: Any) -> bytes:
    got: str | bytes = next((v for k, v in context.invocation_metadata() or () if k == AUTH_HEADER), "")
    return got.encode() if isinstance(got, str) else bytes(got)


def _cert_roles(context: Any) -> frozenset[str] | None:
    """The roles the client certificate names (URI SANs under :data:`ROLE_URI`); None
    when it names none."""
    auth = context.auth_context() or {}
    prefix = ROLE_URI.encode()
    found = frozenset(n[len(prefix):].decode("utf-8", "replace") for n in auth.get("x509_subject_alternative_name", ()) if n.startswith(prefix))
    return found or None


class _Gate:
    """A server's check of its callers: the token (the shared one, or one of the roles'
    by its digest) and, under mTLS, the certificate's role. A caller's roles are those
    every credential it presents names; a credential naming no role names every role."""

    def __init__(self, token: str, digests: dict[bytes, str] | None, *, mtls: bool) -> None:
        self._expected = (BEARER + token).encode() if token else b""
        self._digests = digests
        self._mtls = mtls

    def check(self, method: str) -> Check | None:
        """The check of ``method``'s calls (None: every call passes)."""
        if method in OPEN_METHODS:
            return None
        allowed = callers(method)
        take = ", ".join(sorted(allowed)) or "no caller"

        def refusal(context: Any) -> Refusal | None:
            roles = self._roles(context)
            if isinstance(roles, tuple):
                return roles
            if roles is None or roles & allowed:
                return None
            return (grpc.StatusCode.PERMISSION_DENIED,
                    f"{method} is not open to a {'/'.join(sorted(roles)) or 'caller whose credentials name different roles'}: it takes {take}")

        return refusal

    def _roles(self, context: Any) -> frozenset[str] | Refusal | None:
        roles: frozenset[str] | None = None
        if self._digests is not None:
            got = _bearer(context)
            role = self._digests.get(hashlib.sha256(got[len(BEARER):]).digest()) if got.startswith(BEARER.encode()) else None
            if role is None:
                return grpc.StatusCode.UNAUTHENTICATED, _DENIED
            roles = frozenset({role})
        elif self._expected and not hmac.compare_digest(_bearer(context), self._expected):
            return grpc.StatusCode.UNAUTHENTICATED, _DENIED
        if self._mtls:
            named = _cert_roles(context)
            if named is not None:
                roles = named if roles is None else roles & named
        return roles


def gateway_handler_wrapper(users: LocalUsers) -> HandlerWrapper:
    """What a gateway listener (``--gateway-listen``) wraps each handler in: its callers
    prove no credential, so a call from a local process of a user ``users`` does not
    admit, or of a method :data:`CALLERS` does not open to the ``gateway`` role, is
    refused PERMISSION_DENIED before its request is read."""
    not_a_user: Refusal = (grpc.StatusCode.PERMISSION_DENIED,
                           "the gateway listener serves only local processes of this server's user and --gateway-uid's")

    def wrap(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        allowed = callers(method)
        if method in OPEN_METHODS:
            return handler
        if GATEWAY in allowed:
            return require_caller(handler, method, lambda context: None if users.admits(context) else not_a_user)
        refused: Refusal = (grpc.StatusCode.PERMISSION_DENIED,
                            f"{method} is not open to the gateway listener, whose callers are the gateway role alone: "
                            f"it takes {', '.join(sorted(allowed)) or 'no caller'}")
        return require_caller(handler, method, lambda context: refused if users.admits(context) else not_a_user)

    return wrap


def loopback_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) of a loopback listener, as ``(host, port)``;
    ValueError saying why for anything else: a listener that trusts its callers without
    credentials must be out of the network's reach."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT with a port of 0-65535, got {text!r}")
    if not is_loopback(host):
        raise ValueError(f"{host!r} is not a loopback address (127.0.0.1, ::1, localhost): this listener takes callers "
                         "without credentials, so only this host may reach it")
    return host.strip("[]"), int(port)


def _checking(behaviour: Callable[..., Any], check: Check, parse: Callable[[bytes], Any] | None) -> Callable[..., Any]:
    """``behaviour`` (a handler's function, of any kind grpc.aio runs) refusing a call
    that ``check`` refuses before it runs or reads a request; ``parse``: the unary
    request's deserializer, run after the check."""
    if inspect.isasyncgenfunction(behaviour):

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            refused = check(context)
            if refused is not None:
                await context.abort(*refused)
            async for item in behaviour(request if parse is None else parse(request), context):
                yield item

        return stream
    if inspect.iscoroutinefunction(behaviour):

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            refused = check(context)
            if refused is not None:
                await context.abort(*refused)
            return await behaviour(request if parse is None else parse(request), context)

        return call
    # Synchronous handlers (grpc.aio runs them on a thread; health's List is one).
    if inspect.isgeneratorfunction(behaviour):

        def sync_stream(request: Any, context: Any) -> Iterator[Any]:
            refused = check(context)
            if refused is not None:
                context.abort(*refused)
            yield from behaviour(request if parse is None else parse(request), context)

        return sync_stream

    def sync_call(request: Any, context: Any) -> Any:
        refused = check(context)
        if refused is not None:
            context.abort(*refused)
        return behaviour(request if parse is None else parse(request), context)

    return sync_call


def _read_after(behaviour: Callable[..., Any], check: Check) -> Callable[..., Any]:
    """``behaviour``, an async handler of one request, as a request-streaming one that
    receives the request only once ``check`` passed: grpc reads a unary request whole
    before any handler runs, a streamed one as the handler asks, so a refused caller's
    message is never buffered (the wire is the same for both)."""

    async def first(context: grpc.aio.ServicerContext) -> Any:
        refused = check(context)
        if refused is not None:
            await context.abort(*refused)
        request = await context.read()
        if request is grpc.aio.EOF:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call carries no request message")
        return request

    if inspect.isasyncgenfunction(behaviour):

        async def stream(requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async for item in behaviour(await first(context), context):
                yield item

        return stream

    async def call(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        return await behaviour(await first(context), context)

    return call


def require_caller(handler: grpc.RpcMethodHandler, method: str, check: Check | None) -> grpc.RpcMethodHandler:
    """``handler`` of ``method`` (``/service/name``) refusing every call that ``check``
    refuses (with its status and message), before anything reads its request: an async
    unary request is received only after the check (:func:`_read_after`), a synchronous
    one parsed after it. ``check`` None: the handler as it is."""
    if handler is None or check is None:
        return handler
    parse, out = handler.request_deserializer, handler.response_serializer
    if not handler.request_streaming:
        behaviour = handler.unary_stream if handler.response_streaming else handler.unary_unary
        if inspect.isasyncgenfunction(behaviour):
            return grpc.stream_stream_rpc_method_handler(_read_after(behaviour, check), parse, out)
        if inspect.iscoroutinefunction(behaviour) and not handler.response_streaming:
            return grpc.stream_unary_rpc_method_handler(_read_after(behaviour, check), parse, out)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_checking(handler.stream_stream, check, None), parse, out)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_checking(handler.stream_unary, check, None), parse, out)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_checking(handler.unary_stream, check, parse), None, out)
    return grpc.unary_unary_rpc_method_handler(_checking(handler.unary_unary, check, parse), None, out)


class _TokenSend:
    """Adds ``authorization: Bearer <token>`` to a call's metadata (one subclass per call
    kind below: a grpc.aio channel files each interceptor under the first kind it is)."""

    def __init__(self, token: str) -> None:
        self._header = (AUTH_HEADER, BEARER + token)

    def _details(self, d: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(d.metadata or ()), self._header)
        return grpc.aio.ClientCallDetails(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready)


class _TokenSendUnaryUnary(_TokenSend, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _TokenSendUnaryStream(_TokenSend, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _TokenSendStreamUnary(_TokenSend, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return await continuation(self._details(details), request_iterator)


class _TokenSendStreamStream(_TokenSend, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return await continuation(self._details(details), request_iterator)


# ---- flags -------------------------------------------------------------------------------

_FLAGS = (
    ("tls_cert", "--tls-cert"),
    ("tls_key", "--tls-key"),
    ("tls_ca", "--tls-ca"),
    ("auth_token_file", "--auth-token-file"),
    ("auth_roles_file", "--auth-roles-file"),
)


def add_security_arguments(parser: argparse.ArgumentParser, *, public: bool = False) -> None:
    """Add ``--tls-cert``, ``--tls-key``, ``--tls-ca``, ``--auth-token-file``, ``--insecure``
    (and, with ``public``, the router's ``--public-tls-cert``/``--public-tls-key``)."""
    g = parser.add_argument_group("security (docs/security.md)")
    g.add_argument("--tls-cert", type=Path, metavar="PEM", help="this process's certificate (chain): served, and presented as the client certificate on calls inside the cluster")
    g.add_argument("--tls-key", type=Path, metavar="PEM", help="the private key of --tls-cert")
    g.add_argument(
        "--tls-ca", type=Path, metavar="PEM",
        help="CA certificate(s) peers must chain to; turns on client-certificate checks (mTLS) on this server, "
        "and is what this process checks servers against",
    )
    g.add_argument(
        "--auth-token-file", type=Path, metavar="FILE",
        help="file holding this process's bearer token, which it sends on its own calls. Without --auth-roles-file "
        "it is the cluster's one shared token: calls without it are refused (UNAUTHENTICATED; health checks excepted)",
    )
    g.add_argument(
        "--auth-roles-file", type=Path, metavar="FILE",
        help="file of '<role> <sha-256 hex of its token>' lines, one token per role (router, prefill, decode, bootstrap, "
        "gateway, client): calls must carry one of these tokens, which names the caller's role, and each RPC takes "
        "only its roles (docs/security.md)",
    )
    g.add_argument(
        "--insecure", action="store_true",
        help="allow listening on a non-loopback address with neither TLS nor a token (a warning is logged). "
        "Without it such a server refuses to start",
    )
    if public:
        g.add_argument("--public-tls-cert", type=Path, metavar="PEM", help="certificate of the public GenerateService: server-only TLS (clients present nothing)")
        g.add_argument("--public-tls-key", type=Path, metavar="PEM", help="the private key of --public-tls-cert")


def security_from_args(ns: argparse.Namespace) -> Security:
    """The :class:`Security` the flags describe; ConfigError naming a bad flag or file."""
    security = Security(
        cert=ns.tls_cert, key=ns.tls_key, ca=ns.tls_ca, token_file=ns.auth_token_file,
        roles_file=getattr(ns, "auth_roles_file", None), insecure=ns.insecure,
        public_cert=getattr(ns, "public_tls_cert", None), public_key=getattr(ns, "public_tls_key", None),
    )
    if security.ca is not None and security.cert is None:
        raise ConfigError("--tls-ca needs --tls-cert and --tls-key: this process serves too, and would serve plaintext")
    if security.roles_file is not None:
        parse_roles(_read(security.roles_file, "--auth-roles-file"), "--auth-roles-file")
    for path, flag in ((security.cert, "--tls-cert"), (security.key, "--tls-key"), (security.ca, "--tls-ca"),
                       (security.public_cert, "--public-tls-cert"), (security.public_key, "--public-tls-key")):
        if path is not None:
            _read(path, flag)
    for cert, key, cert_flag, key_flag in ((security.cert, security.key, "--tls-cert", "--tls-key"),
                                           (security.public_cert, security.public_key, "--public-tls-cert", "--public-tls-key")):
        if cert is not None and key is not None:
            check_server_pair(cert, key, cert_flag, key_flag)
    if security.ca is not None:
        check_ca(security.ca, "--tls-ca")
    metrics_host = getattr(ns, "metrics_host", None)
    if getattr(ns, "metrics_port", None) is not None and metrics_host and not is_loopback(metrics_host) and not ns.insecure:
        # Plain HTTP without authentication: counters only, but nobody's business outside.
        raise ConfigError(f"--metrics-host {metrics_host!r} is not loopback: the metrics endpoint is plain HTTP without "
                          "authentication; serve it on 127.0.0.1, or pass --insecure to serve it there anyway")
    return security


def security_argv(ns: argparse.Namespace) -> list[str]:
    """The security flags of ``ns`` again, for a child process (a prefill worker)."""
    out: list[str] = []
    for dest, flag in _FLAGS:
        value = getattr(ns, dest, None)
        if value is not None:
            out += [flag, str(value)]
    if getattr(ns, "insecure", False):
        out.append("--insecure")
    return out
