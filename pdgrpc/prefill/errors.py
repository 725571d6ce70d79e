"""A request that ends with a gRPC status: the one error type prefill's drivers raise.

Drivers raise :class:`RequestFailed` with the status code the proto documents for the
case (INVALID_ARGUMENT, FAILED_PRECONDITION, DEADLINE_EXCEEDED, ABORTED, ...) and a
message naming the field or the reason; the servicers turn it into the RPC's status.
"""

from __future__ import annotations

import grpc

from pdgrpc.errors import PdgrpcError

__all__ = ["RequestFailed"]


class RequestFailed(PdgrpcError):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
