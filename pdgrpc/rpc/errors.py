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

import grpc

from pdgrpc.errors import PdgrpcError


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
