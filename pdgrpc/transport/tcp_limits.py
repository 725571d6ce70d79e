"""What bounds the ``tcp`` backend's connections: caps on accepted connections (per
listener; per remote address until the HELLO's proof, then per proven peer instance, so
many workers behind one host each get their own share), the HELLO deadline, the
heartbeat, and the back-off when the process runs out of file
descriptors. Each refusal is logged naming its limit."""

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
    max_connections: int = 1024  # accepted connections per listener
    max_connections_per_address: int = 256  # accepted connections per remote address, not yet proven
    heartbeat_interval: float = 0.5  # a connection that sent nothing this long sends a PING
    heartbeat_lease: float = 5.0  # a connection that received nothing this long is lost
    max_connections_per_peer: int = 64  # proven connections per peer instance (its identity)

    def __post_init__(self) -> None:
        for name in ("hello_timeout", "heartbeat_interval", "heartbeat_lease"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ConfigError(f"tcp transport: {name} must be a number of seconds > 0, got {v!r}")
        for name in ("max_connections", "max_connections_per_address", "max_connections_per_peer"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"tcp transport: {name} must be an int >= 1, got {v!r}")
        if self.heartbeat_interval >= self.heartbeat_lease:
            raise ConfigError(f"tcp transport: need heartbeat_interval ({self.heartbeat_interval}) < "
                              f"heartbeat_lease ({self.heartbeat_lease})")


class AcceptGate:
    """Counts accepted connections (per remote address until proven, then per proven
    peer), says whether one more may stay, and paces accept() while the process is out
    of descriptors."""

    def __init__(self, limits: TcpLimits) -> None:
        self.limits = limits
        self.total = 0
        self.per_address: collections.Counter[str] = collections.Counter()
        self.per_peer: collections.Counter[str] = collections.Counter()
        self.backoff = 0.0

    def admit(self, address: str) -> str | None:
        """Count a new connection from ``address``; the refusal (naming the limit) if it
        may not stay."""
        lim = self.limits
        if self.total >= lim.max_connections:
            return f"{self.total} connections accepted (max_connections {lim.max_connections})"
        if self.per_address[address] >= lim.max_connections_per_address:
            return (f"{self.per_address[address]} connections from {address or 'this address'} "
                    f"(max_connections_per_address {lim.max_connections_per_address})")
        self.total += 1
        self.per_address[address] += 1
        self.backoff = 0.0
        return None

    def prove(self, address: str, peer: str) -> str | None:
        """A connection from ``address`` proved it is ``peer``: it moves from the address's
        count to the peer's. The refusal (naming the limit) if the peer has too many."""
        lim = self.limits
        if self.per_peer[peer] >= lim.max_connections_per_peer:
            return f"{self.per_peer[peer]} connections of {peer} (max_connections_per_peer {lim.max_connections_per_peer})"
        self._drop(self.per_address, address)
        self.per_peer[peer] += 1
        return None

    def release(self, address: str, peer: str | None = None) -> None:
        """A connection closed: ``peer`` once it proved who it is, else its ``address``."""
        self.total -= 1
        if peer is None:
            self._drop(self.per_address, address)
        else:
            self._drop(self.per_peer, peer)

    @staticmethod
    def _drop(counter: "collections.Counter[str]", key: str) -> None:
        counter[key] -= 1
        if counter[key] <= 0:
            del counter[key]

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
