"""Why a request ended without output: the ``reason`` of :class:`pdgrpc.errors.RequestFailed`
and the ``reason`` label of ``pdgrpc_aborts_total``.

Two enums: :class:`AbortReason` (the decode state machines' reasons, ordered as a
priority) and :class:`ServerAbortReason` (causes outside them). The label vocabulary is
built from both, never typed out, so a reason added to either appears in every server's
exposition at 0. This module sits beside :mod:`pdgrpc.errors` at the bottom of the
package and imports nothing from it, so every layer may name a reason.
"""

from __future__ import annotations

import enum
from typing import Union

__all__ = [
    "ABORT_REASON_LABELS",
    "AbortReason",
    "AnyAbortReason",
    "SAME_CAUSE",
    "ServerAbortReason",
    "abort_label",
]


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
    # The prefill worker accepted the handshake, but no Prefill RPC claimed the room there
    # within DecodeDeadlines.claim_s: its prefill never shows.
    CLAIM_TIMEOUT = 11


class ServerAbortReason(str, enum.Enum):
    """Abort causes that happen outside the decode state machines.

    The servers use :class:`AbortReason` wherever it fits (the prefill's "no handshake in
    time" is ``bootstrap_timeout``, a client that went away is ``cancelled``) and these
    only for what that list cannot say. ``PEER_FAILURE`` is in both lists with one label
    and one meaning (:data:`SAME_CAUSE`): servers outside the decode machines (a prefill
    controller, the router) name it here."""

    PEER_FAILURE = "peer_failure"  # the other process or its connection died (worker exit, transport peer gone)
    REJECTED_WRITE = "rejected_write"  # the receiver rejected a write outside the pages/slot it advertised
    DP_RANK_CONFLICT = "dp_rank_conflict"  # routed dp rank contradicts strict follow_bootstrap_room
    PREFILL_ERROR = "prefill_error"  # the prefill failed or refused the request, not as invalid (seen by decode, router)
    DECODE_ERROR = "decode_error"  # the decode failed or aborted the request (seen by prefill, router)
    # A server refused the request itself as wrong (INVALID_ARGUMENT, OUT_OF_RANGE; seen by
    # the router and, from its prefill, the decode): the client's mistake, which fails on any
    # instance, not a server's failure.
    BAD_REQUEST = "bad_request"
    INTERNAL_ERROR = "internal_error"  # an unexpected exception here (engine failure, bug)
    SHUTDOWN = "shutdown"  # the server stopped while the request was in flight
    DRAIN_TIMEOUT = "drain_timeout"  # the server drained (SIGTERM, Drain) and its --drain-timeout passed first


AnyAbortReason = Union[AbortReason, ServerAbortReason]

# Server causes that the decode machines also name, with the same meaning and label: a
# peer's death is ``peer_failure`` wherever it is seen (a prefill controller whose worker
# died, a decode whose transport lost the writer).
SAME_CAUSE: frozenset[ServerAbortReason] = frozenset({ServerAbortReason.PEER_FAILURE})


def abort_label(reason: AnyAbortReason) -> str:
    """The ``reason`` label value (``AbortReason.TRANSFER_TIMEOUT`` -> ``transfer_timeout``).
    Anything else -- a bare int, a string -- is a TypeError: the label set stays closed."""
    if isinstance(reason, AbortReason):
        return reason.name.lower()
    if isinstance(reason, ServerAbortReason):
        return reason.value
    raise TypeError(f"abort reason must be an AbortReason or ServerAbortReason, got {reason!r}")


ABORT_REASON_LABELS: tuple[str, ...] = tuple(abort_label(r) for r in AbortReason) + tuple(
    abort_label(r) for r in ServerAbortReason if r not in SAME_CAUSE
)
