"""The gateway's one mapping from its failures to gRPC status codes.

The smg-facing servicers (:mod:`pdgrpc.gateway.servicer`) and the colocated server,
whose smg leg and ``GenerateService`` answer alike, name why a call fails -- a
:class:`Refusal` -- and :func:`ending` gives the status; no other module of theirs picks
a ``grpc.StatusCode``. A leg that relays the prefill's or decode's failure passes that
role's status on unchanged.
"""

from __future__ import annotations

import enum

import grpc

from pdgrpc.errors import RequestFailed

__all__ = ["Refusal", "ending"]


class Refusal(enum.Enum):
    BAD_REQUEST = "bad_request"  # a field of the request is wrong; the message names it
    DUPLICATE = "duplicate"  # a request with its request_id is already running here
    ABORTED = "aborted"  # ended by smg's Abort call
    UNSUPPORTED = "unsupported"  # this worker was started without the feature
    NO_TOKENIZER = "no_tokenizer"  # the tokenizer's files cannot be served
    ENGINE_FAILED = "engine_failed"  # the colocated engine raised


_STATUS: dict[Refusal, grpc.StatusCode] = {
    Refusal.BAD_REQUEST: grpc.StatusCode.INVALID_ARGUMENT,
    Refusal.DUPLICATE: grpc.StatusCode.ALREADY_EXISTS,
    Refusal.ABORTED: grpc.StatusCode.CANCELLED,
    Refusal.UNSUPPORTED: grpc.StatusCode.UNIMPLEMENTED,
    Refusal.NO_TOKENIZER: grpc.StatusCode.FAILED_PRECONDITION,
    Refusal.ENGINE_FAILED: grpc.StatusCode.INTERNAL,
}


def ending(why: Refusal, message: str) -> RequestFailed:
    """The failure a call ends with because of ``why``, with its status."""
    return RequestFailed(_STATUS[why], message)
