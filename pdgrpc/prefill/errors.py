"""A request that ends with a gRPC status: the one error type prefill's drivers raise.

Drivers raise :class:`RequestFailed` with the status code the proto documents for the
case (INVALID_ARGUMENT, FAILED_PRECONDITION, DEADLINE_EXCEEDED, ABORTED, ...) and a
message naming the field or the reason; the servicers turn it into the RPC's status.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from pdgrpc.errors import PdgrpcError
from pdgrpc.metrics.catalog import ServerAbortReason

if TYPE_CHECKING:
    from pdgrpc.metrics.reasons import AnyAbortReason

__all__ = ["RequestFailed", "WorkerLinkLost"]


class RequestFailed(PdgrpcError):
    """``reason``: why an admitted request ended, for ``pdgrpc_aborts_total`` (the status
    code alone cannot tell e.g. a transfer timeout from a handshake timeout)."""

    def __init__(self, code: grpc.StatusCode, message: str, reason: AnyAbortReason = ServerAbortReason.INTERNAL_ERROR) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason


class WorkerLinkLost(PdgrpcError):
    """The controller's link to a worker closed: the worker died (or broke the protocol,
    and then stops)."""
