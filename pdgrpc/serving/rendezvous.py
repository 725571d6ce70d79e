"""Where the TP ranks of one instance meet to form their gloo group."""

from __future__ import annotations

import socket

__all__ = ["dist_init_method"]


def dist_init_method(host: str = "127.0.0.1") -> str:
    """A ``tcp://HOST:PORT`` init method on a port free right now. Rank 0 binds it a moment
    later (its TCPStore); another program taking it in between fails the group's start."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"
