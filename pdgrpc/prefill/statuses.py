"""The prefill's one mapping between its failures and gRPC status codes.

Code that refuses or fails a request names why -- a :class:`Refusal` -- and
:func:`ending` gives the status its caller (and, through the failure notices, its
decode) sees; no other module of the role picks a ``grpc.StatusCode``. The status a peer
answered (a worker's FAIL frame, the bootstrap's reply) is read here too
(:func:`from_wire`, :func:`peer_status`).
"""

from __future__ import annotations

import enum

import grpc

from pdgrpc.errors import RequestFailed
from pdgrpc.reasons import AnyAbortReason

__all__ = ["Refusal", "ending", "from_wire", "peer_status", "status"]


class Refusal(enum.Enum):
    """Why the prefill refuses or fails a request."""

    BAD_REQUEST = "bad_request"  # a field of the request or handshake is wrong; the message names it
    INCOMPATIBLE = "incompatible"  # the decode's model, layout, TP size or transport differ, or a dp-rank conflict
    ROOM_IN_USE = "room_in_use"  # the room already has a Prefill or this handshake
    OVERLOADED = "overloaded"  # a client, mailbox or the page pool is at its limit
    NOT_PROVEN = "not_proven"  # room_proof does not verify: not the decode the router chose
    TIMED_OUT = "timed_out"  # a phase passed its deadline
    ABORTED = "aborted"  # the decode (or a TP peer) ended the room, or its transfer failed
    CANCELLED = "cancelled"  # the caller cancelled the Prefill
    # A process the request needs is gone or stopping (a worker, a TP peer, the decode's
    # transport): a router sends the request again, elsewhere.
    GONE = "gone"
    INTERNAL = "internal"  # a failure here (engine, bug)


_STATUS: dict[Refusal, grpc.StatusCode] = {
    Refusal.BAD_REQUEST: grpc.StatusCode.INVALID_ARGUMENT,
    Refusal.INCOMPATIBLE: grpc.StatusCode.FAILED_PRECONDITION,
    Refusal.ROOM_IN_USE: grpc.StatusCode.ALREADY_EXISTS,
    Refusal.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Refusal.NOT_PROVEN: grpc.StatusCode.PERMISSION_DENIED,
    Refusal.TIMED_OUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    Refusal.ABORTED: grpc.StatusCode.ABORTED,
    Refusal.CANCELLED: grpc.StatusCode.CANCELLED,
    Refusal.GONE: grpc.StatusCode.UNAVAILABLE,
    Refusal.INTERNAL: grpc.StatusCode.INTERNAL,
}

_BY_VALUE = {c.value[0]: c for c in grpc.StatusCode}


def status(why: Refusal) -> grpc.StatusCode:
    return _STATUS[why]


def ending(why: Refusal, message: str, reason: AnyAbortReason | None = None) -> RequestFailed:
    """The failure a request ends with because of ``why``, with its status; ``reason``:
    for ``pdgrpc_aborts_total`` (``internal_error`` unless given)."""
    return RequestFailed(_STATUS[why], message, reason)


def from_wire(value: int | None) -> grpc.StatusCode:
    """The status a worker's FAIL frame carries as its number (UNKNOWN for none or one
    this grpc does not know)."""
    return grpc.StatusCode.UNKNOWN if value is None else _BY_VALUE.get(value, grpc.StatusCode.UNKNOWN)


def peer_status(exc: BaseException) -> grpc.StatusCode:
    """The status of a peer's failed call ``exc``; UNAVAILABLE when it carries none (the
    call got no answer)."""
    code = getattr(exc, "code", None)
    return code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNAVAILABLE
