"""A room: the id one request's KV transfer goes by, from its prefill to its decode.

A room is in ``[1, 2**63)``: the metadata row stores it as an int64, and 0 there means
"not written". :func:`as_room` checks an int once, where a room enters the system (a
server's RPC, the router's draw, the gateway's mapping of smg's room); every layer below
takes the :data:`Room` it returns and checks nothing again.

:data:`Room` is a ``typing.NewType`` of ``int``: the type checker keeps unchecked ints
out of the layers that take a ``Room``, while at run time a room is a plain int, so
dict lookups, struct packing and the wire messages cost what they did.
"""

from __future__ import annotations

from typing import NewType

from pdgrpc.errors import ConfigError

__all__ = ["ROOM_BASE", "ROOM_LIMIT", "ROOM_SPAN", "Room", "as_room"]

Room = NewType("Room", int)

ROOM_LIMIT = 1 << 63  # rooms are below it: the metadata row holds an int64
# smg's rooms (int32 >= 0) map into [ROOM_BASE, ROOM_BASE + ROOM_SPAN), a band the router
# never draws from, so a request from smg never shares a room with one from the router.
ROOM_BASE = 1 << 62
ROOM_SPAN = 1 << 31


def as_room(value: int, field: str = "bootstrap_room") -> Room:
    """``value`` as a :data:`Room`, or :class:`~pdgrpc.errors.ConfigError` naming
    ``field`` (a server answers it with INVALID_ARGUMENT)."""
    if not 0 < value < ROOM_LIMIT:
        raise ConfigError(f"{field} must be in [1, 2**63), got {value}")
    return Room(value)
