"""Peer liveness for backends whose data channel cannot notice a dead peer.

UCX endpoints created with error handling off (the fast shared-memory path) never
report that the process at the other end died: pending requests just never complete.
This module gives such a backend a tiny side channel whose verdict is routed into
:meth:`pdgrpc.transport.base.Transport.fail_peer`:

* every transport instance runs one :class:`Liveness`; ``await start()`` returns its
  ``host:port``, which the backend puts in :attr:`Descriptor.liveness`;
* when a sender connects to a receiver it calls ``await watch(peer_id, address)``: a TCP
  connection is opened to the receiver's liveness port, both ends say their instance id,
  and both send one heartbeat byte every ``interval`` seconds;
* either end declares the other lost when the connection closes (a killed process's
  sockets are closed by its kernel at once, so this takes milliseconds on one host) or
  when nothing arrives for ``lease`` seconds (a hung or unreachable host). The callback
  ``on_lost(peer_instance_id, reason)`` runs once per connection, on the event loop.

So the receiver learns about a dead sender, and the sender about a dead receiver,
without any cooperation from the data channel. ``watch`` of a peer whose liveness port
answers with another instance id (it restarted) reports it lost immediately.

The control plane may also call ``fail_peer`` directly from its own signal (bootstrap
lease); the two are independent.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from typing import Awaitable, Callable, TypeVar

from pdgrpc.errors import ConfigError

_MAGIC = b"PDGL"
_BEAT = b"."
OnLost = Callable[[str, str], None]
T = TypeVar("T")


def _hello(instance_id: str) -> bytes:
    raw = instance_id.encode()
    return _MAGIC + struct.pack("!H", len(raw)) + raw


async def _bounded(aw: Awaitable[T], timeout: float) -> T:
    """``await aw`` for at most ``timeout`` s (raises ``asyncio.TimeoutError``).

    Not ``asyncio.wait_for``: before Python 3.12 it can swallow a cancellation when the
    awaited operation completes at the same moment, which with a steady heartbeat made
    ``close()`` hang."""
    task = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    if not done:
        raise asyncio.TimeoutError()
    return task.result()


async def _read_hello(reader: asyncio.StreamReader, timeout: float) -> str:
    head = await _bounded(reader.readexactly(6), timeout)
    if head[:4] != _MAGIC:
        raise ConnectionError("not a pdgrpc liveness peer")
    (n,) = struct.unpack("!H", head[4:])
    return (await _bounded(reader.readexactly(n), timeout)).decode()


class Liveness:
    """One per transport instance: a heartbeat server plus outgoing watches."""

    def __init__(
        self,
        instance_id: str,
        on_lost: OnLost,
        *,
        host: str = "127.0.0.1",
        interval: float = 0.25,
        lease: float = 1.5,
    ) -> None:
        if not 0 < interval < lease:
            raise ConfigError(f"liveness: need 0 < interval ({interval}) < lease ({lease})")
        self.instance_id = instance_id
        self._on_lost = on_lost
        self._host = host
        self._interval = interval
        self._lease = lease
        self._server: asyncio.Server | None = None
        self._address = ""
        self._tasks: set[asyncio.Task[None]] = set()
        self._watching: dict[str, asyncio.Task[None]] = {}
        self._closed = False

    @property
    def address(self) -> str:
        return self._address

    async def start(self) -> str:
        """Listen (idempotent); returns ``host:port`` for the descriptor."""
        if self._server is None:
            self._server = await asyncio.start_server(self._serve, self._host, 0)
            port = self._server.sockets[0].getsockname()[1]
            self._address = f"{self._host}:{port}"
        return self._address

    async def watch(self, peer_instance_id: str, address: str) -> None:
        """Start heartbeating with ``peer_instance_id`` at ``address`` (idempotent).

        Returns once the peer answered with the expected id; if it cannot be reached or
        is another instance, ``on_lost`` is called and this returns normally."""
        if self._closed or peer_instance_id in self._watching:
            return
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(self._watch(peer_instance_id, address, ready))
        self._watching[peer_instance_id] = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        await asyncio.shield(ready)

    def unwatch(self, peer_instance_id: str) -> None:
        task = self._watching.pop(peer_instance_id, None)
        if task is not None:
            task.cancel()

    async def close(self) -> None:
        self._closed = True
        if self._server is not None:
            self._server.close()
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)
            self._server = None
        self._watching.clear()

    # -- internals -------------------------------------------------------------------
    def _lost(self, peer: str, reason: str) -> None:
        if not self._closed:
            self._on_lost(peer, reason)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)  # type: ignore[arg-type]
        peer = ""
        try:
            peer = await _read_hello(reader, self._lease)
            writer.write(_hello(self.instance_id))
            reason = await self._beat(reader, writer)
            self._lost(peer, reason)
        except asyncio.CancelledError:
            pass
        except (OSError, EOFError, ConnectionError, asyncio.TimeoutError, UnicodeDecodeError) as exc:
            if peer:
                self._lost(peer, f"liveness connection failed: {exc!r}")
        finally:
            writer.close()
            self._tasks.discard(task)  # type: ignore[arg-type]

    async def _watch(self, peer: str, address: str, ready: asyncio.Future[None]) -> None:
        writer: asyncio.StreamWriter | None = None
        try:
            host, _, port = address.rpartition(":")
            reader, w = await _bounded(asyncio.open_connection(host, int(port)), self._lease)
            writer = w
            w.write(_hello(self.instance_id))
            got = await _read_hello(reader, self._lease)
            if got != peer:
                raise ConnectionError(f"liveness port {address} belongs to instance {got}, not {peer} (restarted)")
            ready.set_result(None)
            reason = await self._beat(reader, w)
            self._lost(peer, reason)
        except asyncio.CancelledError:
            pass
        except (OSError, EOFError, ConnectionError, asyncio.TimeoutError, ValueError, UnicodeDecodeError) as exc:
            self._lost(peer, f"peer {peer} unreachable at {address}: {exc!r}")
        finally:
            if not ready.done():
                ready.set_result(None)
            if writer is not None:
                writer.close()
            if self._watching.get(peer) is asyncio.current_task():
                del self._watching[peer]

    async def _beat(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> str:
        """Heartbeat until the peer is lost; returns why."""

        async def send() -> None:
            while True:
                writer.write(_BEAT)
                await writer.drain()
                await asyncio.sleep(self._interval)

        sender = asyncio.create_task(send())
        try:
            while True:
                try:
                    data = await _bounded(reader.read(64), self._lease)
                except asyncio.TimeoutError:
                    return f"no heartbeat for {self._lease:.1f} s"
                except OSError as exc:
                    return f"liveness connection lost: {exc!r}"
                if not data:
                    return "liveness connection closed (peer exited or died)"
                if sender.done():
                    return "liveness connection lost while sending"
        finally:
            sender.cancel()
            with contextlib.suppress(BaseException):
                await sender
