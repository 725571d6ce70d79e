"""The fate of one room on a prefill rank (one Prefill RPC), h11 style.

::

    RUNNING --Abort--> ABORTING        (its decode sent AbortRoom, or the worker shuts down)
    RUNNING, ABORTING --Failed--> FAILED
    RUNNING, ABORTING, FAILED --Close--> CLOSING   (its compute, transfers and pages are released)

:class:`~pdgrpc.state.prefill_sender.PrefillSender` follows the room's transfer once its
pages are allocated; this machine follows what decides how the room ends, from its
admission on: whether an abort stops its driver, what a cancellation of its driver means,
and the failure it ends with. An ``Abort`` once the room failed or closes has
nothing left to stop and is ignored; any other event the state does not accept raises
:class:`~pdgrpc.errors.IllegalTransition` and leaves the state unchanged.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Generic, TypeVar, Union

from pdgrpc.errors import IllegalTransition

__all__ = ["Abort", "Close", "Failed", "PrefillRoom", "ROOM_TRANSITIONS", "RoomState"]

F = TypeVar("F")


class RoomState(enum.Enum):
    RUNNING = "running"  # its Prefill RPC drives it
    ABORTING = "aborting"  # asked to stop: its driver is cancelled
    FAILED = "failed"  # its driver ended it with a failure
    CLOSING = "closing"  # its driver ended; what it held is being released


@dataclasses.dataclass(frozen=True)
class Abort:
    """Stop the room: its decode gave up (``reason`` from AbortRoom), or ``shutdown``."""

    reason: str
    shutdown: bool = False


@dataclasses.dataclass(frozen=True)
class Failed(Generic[F]):
    """The room failed with ``failure``."""

    failure: F


@dataclasses.dataclass(frozen=True)
class Close:
    """Its driver ended (done or failed): release what it held."""


R = RoomState
ROOM_TRANSITIONS: dict[tuple[RoomState, type], RoomState] = {
    (R.RUNNING, Abort): R.ABORTING,
    (R.ABORTING, Abort): R.ABORTING,  # the latest reason names it
    (R.FAILED, Abort): R.FAILED,
    (R.CLOSING, Abort): R.CLOSING,
    (R.RUNNING, Failed): R.FAILED,
    (R.ABORTING, Failed): R.FAILED,
    (R.RUNNING, Close): R.CLOSING,
    (R.ABORTING, Close): R.CLOSING,
    (R.FAILED, Close): R.CLOSING,
}


class PrefillRoom(Generic[F]):
    """One room's fate (see the module doc). Not thread-safe."""

    __slots__ = ("room", "state", "abort", "failure")

    def __init__(self, room: int) -> None:
        self.room = room
        self.state = R.RUNNING
        self.abort: Abort | None = None  # what asked it to stop, while running
        self.failure: F | None = None

    def handle(self, event: Union[Abort, "Failed[F]", Close]) -> RoomState:
        try:
            new = ROOM_TRANSITIONS[(self.state, type(event))]
        except KeyError:
            raise IllegalTransition(f"room {self.room}: event {type(event).__name__} is not allowed in state {self.state.name}") from None
        if isinstance(event, Abort) and self.stoppable:
            self.abort = event
        elif isinstance(event, Failed):
            self.failure = event.failure
        self.state = new
        return new

    @property
    def stoppable(self) -> bool:  # its driver still runs: an abort cancels it
        return self.state in (R.RUNNING, R.ABORTING)
