"""Peer liveness on a side channel, for backends whose data path cannot see a dead peer
(``rdma``: UCX endpoint error handling is off).

Each transport instance runs one :class:`Liveness`: a listener whose ``host:port``
travels in :attr:`Descriptor.liveness`, plus one outgoing link per watched peer. A link
starts with a ``PDGL`` hello naming the instance id and carrying an opaque ``info`` blob
(``!H`` length + bytes after the id), then one heartbeat byte every ``interval``; a peer
is lost when the socket closes (its process died: the kernel closes it) or nothing
arrives for ``lease`` seconds (it hangs).

The rdma backend puts its UCX worker address in ``info``, so each side checks that the
worker address it is about to hand to UCX is the one the live peer process announces
for itself: UCX aborts the whole process on a malformed address, so an address taken
from untrusted bytes never reaches it unchecked.

Raw non-blocking sockets with reader callbacks and timers, not asyncio streams: no task
per link, and under uvloop the first stream transport makes uvloop keep a private
``/dev/null`` descriptor for the life of the process, which looks like a leaked
descriptor to the conformance suite.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import time
from typing import Callable

from pdgrpc.errors import ConfigError

log = logging.getLogger("pdgrpc.transport.liveness")

_MAGIC = b"PDGL"
_BEAT = b"."
_HELLO_HEAD = 6  # magic + u16 length
OnLost = Callable[[str, str], None]


def _hello(instance_id: str, info: bytes) -> bytes:
    raw = instance_id.encode()
    return _MAGIC + struct.pack("!H", len(raw)) + raw + struct.pack("!H", len(info)) + info


class _Link:
    """One liveness connection (accepted, or opened by ``watch``)."""

    def __init__(self, owner: "Liveness", sock: socket.socket, expect: str | None, watched: bool) -> None:
        self.owner = owner
        self.sock = sock
        self.expect = expect  # instance id the peer must announce (watch side)
        self.watched = watched
        self.peer = ""  # known once the peer's hello arrived
        self.peer_info = b""
        self.buf = b""
        self.last_seen = time.monotonic()
        self.ready: asyncio.Future[None] = owner.loop.create_future()
        self.timer: asyncio.TimerHandle | None = None
        self.closed = False
        owner.loop.add_reader(sock.fileno(), self.on_readable)
        self.timer = owner.loop.call_later(owner.interval, self.on_tick)

    def send(self, data: bytes) -> None:
        try:
            self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            pass  # a full buffer still means the connection is alive; skip this beat
        except OSError as exc:
            self.lost(f"liveness connection lost: {exc!r}")

    def on_readable(self) -> None:
        try:
            data = self.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self.lost(f"liveness connection lost: {exc!r}")
            return
        if not data:
            self.lost("liveness connection closed (peer exited or died)")
            return
        self.last_seen = time.monotonic()
        if self.peer:
            return  # heartbeat bytes: only their arrival matters
        self.buf += data
        if len(self.buf) < _HELLO_HEAD:
            return
        if self.buf[:4] != _MAGIC:
            self.lost("not a pdgrpc liveness peer")
            return
        (n,) = struct.unpack("!H", self.buf[4:6])
        if len(self.buf) < _HELLO_HEAD + n + 2:
            return
        (m,) = struct.unpack("!H", self.buf[_HELLO_HEAD + n : _HELLO_HEAD + n + 2])
        if len(self.buf) < _HELLO_HEAD + n + 2 + m:
            return
        try:
            peer = self.buf[_HELLO_HEAD : _HELLO_HEAD + n].decode()
        except UnicodeDecodeError:
            self.lost("liveness hello is not valid UTF-8")
            return
        self.peer_info = self.buf[_HELLO_HEAD + n + 2 : _HELLO_HEAD + n + 2 + m]
        self.buf = b""
        if self.expect is not None and peer != self.expect:
            self.peer = self.expect
            self.lost(f"liveness port belongs to instance {peer}, not {self.expect} (restarted)")
            return
        self.peer = peer
        if not self.watched:
            self.send(_hello(self.owner.instance_id, self.owner.info))
        if not self.ready.done():
            self.ready.set_result(None)

    def on_tick(self) -> None:
        if self.closed:
            return
        if time.monotonic() - self.last_seen > self.owner.lease:
            self.lost(f"no heartbeat for {self.owner.lease:.1f} s")
            return
        if self.peer:
            self.send(_BEAT)
        self.timer = self.owner.loop.call_later(self.owner.interval, self.on_tick)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
        try:
            self.owner.loop.remove_reader(self.sock.fileno())
        except (ValueError, OSError):
            pass
        self.sock.close()
        if not self.ready.done():
            self.ready.set_result(None)
        self.owner.links.discard(self)
        if self.watched and self.owner.watching.get(self.expect or "") is self:
            del self.owner.watching[self.expect or ""]

    def lost(self, reason: str) -> None:
        peer = self.peer or (self.expect or "")
        was_closed = self.closed
        self.close()
        if was_closed or not peer or self.owner.closed:
            return
        if not self.watched and self.owner.live_link(peer) is not None:
            # An accepted link only claims its id: its loss says nothing about a peer
            # that is still up on another link (a forged hello, then a close, must not
            # drop the real peer).
            log.warning("liveness: a link claiming %s closed (%s); %s is still live on another link",
                        peer, reason, peer)
            return
        self.owner.on_lost(peer, reason)


class Liveness:
    """One per transport instance: a heartbeat listener plus outgoing watches.

    ``await start()`` returns ``host:port`` for :attr:`Descriptor.liveness`;
    ``await watch(peer_id, address)`` returns once the peer answered with the expected
    id (or, if it cannot be reached or is another instance, after ``on_lost`` ran);
    ``on_lost(peer_instance_id, reason)`` runs once per link, on the event loop.
    """

    def __init__(self, instance_id: str, on_lost: OnLost, *, info: bytes = b"", host: str = "127.0.0.1",
                 interval: float = 0.25, lease: float = 1.5) -> None:
        if not 0 < interval < lease:
            raise ConfigError(f"liveness: need 0 < interval ({interval}) < lease ({lease})")
        if len(info) > 0xFFFF:
            raise ConfigError(f"liveness: info of {len(info)} bytes does not fit the hello")
        self.instance_id = instance_id
        self.info = info
        self.on_lost = on_lost
        self.host = host
        self.interval = interval
        self.lease = lease
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]  # set by start()
        self.listener: socket.socket | None = None
        self.links: set[_Link] = set()
        self.watching: dict[str, _Link] = {}
        self.closed = False
        self._address = ""

    @property
    def address(self) -> str:
        return self._address

    async def start(self) -> str:
        if self.listener is None:
            self.loop = asyncio.get_running_loop()
            family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
            ls = socket.socket(family, socket.SOCK_STREAM)
            try:
                ls.bind((self.host, 0))
                ls.listen(64)
                ls.setblocking(False)
            except OSError:
                ls.close()
                raise
            self.listener = ls
            self.loop.add_reader(ls.fileno(), self._on_accept)
            port = ls.getsockname()[1]
            self._address = f"[{self.host}]:{port}" if family == socket.AF_INET6 else f"{self.host}:{port}"
        return self._address

    def _on_accept(self) -> None:
        assert self.listener is not None
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            sock.setblocking(False)
            self.links.add(_Link(self, sock, None, watched=False))

    async def watch(self, peer_instance_id: str, address: str) -> bytes | None:
        """Returns the peer's ``info`` once it answered as ``peer_instance_id``; None if
        it could not be reached or is another instance (``on_lost`` has run then)."""
        if self.closed:
            return None
        existing = self.watching.get(peer_instance_id)
        if existing is not None:
            await asyncio.wait_for(asyncio.shield(existing.ready), self.lease)
            return existing.peer_info if not existing.closed else None
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        host, _, port_s = address.rpartition(":")
        host = host.strip("[]")
        try:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError as exc:
            self.on_lost(peer_instance_id, f"peer {peer_instance_id}: cannot open a liveness socket: {exc!r}")
            return None
        sock.setblocking(False)
        try:
            await asyncio.wait_for(self.loop.sock_connect(sock, (host, int(port_s))), self.lease)
        except (OSError, ValueError, asyncio.TimeoutError) as exc:
            sock.close()
            self.on_lost(peer_instance_id, f"peer {peer_instance_id} unreachable at {address}: {exc!r}")
            return None
        except BaseException:
            sock.close()
            raise
        if self.closed:
            sock.close()
            return None
        link = _Link(self, sock, peer_instance_id, watched=True)
        self.links.add(link)
        self.watching[peer_instance_id] = link
        link.send(_hello(self.instance_id, self.info))
        try:
            await asyncio.wait_for(asyncio.shield(link.ready), self.lease)
        except asyncio.TimeoutError:
            link.lost(f"peer {peer_instance_id} at {address} did not answer the liveness hello")
        return link.peer_info if not link.closed else None

    def live_link(self, peer_instance_id: str) -> "_Link | None":
        """A live link on which a peer announced that instance id, if any."""
        for link in self.links:
            if link.peer == peer_instance_id and not link.closed and link.ready.done():
                return link
        return None

    def peer_info(self, peer_instance_id: str) -> bytes | None:
        """``info`` announced by a live peer with that instance id (on any link)."""
        link = self.live_link(peer_instance_id)
        return None if link is None else link.peer_info

    def unwatch(self, peer_instance_id: str) -> None:
        link = self.watching.pop(peer_instance_id, None)
        if link is not None:
            link.close()

    async def close(self) -> None:
        self.closed = True
        for link in list(self.links):
            link.close()
        self.watching.clear()
        if self.listener is not None:
            try:
                self.loop.remove_reader(self.listener.fileno())
            except (ValueError, OSError):
                pass
            self.listener.close()
            self.listener = None
