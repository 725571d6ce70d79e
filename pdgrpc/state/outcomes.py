"""What the decode machines report: why a request was aborted, and what a commit hands over."""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # an annotation only: the abort vocabulary must load without torch
    from pdgrpc.state.metadata import MetadataRow

__all__ = ["AbortReason", "Aborted", "Committed", "REASON_NONE"]


class AbortReason(enum.IntEnum):
    """Why a request was aborted. The numeric order is a priority: when TP ranks fail the
    same room for different reasons, the all-reduce MIN keeps the smallest code, so every
    rank reports the same, most specific reason."""

    METADATA_CORRUPTION = 1  # the slot holds another request's bootstrap_room
    # The transport failed the room because its peer is gone (process or connection
    # died, heartbeat stopped): the same cause, and label, as ServerAbortReason.PEER_FAILURE.
    PEER_FAILURE = 2
    TRANSFER_FAILED = 3  # the transport reported FAILED for the room (any other cause)
    TP_DESYNC = 4  # TP ranks disagree on which room a slot holds (driver bug)
    CANCELLED = 5  # the caller aborted it (client gone, prefill aborted, shutdown)
    RESOLVE_DP_RANK_TIMEOUT = 6
    ALLOCATE_TIMEOUT = 7
    BOOTSTRAP_TIMEOUT = 8
    WAITING_FOR_INPUT_TIMEOUT = 9
    TRANSFER_TIMEOUT = 10


# "No failure on this rank": larger than every reason, so MIN ignores it.
REASON_NONE = 255


@dataclasses.dataclass(frozen=True)
class Committed:
    """The transfer finished and the metadata row is the expected one: decode may start.
    ``pages`` now belong to the engine (return them with ``DecodeQueues.release_pages``).
    ``row`` is None for fake transfers (no metadata written)."""

    room: int
    slot: int
    pages: tuple[int, ...]
    row: MetadataRow | None


@dataclasses.dataclass(frozen=True)
class Aborted:
    """The request ended without output. No token of it may be emitted. ``state`` is the
    state it was in; ``message`` names it. ``awaiting_ack``: its slot and pages are
    quarantined until the prefill acknowledges the abort (``DecodeQueues.on_abort_ack``)
    or the lease expires; tell the prefill."""

    room: int
    reason: AbortReason
    message: str
    state: str
    awaiting_ack: bool = False
