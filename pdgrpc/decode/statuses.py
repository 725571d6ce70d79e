"""The decode's one mapping between its failures and gRPC status codes.

Code that refuses or ends a request names why -- a :class:`Refusal` or the state
machines' :class:`~pdgrpc.reasons.AbortReason` -- and :func:`ending` gives the status
its caller sees; no other module of the role picks a ``grpc.StatusCode``. What a peer
answered (a prefill's status, a worker's reply to a handshake) is read here too, by
:func:`peer_answer` and :func:`prefill_failure`, so a change of either direction is one
table.
"""

from __future__ import annotations

import enum
from typing import Union

import grpc

from pdgrpc.errors import RequestFailed
from pdgrpc.reasons import AbortReason, AnyAbortReason, ServerAbortReason
from pdgrpc.rpc.errors import REQUEST_INVALID

__all__ = ["PeerAnswer", "Refusal", "ending", "peer_answer", "prefill_failure", "refused_by_prefill"]


class Refusal(enum.Enum):
    """Why the decode refuses or ends a request, where no abort reason says it."""

    BAD_REQUEST = "bad_request"  # a field of the request is wrong; the message names it
    ROOM_IN_USE = "room_in_use"  # another request holds its bootstrap_room here
    OVERLOADED = "overloaded"  # the client is at its limit of open calls
    SHUTTING_DOWN = "shutting_down"  # this decode is stopping; another may serve the request
    PREFILL_GONE = "prefill_gone"  # the prefill cannot be reached or lost the request; send it again
    INCOMPATIBLE = "incompatible"  # the prefill serves another model, layout, TP size or transport
    UNSUPPORTED = "unsupported"  # this decode was started without the feature
    INTERNAL = "internal"  # a failure here (engine, transport, a bootstrap's impossible answer)


Why = Union[Refusal, AbortReason]

_STATUS: dict[Why, grpc.StatusCode] = {
    Refusal.BAD_REQUEST: grpc.StatusCode.INVALID_ARGUMENT,
    Refusal.ROOM_IN_USE: grpc.StatusCode.ALREADY_EXISTS,
    Refusal.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    # UNAVAILABLE: a router sends the request again, to another instance.
    Refusal.SHUTTING_DOWN: grpc.StatusCode.UNAVAILABLE,
    Refusal.PREFILL_GONE: grpc.StatusCode.UNAVAILABLE,
    Refusal.INCOMPATIBLE: grpc.StatusCode.FAILED_PRECONDITION,
    Refusal.UNSUPPORTED: grpc.StatusCode.UNIMPLEMENTED,
    Refusal.INTERNAL: grpc.StatusCode.INTERNAL,
    AbortReason.METADATA_CORRUPTION: grpc.StatusCode.ABORTED,
    AbortReason.PEER_FAILURE: grpc.StatusCode.UNAVAILABLE,  # the prefill died: worth another try
    AbortReason.TRANSFER_FAILED: grpc.StatusCode.ABORTED,
    AbortReason.TP_DESYNC: grpc.StatusCode.INTERNAL,
    AbortReason.CANCELLED: grpc.StatusCode.CANCELLED,
    AbortReason.RESOLVE_DP_RANK_TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    AbortReason.ALLOCATE_TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    AbortReason.BOOTSTRAP_TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    AbortReason.WAITING_FOR_INPUT_TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    AbortReason.TRANSFER_TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    AbortReason.CLAIM_TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
}

_REASON: dict[Refusal, ServerAbortReason] = {
    Refusal.SHUTTING_DOWN: ServerAbortReason.SHUTDOWN,
    Refusal.PREFILL_GONE: ServerAbortReason.PREFILL_ERROR,
}


def ending(why: Why, message: str, reason: AnyAbortReason | None = None) -> RequestFailed:
    """The failure a request ends with because of ``why``, with its status; ``reason``
    (for ``pdgrpc_aborts_total``) is ``why`` itself for an abort reason, else the one
    the refusal implies unless given."""
    if reason is None:
        reason = why if isinstance(why, AbortReason) else _REASON.get(why)
    return RequestFailed(_STATUS[why], message, reason)


class PeerAnswer(enum.Enum):
    """What a peer's status says to the decode that called it."""

    GONE = "gone"  # UNAVAILABLE: the peer restarted, moved or died; try again
    LATE = "late"  # DEADLINE_EXCEEDED: the call's deadline passed
    UNSUPPORTED = "unsupported"  # UNIMPLEMENTED: the peer does not serve the call
    REFUSED = "refused"  # any other: the peer refused the request; that decides it

    @property
    def retryable(self) -> bool:
        return self in (PeerAnswer.GONE, PeerAnswer.LATE)


def peer_answer(code: grpc.StatusCode | None) -> PeerAnswer:
    """What the status ``code`` of a peer's reply means here."""
    if code == grpc.StatusCode.UNAVAILABLE:
        return PeerAnswer.GONE
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return PeerAnswer.LATE
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return PeerAnswer.UNSUPPORTED
    return PeerAnswer.REFUSED


def prefill_failure(room: int, code: int, reason: str) -> RequestFailed:
    """What a request ends with when its prefill reports ``code`` (a ``grpc.StatusCode``
    value) and ``reason``: that code (ABORTED for OK or one unknown), and the abort reason
    of :func:`refused_by_prefill`, or ``cancelled`` for a prefill its caller cancelled."""
    status = next((c for c in grpc.StatusCode if c.value[0] == code), grpc.StatusCode.ABORTED)
    if status == grpc.StatusCode.OK:
        status = grpc.StatusCode.ABORTED
    message = f"room {room}: the prefill failed ({status.name}): {reason}"
    # A prefill cancelled by its caller: the same caller is cancelling this leg.
    if status == grpc.StatusCode.CANCELLED:
        return RequestFailed(status, message, AbortReason.CANCELLED)
    return refused_by_prefill(status, message)


def refused_by_prefill(code: grpc.StatusCode, message: str) -> RequestFailed:
    """A request its prefill refused with the status ``code`` (a worker's reply to the
    handshake, or what its bootstrap listed): that status, abort reason ``bad_request``
    where the prefill found the request itself invalid, else ``prefill_error``."""
    why = ServerAbortReason.BAD_REQUEST if code in REQUEST_INVALID else ServerAbortReason.PREFILL_ERROR
    return RequestFailed(code, message, why)
