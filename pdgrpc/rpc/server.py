"""Starting, running and stopping a pdgrpc ``grpc.aio`` server.

Every pdgrpc server (bootstrap, and later prefill, decode, router) is started the same
way::

    server = await start_server([(name, register)], host="127.0.0.1", port=0)
    ...                                  # server.port is the bound port
    await server.stop(grace=5.0)

or, as a process's main (``run(main())``)::

    stop = StopSignal()                  # SIGTERM/SIGINT now request a graceful stop
    server = await start_server(...)
    await serve_until_signal(server, grace=5.0, stop=stop, drain_timeout=30.0)

Each server gets:

* the standard ``grpc.health.v1.Health`` service: overall status ``""`` and each named
  service ``SERVING`` while it runs, ``NOT_SERVING`` once it starts shutting down
  (a server started with ``serving=False`` reports ``NOT_SERVING`` until
  :meth:`RpcServer.set_serving`: e.g. a prefill controller whose workers still start);
* server reflection, listing the named services (``grpcurl``, ``grpc_cli`` work);
* the process's security (:mod:`pdgrpc.rpc.security`, or ``security=``): TLS or mTLS,
  a bearer-token check; a non-loopback ``host`` with neither is refused unless insecure;
* with ``gateway_listen`` (``--gateway-listen``), a second listener on loopback only,
  plaintext, serving the same services to callers that are the ``gateway`` role alone
  (smg, which presents no credential) and local processes of this server's user or of
  ``gateway_uids`` (``--gateway-uid``; :mod:`pdgrpc.rpc.loopback_peer`);
* one INFO log line ``<what> listening on <host>:<port> (...)``, or an :class:`OSError`
  ``<what>: cannot bind <host>:<port> (--host H --port P): <reason>`` naming the settings
  the address came from (``flags``) and why the OS refused it;
* graceful drain (:mod:`pdgrpc.rpc.drain`): on SIGTERM or SIGINT (:func:`serve_until_signal`)
  or a ``DrainService.Drain`` call, health turns NOT_SERVING, new Prefill, Decode and
  Generate calls end UNAVAILABLE, and the server stops once those in flight finished and
  it refused a moment more (:data:`~pdgrpc.rpc.drain.LINGER_S`), bounded by the drain
  timeout; other calls then get ``grace`` seconds;
* with ``local_socket`` (or the process's ``--local-socket``), the router's calls of these
  services on a Unix socket, for a router on this host of the same user, whatever the
  security (:mod:`pdgrpc.rpc.local`), closed as the server stops;
* the bounds of :mod:`pdgrpc.rpc.limits`: a message size sized to the largest legitimate
  request, and INVALID_ARGUMENT for a request that does not parse; at most
  :func:`incoming_connection_cap` connections, each through its handshakes within
  :data:`HANDSHAKE_TIMEOUT_S`.

:func:`run` runs a coroutine on uvloop when it is installed, else on asyncio's loop.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import inspect
import logging
import resource
import signal
import socket
from typing import Any, Awaitable, Callable, Collection, Coroutine, Iterable, Sequence, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from pdgrpc.rpc.drain import DEFAULT_DRAIN_TIMEOUT_S, Drain, DrainServicer, drain_wrapper
from pdgrpc.rpc.drain import SERVICE_NAME as DRAIN_SERVICE
from pdgrpc.errors import ConfigError
from pdgrpc.rpc.limits import MAX_MESSAGE_BYTES, HandlerWrapper, UndecodableIsInvalidArgument
from pdgrpc.rpc.local import LocalServer, configured
from pdgrpc.rpc.loopback_peer import LocalUsers
from pdgrpc.rpc.security import Security, current, gateway_handler_wrapper, loopback_address
from pdgrpc.v1 import drain_pb2_grpc

log = logging.getLogger("pdgrpc.rpc")

T = TypeVar("T")

def incoming_connection_cap() -> int:
    """Most connections one server keeps open: half the process's descriptors (its soft
    limit), so a flood of connections leaves it the rest for its data plane, its files
    and its own calls. grpc has no cap per address; past this one it closes new
    connections at once."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(16, (soft if soft != resource.RLIM_INFINITY else 1 << 20) // 2)


# Sized to the largest legitimate message: see pdgrpc.rpc.limits.
HANDSHAKE_TIMEOUT_S = 5.0  # a new connection's TLS and HTTP/2 handshakes, at most (grpc's default: 120 s)
DEFAULT_SERVER_OPTIONS: tuple[tuple[str, int | str], ...] = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # A fixed receive window per call, not one grown by bandwidth probes: what a caller
    # can make the server buffer before its token or role is checked stays one window.
    ("grpc.http2.bdp_probe", 0),
    ("grpc.http2.lookahead_bytes", 1 << 20),
    # Let clients keep idle connections alive with pings every 30 s.
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    # A connection that has not finished its TLS and HTTP/2 handshakes by then is closed:
    # half-open connections cannot pile up into the process's file descriptors.
    ("grpc.server_handshake_timeout_ms", int(HANDSHAKE_TIMEOUT_S * 1000)),
    ("grpc.max_allowed_incoming_connections", incoming_connection_cap()),
    # gRPC sets SO_REUSEPORT by default: a second server given the same port then binds
    # "successfully" and the kernel splits new connections between the two, so clients
    # of one get UNIMPLEMENTED from the other. A clash must fail the bind instead.
    ("grpc.so_reuseport", 0),
)

# (full service name, function adding the servicer to a server)
ServiceSpec = tuple[str, Callable[[grpc.aio.Server], None]]


def loop_name() -> str:
    loop = asyncio.get_running_loop()
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion on uvloop if it is installed, else on asyncio."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        return asyncio.run(main)
    return uvloop.run(main)


class RpcServer:
    """A started ``grpc.aio`` server with health and reflection. See the module doc."""

    def __init__(
        self, server: grpc.aio.Server, health_servicer: health.aio.HealthServicer, host: str, port: int, services: Sequence[str],
        drain: Drain | None = None, gateway: grpc.aio.Server | None = None, local: LocalServer | None = None,
    ) -> None:
        self.server = server
        self.local = local  # the same services on a Unix socket (pdgrpc.rpc.local)
        # The gateway listener (--gateway-listen): the same services, to the gateway role alone.
        self.gateway = gateway
        self.gateway_address: str | None = None
        self.health = health_servicer
        self.host = host
        self.port = port
        self.services = tuple(services)
        self.gate = drain or Drain()
        # Seconds a drain waits for the entry calls in flight (--drain-timeout).
        self.drain_timeout = DEFAULT_DRAIN_TIMEOUT_S
        # Seconds the calls still open get once the drain ended (--grace).
        self.grace = 5.0
        self._stopped: asyncio.Event = asyncio.Event()
        self._on_stop: list[Callable[[], Coroutine[Any, Any, None]]] = []
        self._on_drain: list[Callable[[], Awaitable[None] | None]] = []
        self._drained = False
        self._draining: asyncio.Task[None] | None = None

    @property
    def address(self) -> str:
        """``host:port`` a client on this machine can dial."""
        host = self.host
        if host in ("0.0.0.0", "", "[::]", "::"):
            host = "127.0.0.1"
        return f"{host}:{self.port}"

    def on_stop(self, callback: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Await ``callback()`` when the server stops, before the transport closes."""
        self._on_stop.append(callback)

    def on_drain(self, callback: Callable[[], Awaitable[None] | None]) -> None:
        """Call (and await) ``callback()`` once, as the server starts to drain or, without
        a drain, to stop: e.g. revoke its discovery lease, so routers stop choosing it."""
        self._on_drain.append(callback)

    async def _announce_drain(self) -> None:
        if self._drained:
            return
        self._drained = True
        await self.health.enter_graceful_shutdown()
        for callback in self._on_drain:
            result = callback()
            if inspect.isawaitable(result):
                await result

    def start_drain(self, timeout: float | None = None) -> float:
        """Start draining (see :meth:`drain`) in the background, unless it started
        already; returns the seconds it waits at most."""
        if self._draining is None and not self._stopped.is_set():
            self._draining = asyncio.ensure_future(self.drain(timeout))
        return self.drain_timeout if timeout is None else timeout

    async def drain(self, timeout: float | None = None) -> None:
        """NOT_SERVING and the drain callbacks, refuse new entry calls, wait up to
        ``timeout`` s (default :attr:`drain_timeout`) for those in flight, then stop
        (:mod:`pdgrpc.rpc.drain`)."""
        if self._stopped.is_set():
            return
        timeout = self.drain_timeout if timeout is None else timeout
        self.gate.start()
        log.info("draining: %d call(s) in flight, waiting up to %.1f s", self.gate.in_flight, timeout)
        await self._announce_drain()
        ended = await self.gate.wait(timeout)
        log.info("drained%s; stopping", "" if not ended else f" ({ended} call(s) ended: drain_timeout)")
        await self.stop(self.grace)

    async def set_serving(self, services: Iterable[str] | None = None) -> None:
        """Report SERVING for ``services`` (default: every service and the overall ``""``).
        A no-op once the server is stopping: shutdown's NOT_SERVING wins."""
        if self._stopped.is_set():
            return
        for name in ("", *self.services) if services is None else services:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def stop(self, grace: float | None = 5.0) -> None:
        """Report NOT_SERVING, then stop, letting in-flight calls run up to ``grace`` s."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        await self._announce_drain()
        for callback in self._on_stop:
            await callback()
        await asyncio.gather(*(s.stop(grace) for s in self._servers()), *([] if self.local is None else [self.local.stop(grace)]))

    async def wait_stopped(self) -> None:
        await self._stopped.wait()
        for server in self._servers():
            await server.wait_for_termination()

    def _servers(self) -> list[grpc.aio.Server]:
        return [self.server] if self.gateway is None else [self.server, self.gateway]


async def _start_whole(server: grpc.aio.Server) -> None:
    """Start ``server``; a cancellation meanwhile (Ctrl-C at start-up) lets the start
    finish, stops the server and goes on: grpc.aio's start cut half-way leaves its serving
    loop in a state that it reports at exit with a traceback."""
    start = asyncio.ensure_future(server.start())
    try:
        await asyncio.shield(start)
    except asyncio.CancelledError:
        await asyncio.gather(start, return_exceptions=True)
        await server.stop(0)
        raise


async def start_server(
    services: Iterable[ServiceSpec],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    options: Sequence[tuple[str, int | str]] = DEFAULT_SERVER_OPTIONS,
    what: str = "pdgrpc server",
    serving: bool = True,
    security: Security | None = None,
    drain: Drain | None = None,
    gateway_listen: str | None = None,
    gateway_uids: Collection[int] = (),
    local_socket: str | None = None,
    flags: tuple[str, str] = ("--host", "--port"),
) -> RpcServer:
    """Create, bind and start a ``grpc.aio`` server serving ``services`` plus health
    and reflection. ``port=0`` picks a free port (``RpcServer.port``). ``serving=False``:
    health reports NOT_SERVING (calls are still answered) until ``set_serving()``.
    ``drain``: the server's drain, for a service that reports it (made here without).
    ``gateway_listen``: ``HOST:PORT`` on loopback where the same services are also served
    in plaintext to the ``gateway`` role alone (:attr:`RpcServer.gateway_address`), for
    local processes of this server's user and of ``gateway_uids``.
    ``local_socket``: also serve the services there (:mod:`pdgrpc.rpc.local`; default: the
    process's ``--local-socket``). ``flags``: the settings ``host`` and ``port`` come from,
    which a bind failure names."""
    services = list(services)
    security = security or current()
    security.check_listen(host, what)
    local_path = local_socket or configured()
    gateway_bind = None
    if gateway_listen is not None:
        try:
            gateway_bind = loopback_address(gateway_listen)
        except ValueError as exc:
            raise ConfigError(f"--gateway-listen: {exc}") from None
    elif gateway_uids:
        raise ConfigError("--gateway-uid: names who may call the gateway listener, so it needs --gateway-listen")
    credentials = security.server_credentials()
    drain = Drain() if drain is None else drain
    rpc: RpcServer | None = None
    drain_servicer = DrainServicer(drain, lambda timeout: _started(rpc, timeout))
    services.append((DRAIN_SERVICE, lambda s: drain_pb2_grpc.add_DrainServiceServicer_to_server(drain_servicer, s)))
    names = [name for name, _add in services]
    health_servicer = health.aio.HealthServicer()
    # No per-call interceptor: every service (health and reflection too) is added
    # through a view that wraps its handlers once: undecodable requests end
    # INVALID_ARGUMENT (pdgrpc.rpc.limits), and where a token is set, calls without it
    # end UNAUTHENTICATED before their request is parsed (pdgrpc.rpc.security).
    server, handlers = _server(services, health_servicer, options, drain_wrapper(drain, security.server_handler_wrapper()))
    bound = _bind(server, host, port, credentials, what, f"{flags[0]} {host} {flags[1]} {port}")
    gateway: grpc.aio.Server | None = None
    gateway_port = 0
    if gateway_bind is not None:
        # The same servicers, drain and health on a second server whose callers are the
        # gateway role alone: smg presents no credential, and reaches only what it calls.
        users = LocalUsers(gateway_uids)
        gateway, _ = _server(services, health_servicer, options, drain_wrapper(drain, gateway_handler_wrapper(users)))
        gateway_port = _bind(gateway, gateway_bind[0], gateway_bind[1], None, f"{what} gateway listener", f"--gateway-listen {gateway_listen}")
        users.listening(gateway_bind[0], gateway_port)
    await _start_whole(server)
    if gateway is not None:
        try:
            await _start_whole(gateway)
        except BaseException:
            await server.stop(0)
            raise
    local = None
    if local_path:
        local = LocalServer(local_path, handlers.get)
        try:
            await local.start()
        except BaseException:
            await asyncio.gather(*(s.stop(0) for s in (server, gateway) if s is not None))
            raise
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", *names):
        await health_servicer.set(name, status)
    rpc = RpcServer(server, health_servicer, host, bound, names, drain, gateway=gateway, local=local)
    tls = "plaintext" if credentials is None else "mTLS" if security.ca is not None else "TLS"
    auth = ", bearer token" if security.token_file is not None or security.roles_file is not None else ""
    auth += ", role tokens" if security.roles_file is not None else ""
    also = "" if local is None else f"; also on local socket {local.path}"
    log.info("%s listening on %s (grpc.aio on %s, %s%s; services: %s%s)", what, f"{host}:{bound}", loop_name(), tls, auth, ", ".join(names), also)
    if gateway_bind is not None:
        rpc.gateway_address = f"{gateway_bind[0]}:{gateway_port}"
        log.info("%s gateway listener on %s (plaintext, loopback only; every caller has the gateway role alone; local users: %s)",
                 what, rpc.gateway_address, ", ".join(map(str, sorted(users.uids))))
    return rpc


def _server(
    services: Sequence[ServiceSpec], health_servicer: health.aio.HealthServicer, options: Sequence[tuple[str, int | str]],
    wrapper: HandlerWrapper,
) -> tuple[grpc.aio.Server, dict[str, grpc.RpcMethodHandler]]:
    """A ``grpc.aio`` server with ``services``, health and reflection, each handler wrapped
    once in ``wrapper``; and the services' handlers as it runs them, by ``/service/method``."""
    server = grpc.aio.server(options=list(options))
    wrapping = UndecodableIsInvalidArgument(server, wrapper)
    for _name, add in services:
        add(wrapping)  # stands for the server: see UndecodableIsInvalidArgument
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, wrapping)
    # What reflection.enable_server_reflection does for a grpc.aio server, through the view.
    names = [name for name, _add in services]
    reflecting = reflection.aio.ReflectionServicer([*names, health.SERVICE_NAME, reflection.SERVICE_NAME])
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(reflecting, wrapping)
    return server, wrapping.handlers


def _bind(server: grpc.aio.Server, host: str, port: int, credentials: Any, what: str, settings: str) -> int:
    """Bind ``server`` to ``host:port`` (TLS with ``credentials``, else plaintext); the bound
    port. An OSError names ``settings``, what the user set the address with."""
    bind = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(bind) if credentials is None else server.add_secure_port(bind, credentials)
    except RuntimeError:  # grpc's way of saying "bind failed" (the reason is only on its stderr)
        bound = 0
    if bound == 0:
        raise OSError(f"{what}: cannot bind {bind} ({settings}): {_bind_failure(host, port)}")
    return int(bound)


# What a user makes of a bind's errno.
_BIND_ERRNOS = {errno.EADDRINUSE: "address in use", errno.EADDRNOTAVAIL: "not an address of this host",
                errno.EACCES: "permission denied (a port below 1024 needs privileges)"}


def _bind_failure(host: str, port: int) -> str:
    """Why ``host:port`` cannot be bound, found by binding a plain socket there as grpc
    does (grpc gives no reason); a generic reason where that socket binds after all."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return "unknown host"
    for family, kind, proto, _name, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                return _BIND_ERRNOS.get(exc.errno or 0, exc.strerror or str(exc))
    return "address in use, or not an address of this host"


def _started(rpc: RpcServer | None, timeout: float | None) -> float:
    assert rpc is not None  # calls are served only once the server started
    return rpc.start_drain(timeout)


class StopSignal:
    """SIGTERM/SIGINT handlers that request a stop instead of killing the process.

    Create it before starting a server so that a signal arriving during start-up is not
    lost (it would otherwise kill the process), then pass it to
    :func:`serve_until_signal`. Must be created in the running loop's main thread.
    """

    def __init__(self, signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT)) -> None:
        self._loop = asyncio.get_running_loop()
        self._signals = tuple(signals)
        self.requested: asyncio.Future[int] = self._loop.create_future()
        for s in self._signals:
            self._loop.add_signal_handler(s, self._on_signal, s)

    def _on_signal(self, signum: int) -> None:
        if not self.requested.done():
            self.requested.set_result(signum)

    def close(self) -> None:
        """Restore the default handlers."""
        for s in self._signals:
            self._loop.remove_signal_handler(s)


async def serve_until_signal(
    server: RpcServer, grace: float = 5.0, signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT), stop: StopSignal | None = None,
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S,
) -> None:
    """Serve until SIGTERM/SIGINT (or until something else stops the server: a
    ``DrainService.Drain`` call), then drain (:meth:`RpcServer.drain`, up to
    ``drain_timeout`` s) and stop, giving the calls still open ``grace`` s. A second signal
    while stopping is ignored. ``stop``: handlers installed earlier (see
    :class:`StopSignal`); else installed now."""
    stop = stop or StopSignal(signals)
    # What start-up built (modules, engine, servicers) lives as long as the process: frozen,
    # no collection scans it again, so a full collection on the request path stays short.
    gc.freeze()
    server.drain_timeout = drain_timeout
    server.grace = grace
    try:
        stopped: asyncio.Future[None] = asyncio.ensure_future(server.wait_stopped())
        waiting: list[asyncio.Future[Any]] = [stop.requested, stopped]
        try:
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            # The process stops without a drain (a signal that came before these handlers,
            # pdgrpc.serving.launch): the server stops at once, and its on_stop callbacks
            # release what the role started.
            await server.stop(0)
            raise
        if stop.requested.done():
            log.info("%s received, stopping: draining up to %.1f s", signal.Signals(stop.requested.result()).name, drain_timeout)
            server.start_drain()
        await stopped
    finally:
        stop.close()
