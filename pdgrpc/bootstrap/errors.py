"""Errors the bootstrap service's pure parts (room table, worker registry) raise.

The servicer turns each into the gRPC status named beside it; a client sees an
:class:`~pdgrpc.rpc.errors.RpcError` with that code.
"""

from __future__ import annotations

from pdgrpc.errors import BootstrapError, CompatibilityError


class InvalidBootstrapRequest(BootstrapError, ValueError):
    """Malformed request: room 0, dp rank out of range, batch over the limit, bad sizes.
    → ``INVALID_ARGUMENT``."""


class RoomConflict(BootstrapError):
    """A room is already registered with a different dp rank. → ``ALREADY_EXISTS``."""

    def __init__(self, room: int, registered_rank: int, requested_rank: int) -> None:
        self.room = room
        self.registered_rank = registered_rank
        self.requested_rank = requested_rank
        super().__init__(
            f"bootstrap_room {room} is already registered with dp_rank {registered_rank}; "
            f"refusing dp_rank {requested_rank} (nothing in this batch was registered)"
        )


class RoomTableFull(BootstrapError):
    """The room table holds ``max_rooms`` live rooms, all queried by a decode or renewed by
    the same call (nothing it may evict): new ones are refused. → ``RESOURCE_EXHAUSTED``."""

    def __init__(self, live: int, max_rooms: int, new: int) -> None:
        self.live = live
        self.max_rooms = max_rooms
        self.new = new
        super().__init__(
            f"room table is full: {live} live rooms of max_rooms={max_rooms}; refusing {new} new room(s) "
            "(every other live room was queried by a decode; nothing in this batch was registered; rooms free as they expire)"
        )


class RoomQuotaFull(RoomTableFull):
    """One registrant holds its quota of rooms no decode has queried yet: its new ones are
    refused, so it cannot crowd the others out of the table. → ``RESOURCE_EXHAUSTED``."""

    def __init__(self, held: int, quota: int, new: int, caller: str = "registrant") -> None:
        self.live = held
        self.max_rooms = quota
        self.new = new
        BootstrapError.__init__(
            self,
            f"{caller} holds {held} rooms no decode has queried of its quota of {quota}; refusing {new} new room(s) "
            "(nothing in this batch was registered; rooms free as decodes query them or they expire)",
        )


class TopologyMismatch(BootstrapError, CompatibilityError):
    """A worker's parallel info disagrees with the instance's. → ``FAILED_PRECONDITION``."""

    def __init__(self, field: str, instance_value: object, worker_value: object) -> None:
        self.field = field
        self.instance_value = instance_value
        self.worker_value = worker_value
        super().__init__(
            f"parallel_info.{field} disagrees: the instance has {instance_value}, "
            f"this worker has {worker_value}"
        )


class WorkersPending(BootstrapError):
    """Not every worker of the instance has registered yet. → ``UNAVAILABLE``."""

    def __init__(self, registered: int, expected: int | None) -> None:
        self.registered = registered
        self.expected = expected
        if expected is None:
            msg = "0 of ? workers registered: no prefill worker has registered yet"
        else:
            msg = f"{registered} of {expected} workers registered; retry when all have"
        super().__init__(msg)


class NotPermitted(BootstrapError):
    """The caller's identity may not make this call (authentication on): a worker slot
    registered by another identity, or a caller that registered no worker of the
    instance. → ``PERMISSION_DENIED``."""


class PendingWorkersFull(BootstrapError):
    """Workers of topologies not yet complete fill the registry's room for all
    registrants together: a registration that would add one is refused.
    → ``RESOURCE_EXHAUSTED``."""
