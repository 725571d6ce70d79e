"""gRPC failures mapped into pdgrpc's exception tree, at the client boundary.

Client code calls :func:`map_rpc_error` wherever it catches ``grpc.RpcError``; callers
above it see only :class:`RpcError` subclasses (all :class:`~pdgrpc.errors.PdgrpcError`),
chosen by status code, carrying the code, the server's message, the method and target::

    try:
        await client.register_dp_ranks({room: 3})
    except AlreadyExists as e:       # the room is registered with another rank
        ...
    except PdgrpcError:              # anything else pdgrpc raised
        ...
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


class InvalidArgument(RpcError, ValueError):
    """``INVALID_ARGUMENT``: the request itself is wrong; retrying it cannot help."""


class NotFound(RpcError):
    """``NOT_FOUND``."""


class AlreadyExists(RpcError):
    """``ALREADY_EXISTS``: e.g. a room registered with a different dp rank."""


class FailedPrecondition(RpcError):
    """``FAILED_PRECONDITION``: e.g. a worker's topology disagrees with its instance's."""


class ResourceExhausted(RpcError):
    """``RESOURCE_EXHAUSTED``: e.g. a message over the size limit."""


class Unavailable(RpcError):
    """``UNAVAILABLE``: the server is unreachable or not ready yet; retry with backoff."""


class DeadlineExceeded(RpcError, TimeoutError):
    """``DEADLINE_EXCEEDED``: the call's deadline passed before it finished."""


class Cancelled(RpcError):
    """``CANCELLED``."""


_BY_CODE: dict[grpc.StatusCode, type[RpcError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
}


def error_class(code: grpc.StatusCode) -> type[RpcError]:
    """The :class:`RpcError` subclass for a status code (``RpcError`` itself for others)."""
    return _BY_CODE.get(code, RpcError)


def map_rpc_error(exc: grpc.RpcError, *, method: str = "", target: str = "") -> RpcError:
    """Turn a ``grpc.RpcError`` (sync or aio) into the matching :class:`RpcError`.
    Raise the result ``from exc`` so the original stays attached."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    if code is None:
        code = grpc.StatusCode.UNKNOWN
    return error_class(code)(code, details or "", method=method, target=target)
