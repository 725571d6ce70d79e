"""``unix``: an example third-party pdgrpc transport.

It moves KV pages between processes on one host over Unix domain sockets. The framing,
authorization, metadata ordering and failure handling come from pdgrpc's ``tcp``
backend; this package only changes how sockets are made, through ``TcpTransport``'s public
socket hooks (``listen_socket`` / ``peer_address``),
and names its socket in Linux's abstract namespace (no file to clean up, even when
the process is killed). It is registered through the ``pdgrpc.transports``
entry point in ``pyproject.toml`` and proves itself with pdgrpc's conformance suite
(``tests/test_unix_conformance.py``) -- the path any plugin author follows.
"""

from __future__ import annotations

import socket
from typing import Any

from pdgrpc.errors import ConfigError
from pdgrpc.transport.base import BadDescriptor
from pdgrpc.transport.tcp import TcpTransport

__all__ = ["UnixTransport"]


class UnixTransport(TcpTransport):
    """Options: the ``tcp`` options ``connections``, ``connect_timeout`` and ``sockbuf``
    (``host``/``port`` do not apply)."""

    name = "unix"

    def __init__(self, **options: Any) -> None:
        for opt in ("host", "port"):
            if opt in options:
                raise ConfigError(f"unix transport: option {opt!r} does not apply (it listens on a unix socket)")
        super().__init__(**options)

    def listen_socket(self) -> tuple[socket.socket, bytes]:
        # Abstract namespace: a leading NUL; the name is unique per transport instance.
        name = f"pdgrpc-{self.instance_id}"
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind("\0" + name)
        s.listen(128)
        return s, ("@" + name).encode()

    def peer_address(self, endpoint: bytes) -> tuple[int, Any]:
        name = endpoint.decode(errors="replace")
        if not name.startswith("@pdgrpc-"):
            raise BadDescriptor(f"unix endpoint {name!r} is not an abstract pdgrpc socket name")
        return socket.AF_UNIX, "\0" + name[1:]
