"""Which local user a loopback TCP caller runs as: what lets a listener without
credentials (``--gateway-listen``) serve only processes of chosen users.

A call's peer (``context.peer()``: ``ipv4:127.0.0.1:PORT`` or ``ipv6:[::1]:PORT``) and the
listener's address name one TCP connection; the kernel's socket diagnostics
(``NETLINK_SOCK_DIAG``, what ``ss`` reads) look up the client's end of it by that exact
4-tuple and report the uid that owns it: the connecting process's user. The lookup is
one hash lookup in the kernel, made for every call and never cached: a peer's address
and port are free for another process the moment its connection ends, and grpc tells no
handler when that is.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from typing import Any, Collection

__all__ = ["LocalUsers", "peer_uid"]

_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 1
_NLMSG_HEADER = struct.Struct("=IHHII")  # length, type, flags, sequence, port id
# inet_diag_req_v2: family, protocol, extensions, pad, states; then inet_diag_sockid:
# source and destination ports (network order), addresses (16 bytes each), interface, cookie.
_REQUEST = struct.Struct("=BBBBI")
_PORTS = struct.Struct(">HH")
_TAIL = struct.Struct("=III")
_NO_COOKIE = 0xFFFFFFFF
_ALL_STATES = 0xFFFFFFFF
_TCP_ESTABLISHED = 1
# inet_diag_msg: family, state, timer, retransmits, sockid (48 bytes), expires, rqueue, wqueue, uid, inode.
_MSG_STATE = 1
_MSG_UID = 4 + 48 + 12


def _address(peer: str) -> tuple[socket.AddressFamily, str, int] | None:
    """(family, host, port) of a grpc peer string on TCP; None for anything else."""
    scheme, _, rest = peer.partition(":")
    host, _, port = rest.rpartition(":")
    if scheme not in ("ipv4", "ipv6") or not port.isdigit():
        return None
    try:
        ip = ipaddress.ip_address(host.strip("[]").partition("%")[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # grpc names a v4-mapped peer of a dual-stack socket either way
    family = socket.AF_INET if ip.version == 4 else socket.AF_INET6
    return family, str(ip), int(port)


def _lookup(family: socket.AddressFamily, local: tuple[str, int], remote: tuple[str, int]) -> int | None:
    """The uid owning the TCP socket bound to ``local`` and connected to ``remote``; None
    when there is none (the connection ended) or the kernel refuses to say."""
    request = (
        _REQUEST.pack(family, socket.IPPROTO_TCP, 0, 0, _ALL_STATES)
        + _PORTS.pack(local[1], remote[1])
        + socket.inet_pton(family, local[0]).ljust(16, b"\0")
        + socket.inet_pton(family, remote[0]).ljust(16, b"\0")
        + _TAIL.pack(0, _NO_COOKIE, _NO_COOKIE)
    )
    message = _NLMSG_HEADER.pack(_NLMSG_HEADER.size + len(request), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, 1, 0) + request
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, _NETLINK_SOCK_DIAG) as diag:
            diag.sendto(message, (0, 0))
            reply = diag.recv(8192)
    except OSError:
        return None
    body = _NLMSG_HEADER.size
    if len(reply) < body + _MSG_UID + 4 or _NLMSG_HEADER.unpack_from(reply)[1] != _SOCK_DIAG_BY_FAMILY:
        return None  # NLMSG_ERROR: no such socket
    # Another state is no caller: a closed connection's remains (whose uid reads 0), or a
    # listener the kernel fell back to.
    if reply[body + _MSG_STATE] != _TCP_ESTABLISHED or _PORTS.unpack_from(reply, body + 4) != (local[1], remote[1]):
        return None
    uid: int = struct.unpack_from("=I", reply, body + _MSG_UID)[0]
    return uid


def peer_uid(peer: str, listener: tuple[str, int]) -> int | None:
    """The uid of the local process at the other end of a call whose ``context.peer()``
    is ``peer``, made to the TCP listener at ``listener`` (host, port); None when that
    cannot be told (not TCP, not this host's, or the connection ended)."""
    address = _address(peer)
    if address is None:
        return None
    family, host, port = address
    listen_host, listen_port = listener
    if listen_host in ("localhost", ""):
        listen_host = "127.0.0.1" if family == socket.AF_INET else "::1"
    try:
        listen_ip = ipaddress.ip_address(listen_host.strip("[]"))
    except ValueError:
        return None
    if listen_ip.version != (4 if family == socket.AF_INET else 6):
        return None
    return _lookup(family, (host, port), (str(listen_ip), listen_port))


class LocalUsers:
    """The users whose local processes a loopback listener serves: this process's own
    and ``uids``. :meth:`listening` names the listener once it is bound."""

    def __init__(self, uids: Collection[int] = ()) -> None:
        self.uids = frozenset({os.geteuid(), *uids})
        self._listener: tuple[str, int] | None = None

    def listening(self, host: str, port: int) -> None:
        self._listener = (host, port)

    def admits(self, context: Any) -> bool:
        """Whether the call of ``context`` comes from a process of one of :attr:`uids`."""
        if self._listener is None:
            return False
        return peer_uid(context.peer(), self._listener) in self.uids
