"""gRPC failures mapped into pdgrpc's exception tree, at the client boundary.

Client code calls :func:`map_rpc_error` wherever it catches ``grpc.RpcError``; callers
above it see only :class:`RpcError` (a :class:`~pdgrpc.errors.PdgrpcError`) carrying the
status code, the server's message, the method and target, and decide by the code::

    try:
        await client.register_dp_ranks({room: 3})
    except RpcError as e:
        if e.code != grpc.StatusCode.ALREADY_EXISTS:  # the room is registered with another rank
            raise

:class:`Unavailable` is the one code with a class of its own: it is the one a caller
retries (with backoff), so it is the one caught apart from the rest.
"""

from __future__ import annotations

from typing import Any

import grpc

from pdgrpc.errors import PdgrpcError
from pdgrpc.reasons import AnyAbortReason, abort_label

__all__ = ["REASON_KEY", "REQUEST_INVALID", "RpcError", "Unavailable", "map_rpc_error", "reason_metadata", "reason_of"]

# Trailing metadata key of the abort reason (``peer_failure``, ``drain_timeout``, ...) a
# pdgrpc server ends a failed call with: a status without it came from the connection
# (the server is gone, the stream was reset), not from the server.
REASON_KEY = "pdgrpc-reason"

# The codes by which a server refuses the request itself (a field out of range, a prompt
# past the context): the client's mistake, which fails the same on every instance, so it
# is counted as ``bad_request`` and never sent again elsewhere.
REQUEST_INVALID = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE})


def reason_metadata(reason: AnyAbortReason) -> tuple[tuple[str, str], ...]:
    """The trailing metadata that names ``reason`` (for ``context.abort``)."""
    return ((REASON_KEY, abort_label(reason)),)


def reason_of(exc: Any) -> str | None:
    """The abort reason a pdgrpc server named for the failed call ``exc``; None when the
    status did not come from a pdgrpc server's abort (the connection failed)."""
    trailing = getattr(exc, "trailing_metadata", None)
    pairs = trailing() if callable(trailing) else None
    for key, value in pairs or ():
        if key == REASON_KEY:
            return value if isinstance(value, str) else value.decode(errors="replace")
    return None


class RpcError(PdgrpcError):
    """A gRPC call failed. ``code`` is the ``grpc.StatusCode``, ``details`` the server's
    message, ``method`` the full method name, ``target`` the address called."""

    def __init__(self, code: grpc.StatusCode, details: str, *, method: str = "", target: str = "") -> None:
        self.code = code
        self.details = details
        self.method = method
        self.target = target
        where = f"{method} on {target}" if target else method
        super().__init__(f"{where}: {code.name}: {details}" if where else f"{code.name}: {details}")


class Unavailable(RpcError):
    """``UNAVAILABLE``: the server is unreachable or not ready yet; retry with backoff."""


def map_rpc_error(exc: grpc.RpcError, *, method: str = "", target: str = "") -> RpcError:
    """Turn a ``grpc.RpcError`` (sync or aio) into the matching :class:`RpcError`.
    Raise the result ``from exc`` so the original stays attached."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    if code is None:
        code = grpc.StatusCode.UNKNOWN
    return (Unavailable if code == grpc.StatusCode.UNAVAILABLE else RpcError)(code, details or "", method=method, target=target)
