"""What bounds the ``tcp`` backend's connections: caps on proven connections (per
listener, and per peer instance, so many workers behind one host each get their own
share), a budget of its own for connections that have not proven who they are yet (per
remote address and per listener, the oldest giving way to a new one, so idle sockets
cannot keep a real peer out), the HELLO deadline, the heartbeat, and the back-off when
the process runs out of file descriptors. Each refusal is logged naming its limit."""

from __future__ import annotations

import collections
import dataclasses
import errno
import math

from pdgrpc.errors import ConfigError
from pdgrpc.transport.tcp_conn import Conn
from pdgrpc.transport.tcp_wire import PING_FRAME

# accept() errors that mean "no resources now", not "this connection is bad": the listener
# stays readable, so accepting again at once would spin the loop at 100% CPU
RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
BACKOFF_MIN_S, BACKOFF_MAX_S = 0.05, 1.0


@dataclasses.dataclass(frozen=True)
class TcpLimits:
    """The ``tcp`` options that bound resources (seconds and counts)."""

    hello_timeout: float = 5.0  # an accepted connection must say HELLO within this
    max_connections: int = 1024  # proven connections per listener
    max_connections_per_address: int = 64  # connections not yet proven, per remote address
    max_unproven_connections: int = 256  # connections not yet proven, per listener
    heartbeat_interval: float = 0.5  # a connection that sent nothing this long sends a PING
    heartbeat_lease: float = 5.0  # a connection that received nothing this long is lost
    max_connections_per_peer: int = 64  # proven connections per peer instance (its identity)

    def __post_init__(self) -> None:
        for name in ("hello_timeout", "heartbeat_interval", "heartbeat_lease"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ConfigError(f"tcp transport: {name} must be a number of seconds > 0, got {v!r}")
        for name in ("max_connections", "max_connections_per_address", "max_unproven_connections", "max_connections_per_peer"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"tcp transport: {name} must be an int >= 1, got {v!r}")
        if self.heartbeat_interval >= self.heartbeat_lease:
            raise ConfigError(f"tcp transport: need heartbeat_interval ({self.heartbeat_interval}) < "
                              f"heartbeat_lease ({self.heartbeat_lease})")


class AcceptGate:
    """Counts accepted connections: unproven ones per remote address and in all (a new
    one displaces the oldest where a budget is full, so sockets that never prove
    anything cannot keep a real peer out), proven ones per peer and in all (a proof
    past a cap is refused). Paces accept() while the process is out of descriptors."""

    def __init__(self, limits: TcpLimits) -> None:
        self.limits = limits
        self.proven = 0
        self.unproven: dict[Conn, str] = {}  # connection -> its address, oldest first
        self.per_address: collections.Counter[str] = collections.Counter()
        self.per_peer: collections.Counter[str] = collections.Counter()
        self.backoff = 0.0

    def admit(self, conn: Conn, address: str) -> list[tuple[Conn, str]]:
        """Count ``conn``, new from ``address``, as unproven. Returns the connections it
        displaces, no longer counted, each with the limit that displaced it: the caller
        closes them."""
        lim = self.limits
        displaced: list[tuple[Conn, str]] = []
        if self.per_address[address] >= lim.max_connections_per_address:
            oldest = next(c for c, a in self.unproven.items() if a == address)
            displaced.append((oldest, f"max_connections_per_address {lim.max_connections_per_address} unproven"))
        elif len(self.unproven) >= lim.max_unproven_connections:
            displaced.append((next(iter(self.unproven)), f"max_unproven_connections {lim.max_unproven_connections}"))
        for old, _ in displaced:
            self._forget(old)
        self.unproven[conn] = address
        self.per_address[address] += 1
        self.backoff = 0.0
        return displaced

    def prove(self, conn: Conn, peer: str) -> str | None:
        """``conn`` proved it is ``peer``: it moves from the unproven budget to the
        peer's. The refusal (naming the limit) if the listener or the peer has too many
        proven connections."""
        lim = self.limits
        if self.proven >= lim.max_connections:
            return f"{self.proven} proven connections (max_connections {lim.max_connections})"
        if self.per_peer[peer] >= lim.max_connections_per_peer:
            return f"{self.per_peer[peer]} connections of {peer} (max_connections_per_peer {lim.max_connections_per_peer})"
        self._forget(conn)
        self.proven += 1
        self.per_peer[peer] += 1
        return None

    def release(self, conn: Conn, peer: str | None = None) -> None:
        """``conn`` closed: ``peer`` once it proved who it is. A displaced one is not
        counted any more."""
        if peer is None:
            self._forget(conn)
            return
        self.proven -= 1
        self.per_peer[peer] -= 1
        if self.per_peer[peer] <= 0:
            del self.per_peer[peer]

    def _forget(self, conn: Conn) -> None:
        address = self.unproven.pop(conn, None)
        if address is None:
            return
        self.per_address[address] -= 1
        if self.per_address[address] <= 0:
            del self.per_address[address]

    def next_backoff(self) -> float:
        """Seconds to stop accepting after a resource error (doubling, capped)."""
        self.backoff = min(BACKOFF_MAX_S, max(BACKOFF_MIN_S, 2 * self.backoff))
        return self.backoff


def tend(c: Conn, lim: TcpLimits, now: float) -> None:
    """One heartbeat round for one connection: close an accepted one that never said
    HELLO, lose one that heard nothing for the lease, PING a quiet one."""
    if c.closed:
        return
    if c.peer_id is None and c.remote is not None and now - c.opened > lim.hello_timeout:
        c.protocol_error(f"no HELLO within {lim.hello_timeout:g} s (hello_timeout)")
    elif c.peer_id is not None and now - c.last_recv > lim.heartbeat_lease:
        c.lose(f"no heartbeat for {lim.heartbeat_lease:g} s (heartbeat_lease)")
    elif c.peer_id is not None and now - c.last_sent >= lim.heartbeat_interval and not c.sending:
        c.send([PING_FRAME])
