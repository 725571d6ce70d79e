"""What the decode machines report: why a request was aborted, and what a commit hands over."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from pdgrpc.reasons import AbortReason

if TYPE_CHECKING:  # an annotation only: the abort vocabulary must load without torch
    from pdgrpc.state.metadata import MetadataRow

__all__ = ["AbortReason", "Aborted", "Committed", "REASON_NONE"]


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
