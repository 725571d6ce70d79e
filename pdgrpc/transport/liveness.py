"""Peer liveness on a side channel, for backends whose data path cannot see a dead peer
(``rdma``: UCX endpoint error handling is off).

Each transport instance runs one :class:`Liveness`: a listener whose ``host:port``
travels in :attr:`Descriptor.liveness`, plus one outgoing link per watched peer. The
listener opens every accepted link with a ``PDGN`` challenge (a fresh 16-byte nonce, then
its own instance id, ``!H`` length + bytes: a watcher that finds another instance there
reports the peer restarted and proves nothing to it). The
watching side answers with a ``PDGL`` hello naming its instance id, carrying an opaque
``info`` blob and a proof (each ``!H`` length + bytes): the nonce signed with the
credential the listening side issued to it over the control plane
(:mod:`pdgrpc.transport.peerauth`). The listener takes the id only once the proof
verifies; a link that fails it is closed and reported to nobody, so a claimed id (ids are
public) can neither drop a peer nor keep a dead one looking alive. The listener answers
with its own hello (no proof), then both send one heartbeat byte every ``interval``; a
peer is lost when the socket closes (its process died: the kernel closes it) or nothing
arrives for ``lease`` seconds (it hangs). An accepted link must prove itself within
``lease`` of its accept, however it trickles bytes, and at most
:data:`MAX_UNPROVEN_LINKS` accepted links wait for their proof (a new one displaces the
oldest), so sockets that never prove anything cannot pile up or keep a real peer out.

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
from typing import Callable, Protocol

from pdgrpc.errors import ConfigError
from pdgrpc.transport import peerauth

log = logging.getLogger("pdgrpc.transport.liveness")

_MAGIC = b"PDGL"
_CHALLENGE = b"PDGN"
_BEAT = b"."
_CHALLENGE_LEN = len(_CHALLENGE) + peerauth.NONCE_BYTES
_MAX_HELLO = 3 * 0xFFFF + 12  # a longer hello is not a pdgrpc peer's
CHANNEL = b"liveness"  # the peerauth channel name of these links
OnLost = Callable[[str, str], None]
MAX_UNPROVEN_LINKS = 64  # accepted links not yet proven; a new one displaces the oldest


def _hello(instance_id: str, info: bytes, proof: bytes = b"") -> bytes:
    raw = instance_id.encode()
    return (_MAGIC + struct.pack("!H", len(raw)) + raw + struct.pack("!H", len(info)) + info
            + struct.pack("!H", len(proof)) + proof)


def _parse_hello(buf: bytes) -> tuple[str, bytes, bytes, int] | None:
    """(instance id, info, proof, bytes used) of a complete hello at the start of ``buf``;
    None while incomplete. Raises ValueError for bytes that are not a hello."""
    if buf[:4] != _MAGIC[: len(buf[:4])]:
        raise ValueError("not a pdgrpc liveness peer")
    fields, off = [], 4
    for _ in range(3):
        if len(buf) < off + 2:
            return None
        (n,) = struct.unpack_from("!H", buf, off)
        if len(buf) < off + 2 + n:
            return None
        fields.append(buf[off + 2 : off + 2 + n])
        off += 2 + n
    return fields[0].decode(), fields[1], fields[2], off


class _LinkEvents(Protocol):
    """What a link asks of its :class:`Liveness`: the bytes it greets with, whether a
    proof admits a peer, and what to do when the link closes or is lost."""

    def challenge(self, nonce: bytes) -> bytes: ...
    def hello(self, peer: str = "", nonce: bytes = b"") -> bytes: ...
    def admit(self, nonce: bytes, peer: str, proof: bytes) -> bool: ...
    def link_closed(self, link: _Link, by_peer: bool) -> None: ...
    def link_lost(self, link: _Link, peer: str, reason: str) -> None: ...


class _Link:
    """One liveness connection (accepted, or opened by ``watch``): heartbeats every
    ``interval``, lost after ``lease`` seconds of silence."""

    def __init__(self, events: _LinkEvents, loop: asyncio.AbstractEventLoop, interval: float, lease: float,
                 sock: socket.socket, expect: str | None, watched: bool) -> None:
        self.events = events
        self.loop = loop
        self.interval = interval
        self.lease = lease
        self.sock = sock
        self.expect = expect  # instance id the peer must announce (watch side)
        self.watched = watched
        self.peer = ""  # known once the peer's hello arrived (accepted links: and proven)
        self.peer_info = b""
        self.nonce = b""  # the challenge: sent (accepted link) or received (watched link)
        self.buf = b""
        self.opened = self.last_seen = time.monotonic()
        self.ready: asyncio.Future[None] = loop.create_future()
        self.timer: asyncio.TimerHandle | None = None
        self.closed = False
        loop.add_reader(sock.fileno(), self.on_readable)
        self.timer = loop.call_later(interval, self.on_tick)
        if not watched:
            self.nonce = peerauth.new_nonce()
            self.send(events.challenge(self.nonce))

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
            self.lost(f"liveness connection lost: {exc!r}", by_peer=True)
            return
        if not data:
            self.lost("liveness connection closed (peer exited or died)", by_peer=True)
            return
        self.last_seen = time.monotonic()
        if self.peer:
            return  # heartbeat bytes: only their arrival matters
        self.buf += data
        if self.watched and not self.nonce:
            if len(self.buf) < _CHALLENGE_LEN + 2:
                return
            (n,) = struct.unpack_from("!H", self.buf, _CHALLENGE_LEN)
            if self.buf[:4] != _CHALLENGE:
                self.lost("not a pdgrpc liveness peer (no challenge)")
                return
            if len(self.buf) < _CHALLENGE_LEN + 2 + n:
                return
            nonce, who = self.buf[4:_CHALLENGE_LEN], self.buf[_CHALLENGE_LEN + 2 : _CHALLENGE_LEN + 2 + n]
            self.buf = self.buf[_CHALLENGE_LEN + 2 + n :]
            if who.decode(errors="replace") != self.expect:
                self.peer = self.expect or ""
                self.lost(f"liveness port belongs to instance {who.decode(errors='replace')}, not {self.expect} (restarted)")
                return
            self.nonce = nonce
            assert self.expect is not None
            self.send(self.events.hello(self.expect, self.nonce))
        try:
            parsed = _parse_hello(self.buf)
        except (ValueError, UnicodeDecodeError) as exc:
            self.lost(f"bad liveness hello: {exc}")
            return
        if parsed is None:
            if len(self.buf) > _MAX_HELLO:
                self.lost("liveness hello too long")
            return
        peer, info, proof, _used = parsed
        self.buf = b""
        if self.expect is not None and peer != self.expect:
            self.peer = self.expect
            self.lost(f"liveness port belongs to instance {peer}, not {self.expect} (restarted)")
            return
        if not self.watched and not self.events.admit(self.nonce, peer, proof):
            log.warning("liveness: closing a link claiming to be %s: its proof of identity does not verify", peer)
            self.close()  # proven nothing: reported to nobody
            return
        self.peer_info = info
        self.peer = peer
        if not self.watched:
            self.send(self.events.hello())
        if not self.ready.done():
            self.ready.set_result(None)

    def on_tick(self) -> None:
        if self.closed:
            return
        now = time.monotonic()
        if now - self.last_seen > self.lease:
            self.lost(f"no heartbeat for {self.lease:.1f} s")
            return
        if not self.watched and not self.peer and now - self.opened > self.lease:
            self.close()  # proven nothing: reported to nobody
            return
        if self.peer:
            self.send(_BEAT)
        self.timer = self.loop.call_later(self.interval, self.on_tick)

    def close(self, *, by_peer: bool = False) -> None:
        """Close the link; ``by_peer``: the peer ended it (EOF, reset)."""
        if self.closed:
            return
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
        try:
            self.loop.remove_reader(self.sock.fileno())
        except (ValueError, OSError):
            pass
        self.sock.close()
        if not self.ready.done():
            self.ready.set_result(None)
        self.events.link_closed(self, by_peer)

    def lost(self, reason: str, *, by_peer: bool = False) -> None:
        # An accepted link has a peer only once its proof verified: one that never
        # proved anything is reported to nobody.
        peer = self.peer or (self.expect or "")
        was_closed = self.closed
        self.close(by_peer=by_peer)
        if not was_closed and peer:
            self.events.link_lost(self, peer, reason)


class Liveness:
    """One per transport instance: a heartbeat listener plus outgoing watches.

    ``await start()`` returns ``host:port`` for :attr:`Descriptor.liveness`;
    ``await watch(peer_id, address)`` returns once the peer answered with the expected
    id (or, if it cannot be reached or is another instance, after ``on_lost`` ran);
    ``on_lost(peer_instance_id, reason)`` runs once per proven link, on the event loop.

    Identity (:mod:`pdgrpc.transport.peerauth`): ``key`` verifies the peers that link
    here (default: a fresh one, known in this process); ``credential_for(peer_id)`` is
    what this side proves when it watches ``peer_id`` (default: what this process knows);
    ``writers`` (optional) counts the proven accepted links per peer.
    """

    def __init__(self, instance_id: str, on_lost: OnLost, *, info: bytes = b"", host: str = "127.0.0.1",
                 interval: float = 0.25, lease: float = 1.5, key: bytes | None = None,
                 credential_for: Callable[[str], bytes] | None = None,
                 writers: peerauth.WriterTable | None = None) -> None:
        if not 0 < interval < lease:
            raise ConfigError(f"liveness: need 0 < interval ({interval}) < lease ({lease})")
        if len(info) > 0xFFFF:
            raise ConfigError(f"liveness: info of {len(info)} bytes does not fit the hello")
        self.instance_id = instance_id
        self.key = key if key is not None else peerauth.new_key()
        if key is None:
            peerauth.remember_key(instance_id, self.key)
        self.credential_for = credential_for or (lambda peer: peerauth.known_credential(peer, instance_id))
        self.writers = writers
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

    def prove(self, peer_id: str, nonce: bytes) -> bytes:
        """This side's answer to ``peer_id``'s challenge."""
        cred = self.credential_for(peer_id)
        return peerauth.proof(cred, CHANNEL, nonce, self.instance_id, peer_id) if cred else b""

    def verify(self, nonce: bytes, peer_id: str, answer: bytes) -> bool:
        """Whether an accepted link's hello proves ``peer_id``."""
        return peerauth.verify(self.key, CHANNEL, nonce, peer_id, self.instance_id, answer)

    # -- what links ask (_LinkEvents) ------------------------------------------------------
    def challenge(self, nonce: bytes) -> bytes:
        me = self.instance_id.encode()
        return _CHALLENGE + nonce + struct.pack("!H", len(me)) + me

    def hello(self, peer: str = "", nonce: bytes = b"") -> bytes:
        """This side's hello; to a watched ``peer``, with the proof answering its ``nonce``."""
        return _hello(self.instance_id, self.info, self.prove(peer, nonce) if peer else b"")

    def admit(self, nonce: bytes, peer: str, proof: bytes) -> bool:
        """An accepted link's hello: whether ``proof`` proves ``peer`` (then it counts as a writer's link)."""
        if not self.verify(nonce, peer, proof):
            return False
        if self.writers is not None:
            self.writers.opened(peer)
        return True

    def link_closed(self, link: _Link, by_peer: bool) -> None:
        if not link.watched and link.peer and self.writers is not None:
            self.writers.closed(link.peer, by_peer=by_peer)
        self.links.discard(link)
        if link.watched and self.watching.get(link.expect or "") is link:
            del self.watching[link.expect or ""]

    def link_lost(self, link: _Link, peer: str, reason: str) -> None:
        if self.closed:
            return
        if not link.watched and self.live_link(peer) is not None:
            # The peer (proven) is still up on another link: a link it replaced.
            log.warning("liveness: a link claiming %s closed (%s); %s is still live on another link",
                        peer, reason, peer)
            return
        self.on_lost(peer, reason)

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
            waiting = [link for link in self.links if not link.watched and not link.peer]
            if len(waiting) >= MAX_UNPROVEN_LINKS:
                log.warning("liveness: closing the oldest of %d links that have not proven who they are: a new one "
                            "takes its place (MAX_UNPROVEN_LINKS)", len(waiting))
                min(waiting, key=lambda link: link.opened).close()
            self.links.add(_Link(self, self.loop, self.interval, self.lease, sock, None, watched=False))

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
        link = _Link(self, self.loop, self.interval, self.lease, sock, peer_instance_id, watched=True)
        self.links.add(link)
        self.watching[peer_instance_id] = link  # the hello goes out once the challenge came
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

    def proven_link(self, peer_instance_id: str, info: bytes) -> "_Link | None":
        """A live accepted link on which ``peer_instance_id`` proved its identity and
        announced ``info``, if any."""
        for link in self.links:
            if (not link.watched and link.peer == peer_instance_id and link.peer_info == info
                    and not link.closed and link.ready.done()):
                return link
        return None

    def challenge_of(self, peer_instance_id: str) -> bytes:
        """The nonce ``peer_instance_id`` challenged our watching link with (b"" if none)."""
        link = self.watching.get(peer_instance_id)
        return link.nonce if link is not None else b""

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
