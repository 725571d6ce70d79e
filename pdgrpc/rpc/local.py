"""The local socket: a server's gRPC methods over a framed Unix-domain socket, for callers on its host.

A server started with ``--local-socket PATH`` serves, beside its gRPC port, every method
of its services on a Unix socket at ``PATH`` (:class:`LocalServer`), and a pdgrpc router
told the path (``--prefill HOST:PORT,local=PATH``, ``--decode HOST:PORT,local=PATH``;
the cluster launcher sets both) calls ``Prefill`` and ``Decode`` there
(:class:`LocalChannel`, which stands for a ``grpc.aio`` channel under the generated
stubs). Why: a ``grpc.aio`` call's request crosses gRPC's poller thread and the event
loop on both sides, which on a loaded host costs several times what the same protobuf
messages framed on a socket cost, once each way of every request; smg, other callers
and other hosts keep calling over gRPC.

The same handlers serve both ways: those the gRPC server runs, wrapped as it wraps them
(:class:`~pdgrpc.rpc.limits.UndecodableIsInvalidArgument`: the request's parsing, the
bearer token and its role, the drain). A call ends with the status, message and trailing
metadata its handler chose; a handler that raises ends UNKNOWN, as under grpc.aio. The
caller's deadline travels with the call and is enforced by the caller, which cancels
the call when it passes (DEADLINE_EXCEEDED); a cancelled call cancels its handler. A
connection that closes fails its calls UNAVAILABLE on the caller's side and cancels them
on the server's. Stopping the server closes the socket at once, lets the calls running
finish for its grace and cancels the rest.

Who may connect, and what they may call: the socket file is made mode 0600 in a
directory only its owner may enter (a path elsewhere is refused, naming
``--local-socket``), and each side checks its peer's uid (``SO_PEERCRED``) is its own,
closing the connection otherwise. That uid is the caller's credential, under TLS too: a
process of this user can read the cluster's keys anyway. It makes the caller the router
on this host and nothing more: the socket serves the router's calls alone
(:data:`~pdgrpc.rpc.roles.LOCAL_METHODS`; any other ends PERMISSION_DENIED), and under
mTLS the role check sees the ``router`` role where a certificate would name one (its
name, which per-client limits count by, is ``local router pid N``). The
bearer token, where the server takes one, still applies: it travels in the call's
metadata.

Frames (:mod:`pdgrpc.rpc.frames`):

========  ======================  ==================================================
kind      direction               payload
========  ======================  ==================================================
CALL      caller -> server        u32 length of a JSON head ``[method, timeout
                                  seconds or null, [[key, value], ...]]``, the head,
                                  then the serialized request
CANCEL    caller -> server        empty: the caller gave up
MESSAGE   server -> caller        one serialized response message
END       server -> caller        JSON ``[status code, details, [[key, value], ...]]``
                                  (the trailing metadata): the call is over
========  ======================  ==================================================
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import inspect
import json
import logging
import os
import socket
import stat
import struct
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Generator

import grpc

from pdgrpc.errors import ConfigError
from pdgrpc.rpc.frames import Framed, frame
from pdgrpc.rpc.roles import LOCAL_METHODS, ROLE_URI, ROUTER

__all__ = ["LocalChannel", "LocalServer", "add_local_socket_argument", "configured", "configure"]

log = logging.getLogger("pdgrpc.rpc.local")

CALL, CANCEL, MESSAGE, END = 1, 2, 3, 4
_LEN = struct.Struct("<I")
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_CODES = {code.value[0]: code for code in grpc.StatusCode}
_DEADLINE = "Deadline Exceeded"  # grpc's words
_ROUTER_URI = (ROLE_URI + ROUTER).encode()

Lookup = Callable[[str], "grpc.RpcMethodHandler | None"]

_configured: str | None = None


def add_local_socket_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--local-socket``."""
    parser.add_argument(
        "--local-socket", metavar="PATH", default=None,
        help="also serve this server's methods on a Unix socket at PATH, for a pdgrpc router on this host "
        "(its --prefill/--decode HOST:PORT,local=PATH): cheaper than a gRPC call each way. PATH's directory must "
        "be private to this user (mode 0700); the socket is made 0600, its callers must run as this user and may "
        "call Prefill, PrefillStream and Decode alone, as the router; the bearer token still applies (default: none)",
    )


def configure(path: str | None) -> None:
    """Make ``path`` (``--local-socket``) the local socket this process's server serves."""
    global _configured
    _configured = path


def configured() -> str | None:
    """The local socket this process's server serves (None: none)."""
    return _configured


def _peer(transport: asyncio.BaseTransport) -> tuple[int, int] | None:
    """The peer process's (pid, uid), from the kernel (SO_PEERCRED); None without a socket."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return None
    pid, uid, _gid = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return pid, uid


def _same_user(transport: asyncio.BaseTransport) -> bool:
    peer = _peer(transport)
    return peer is not None and peer[1] == os.getuid()


def _pairs(metadata: Any) -> list[list[str]]:
    return [[str(k), v if isinstance(v, str) else bytes(v).decode("latin-1")] for k, v in metadata or ()]


# ---- the server's side ------------------------------------------------------------------


class _Context:
    """What a handler reads and calls of a ``grpc.aio.ServicerContext``, for a local call."""

    def __init__(self, call: "_ServerConnection", call_id: int, metadata: tuple[tuple[str, str], ...], timeout: float | None,
                 peer: str, request: bytes, parse: Callable[[bytes], Any] | None) -> None:
        self._call = call
        self._id = call_id
        self._metadata = metadata
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._peer = peer
        self._unread: collections.deque[bytes] = collections.deque([request])
        self._parse = parse
        self.code = grpc.StatusCode.OK
        self.details = ""
        self.trailing: tuple[tuple[str, str], ...] = ()
        self.serialize: Callable[[Any], bytes] = lambda m: m
        self.streaming = True  # the handler streams its replies; a unary one sends one, then the END
        self._written = False

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def peer(self) -> str:
        return self._peer

    def auth_context(self) -> dict[str, list[bytes]]:
        return self._call.auth

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> None:
        self.code, self.details = code, details
        if trailing_metadata:
            self.trailing = tuple(trailing_metadata)
        raise grpc.aio.AbortError()

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def set_trailing_metadata(self, metadata: Any) -> None:
        self.trailing = tuple(metadata)

    async def send_initial_metadata(self, metadata: Any) -> None:
        pass  # a local call has no initial metadata to read

    async def write(self, message: Any) -> None:
        data = frame(MESSAGE, self._id, self.serialize(message))
        if self._written or not self.streaming:  # it may share the pass's write with other frames
            self._call.send_soon(data)
        else:  # a stream's first message (its first token): the caller waits on it alone
            self._written = True
            self._call.send(data)

    async def read(self) -> Any:
        if not self._unread:
            return grpc.aio.EOF
        raw = self._unread.popleft()
        return raw if self._parse is None else self._parse(raw)


class _ServerConnection(Framed):
    def __init__(self, server: "LocalServer") -> None:
        super().__init__(f"local socket {server.path}")
        self._server = server
        self.tasks: dict[int, asyncio.Task[None]] = {}
        # The caller's credential, as the role check reads a certificate's: the router
        # role, and a name per process, as each router's certificate has its own.
        self.auth: dict[str, list[bytes]] = {}

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        peer = _peer(transport)
        if peer is None or peer[1] != os.getuid():
            log.warning("%s: refused a connection from another user", self.name)
            transport.close()
            return
        self.auth = {"x509_common_name": [f"local router pid {peer[0]}".encode()], "x509_subject_alternative_name": [_ROUTER_URI]}
        self._server.connections.add(self)

    def send(self, data: bytes) -> None:
        self._send(data)

    def send_soon(self, data: bytes) -> None:
        self._send_soon(data)

    def _frame(self, kind: int, call_id: int, payload: bytes) -> None:
        if kind == CANCEL:
            task = self.tasks.get(call_id)
            if task is not None:
                task.cancel()
            return
        if kind != CALL:
            raise ValueError(f"kind {kind} is not one a caller sends")
        if call_id in self.tasks:
            raise ValueError(f"call id {call_id} is already in flight")
        (size,) = _LEN.unpack_from(payload)
        method, timeout, metadata = json.loads(payload[_LEN.size : _LEN.size + size])
        if not isinstance(method, str) or not (timeout is None or isinstance(timeout, (int, float))):
            raise ValueError("a call head is [method, timeout, metadata]")
        meta = tuple((str(k), str(v)) for k, v in metadata)
        self.tasks[call_id] = asyncio.ensure_future(self._serve(call_id, method, timeout, meta, payload[_LEN.size + size :]))

    async def _serve(self, call_id: int, method: str, timeout: float | None, metadata: tuple[tuple[str, str], ...], request: bytes) -> None:
        served = method in LOCAL_METHODS
        handler = None if self._server.stopping or not served else self._server.lookup(method)
        ctx = _Context(self, call_id, metadata, timeout, f"unix:{self._server.path}", request,
                       None if handler is None else handler.request_deserializer)
        try:
            if not served:
                await ctx.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"{method} is not open to a local socket's caller, the router: it serves {', '.join(sorted(LOCAL_METHODS))}")
            if self._server.stopping:
                await ctx.abort(grpc.StatusCode.UNAVAILABLE, f"{method}: this server is stopping")
            if handler is None:
                await ctx.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
            assert handler is not None
            ctx.serialize = handler.response_serializer or ctx.serialize
            ctx.streaming = handler.response_streaming
            await self._run(handler, ctx)
        except grpc.aio.AbortError:
            pass
        except asyncio.CancelledError:
            return  # the caller cancelled, or went away, or the server stopped: nobody reads an end
        except Exception as exc:
            log.exception("%s: %s failed", self.name, method)
            ctx.code, ctx.details = grpc.StatusCode.UNKNOWN, f"Unexpected {type(exc)}: {exc}"
        finally:
            self.tasks.pop(call_id, None)
        # In the pass's write: after the call's last message, which a unary caller waits for with it.
        self._send_soon(frame(END, call_id, json.dumps([ctx.code.value[0], ctx.details, _pairs(ctx.trailing)]).encode()))

    @staticmethod
    async def _run(handler: grpc.RpcMethodHandler, ctx: _Context) -> None:
        """Run ``handler`` as grpc.aio runs each kind of it, its replies sent through ``ctx``."""
        if handler.request_streaming:

            async def requests() -> AsyncIterator[Any]:
                while (r := await ctx.read()) is not grpc.aio.EOF:
                    yield r

            arg: Any = requests()
            behaviour = handler.stream_stream if handler.response_streaming else handler.stream_unary
        else:
            arg = await ctx.read()
            behaviour = handler.unary_stream if handler.response_streaming else handler.unary_unary
        if not inspect.iscoroutinefunction(behaviour) and not inspect.isasyncgenfunction(behaviour):
            await ctx.abort(grpc.StatusCode.UNIMPLEMENTED, "this method is not served on the local socket")
        if not handler.response_streaming:
            await ctx.write(await behaviour(arg, ctx))
        elif inspect.isasyncgenfunction(behaviour):
            async for item in behaviour(arg, ctx):
                await ctx.write(item)
        else:  # a handler writing with context.write()
            await behaviour(arg, ctx)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._server.connections.discard(self)
        for task in self.tasks.values():
            task.cancel()


class LocalServer:
    """Serves the methods ``lookup`` finds (by ``/service/method``) on the Unix socket ``path``."""

    def __init__(self, path: str, lookup: Lookup) -> None:
        self.path = path
        self.lookup = lookup
        self.connections: set[_ServerConnection] = set()
        self.stopping = False
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        """Listen; ConfigError naming ``--local-socket`` for a path whose directory is
        missing or not private to this user, or that another server listens on."""
        path = Path(self.path)
        try:
            parent = path.parent.stat()
        except OSError as exc:  # a directory that is missing or unreadable: the flag is what to fix
            raise ConfigError(f"--local-socket {self.path!r}: cannot read its directory: {exc.strerror}") from None
        if parent.st_uid != os.getuid() or parent.st_mode & 0o077:
            raise ConfigError(f"--local-socket {self.path!r}: its directory must belong to this user and be closed to others (mode 0700)")
        if path.exists() or path.is_symlink():
            if not stat.S_ISSOCK(path.lstat().st_mode):
                raise ConfigError(f"--local-socket {self.path!r} exists and is not a socket")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(self.path)
            except OSError:
                path.unlink()  # left by a server that is gone
            else:
                raise ConfigError(f"--local-socket {self.path!r}: another server listens there")
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(self.path)
            os.chmod(self.path, 0o600)
        except BaseException:
            sock.close()
            raise
        self._server = await asyncio.get_running_loop().create_unix_server(lambda: _ServerConnection(self), sock=sock)

    async def stop(self, grace: float | None) -> None:
        """Close the socket; let the calls running finish for ``grace`` s, then cancel them."""
        if self._server is None:
            return
        self.stopping = True
        self._server.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        tasks = [t for c in self.connections for t in c.tasks.values()]
        if tasks and grace:
            await asyncio.wait(tasks, timeout=grace)
        for c in list(self.connections):
            c.close_socket()
        self._server = None


# ---- the caller's side ------------------------------------------------------------------


class _Call:
    """One call's replies as they arrive: messages, then its end."""

    def __init__(self) -> None:
        self.messages: collections.deque[bytes] = collections.deque()
        self.end: grpc.aio.AioRpcError | None = None  # None while running; code OK once over
        self.ready = asyncio.Event()
        self.timer: asyncio.TimerHandle | None = None  # the caller's deadline

    def finish(self, code: grpc.StatusCode, details: str, trailing: Any = ()) -> None:
        if self.end is None:
            if self.timer is not None:
                self.timer.cancel()
            self.end = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details)
            self.ready.set()


class _ClientConnection(Framed):
    def __init__(self, path: str) -> None:
        super().__init__(f"local socket {path}")
        self.calls: dict[int, _Call] = {}
        self._next = 0

    def start(self, method: str, timeout: float | None, metadata: Any, request: bytes) -> tuple[int, _Call]:
        self._next += 1
        call = self.calls[self._next] = _Call()
        head = json.dumps([method, timeout, _pairs(metadata)]).encode()
        self._send(frame(CALL, self._next, _LEN.pack(len(head)) + head + request))
        return self._next, call

    def cancel(self, call_id: int) -> None:
        if self.calls.pop(call_id, None) is not None:
            self._send(frame(CANCEL, call_id))

    def _frame(self, kind: int, call_id: int, payload: bytes) -> None:
        if kind not in (MESSAGE, END):
            raise ValueError(f"kind {kind} is not one a server sends")
        call = self.calls.get(call_id)
        if call is None:
            return  # a call this side gave up on
        if kind == MESSAGE:
            call.messages.append(payload)
            call.ready.set()
            return
        del self.calls[call_id]
        code, details, trailing = json.loads(payload)
        call.finish(_CODES.get(code, grpc.StatusCode.UNKNOWN), details, [(k, v) for k, v in trailing])

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        calls, self.calls = self.calls, {}
        for call in calls.values():
            call.finish(grpc.StatusCode.UNAVAILABLE, f"{self.name} closed")

    @property
    def closed(self) -> bool:
        return self._closed


class _LocalCall:
    """A call in flight: on the socket before the caller's next line runs when its channel
    is connected (else a task connects and sends it), so the server starts on it while
    the caller goes on; the caller's deadline cancels it; :meth:`cancel` cancels it on
    the server too."""

    def __init__(self, channel: "LocalChannel", method: str, request: bytes, timeout: float | None, metadata: Any,
                 parse: Callable[[bytes], Any]) -> None:
        self._parse = parse
        self._conn: _ClientConnection | None = None
        self._id = 0
        self._call: _Call | None = None
        self._cancelled = False
        self._deadline_passed = False
        loop = asyncio.get_running_loop()
        self._timer = None if timeout is None else loop.call_later(timeout, self._expired)
        conn = channel.connected()
        self._started: asyncio.Future[_Call]
        if conn is None:
            self._started = asyncio.ensure_future(self._start(channel, method, request, timeout, metadata))
        else:
            self._started = loop.create_future()
            self._started.set_result(self._send(conn, channel, method, request, timeout, metadata))

    async def _start(self, channel: "LocalChannel", method: str, request: bytes, timeout: float | None, metadata: Any) -> _Call:
        conn = await channel.connection()
        if self._cancelled:
            raise asyncio.CancelledError()
        return self._send(conn, channel, method, request, timeout, metadata)

    def _send(self, conn: _ClientConnection, channel: "LocalChannel", method: str, request: bytes, timeout: float | None,
              metadata: Any) -> _Call:
        self._conn = conn
        self._id, self._call = conn.start(method, timeout, (*channel.metadata, *(metadata or ())), request)
        self._call.timer = self._timer
        return self._call

    async def _running(self) -> _Call:
        try:
            return await asyncio.shield(self._started)
        except OSError as exc:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), f"local socket: {exc}") from None

    def _expired(self) -> None:
        self._deadline_passed = True
        self._stop()
        call = self._call
        if call is not None:
            call.finish(grpc.StatusCode.DEADLINE_EXCEEDED, _DEADLINE)
        else:
            self._started.cancel()

    def _stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._conn is not None:
            self._conn.cancel(self._id)

    def cancel(self) -> bool:
        if self._cancelled or (self._call is not None and self._call.end is not None):
            return False
        self._cancelled = True
        self._stop()
        if self._call is not None:
            self._call.finish(grpc.StatusCode.CANCELLED, "Locally cancelled by application!")
        return True

    async def _next(self) -> bytes | None:
        """The next message; None at a successful end; raises the call's failure."""
        if self._cancelled:
            raise asyncio.CancelledError()
        try:
            call = await self._running()
        except asyncio.CancelledError:
            if self._deadline_passed:
                raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(), _DEADLINE) from None
            raise
        while not call.messages and call.end is None:
            call.ready.clear()
            await call.ready.wait()
        if self._cancelled:
            raise asyncio.CancelledError()
        if call.messages:
            return call.messages.popleft()
        assert call.end is not None
        if call.end.code() != grpc.StatusCode.OK:
            raise call.end
        return None


class LocalUnaryCall(_LocalCall):
    def __await__(self) -> Generator[Any, None, Any]:
        return self._reply().__await__()

    async def _reply(self) -> Any:
        raw = await self._next()
        if raw is None:
            raise grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(), "the call ended without a reply")
        if await self._next() is not None:
            raise grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(), "a unary call got two replies")
        return self._parse(raw)


class LocalStreamCall(_LocalCall):
    async def read(self) -> Any:
        raw = await self._next()
        return grpc.aio.EOF if raw is None else self._parse(raw)

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._messages()

    async def _messages(self) -> AsyncIterator[Any]:
        while (m := await self.read()) is not grpc.aio.EOF:
            yield m


class LocalChannel:
    """Calls to the :class:`LocalServer` at ``path``, as a ``grpc.aio`` channel makes them
    for the generated stubs (unary and server-streaming methods); ``metadata`` goes with
    every call (the process's bearer token)."""

    def __init__(self, path: str, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.path = path
        self.metadata = metadata
        self._conn: _ClientConnection | None = None
        self._connecting: asyncio.Future[_ClientConnection] | None = None

    def connected(self) -> _ClientConnection | None:
        """The open connection; None before the first call connects, or once it closed."""
        return self._conn if self._conn is not None and not self._conn.closed else None

    async def connection(self) -> _ClientConnection:
        conn = self.connected()
        if conn is not None:
            return conn
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
            self._connecting.add_done_callback(self._connected)
        return await asyncio.shield(self._connecting)

    def _connected(self, fut: asyncio.Future[_ClientConnection]) -> None:
        self._connecting = None
        if not fut.cancelled() and fut.exception() is None:
            self._conn = fut.result()

    async def _connect(self) -> _ClientConnection:
        transport, conn = await asyncio.get_running_loop().create_unix_connection(lambda: _ClientConnection(self.path), self.path)
        if not _same_user(transport):
            transport.close()
            raise ConnectionRefusedError(f"{self.path} is served by another user")
        return conn

    def unary_unary(self, method: str, request_serializer: Callable[[Any], bytes], response_deserializer: Callable[[bytes], Any],
                    **_: Any) -> Callable[..., LocalUnaryCall]:
        return lambda request, timeout=None, metadata=None, **__: LocalUnaryCall(
            self, method, request_serializer(request), timeout, metadata, response_deserializer)

    def unary_stream(self, method: str, request_serializer: Callable[[Any], bytes], response_deserializer: Callable[[bytes], Any],
                     **_: Any) -> Callable[..., LocalStreamCall]:
        return lambda request, timeout=None, metadata=None, **__: LocalStreamCall(
            self, method, request_serializer(request), timeout, metadata, response_deserializer)

    def stream_unary(self, method: str, *_: Any, **__: Any) -> Callable[..., Any]:
        return _unsupported(method)

    def stream_stream(self, method: str, *_: Any, **__: Any) -> Callable[..., Any]:
        return _unsupported(method)

    async def close(self) -> None:
        if self._conn is not None:
            self._conn.close_socket()
            self._conn = None


def _unsupported(method: str) -> Callable[..., Any]:
    def call(*_: Any, **__: Any) -> Any:
        raise NotImplementedError(f"{method} streams its requests: call it over gRPC")

    return call
