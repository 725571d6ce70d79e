"""gRPC plumbing shared by every pdgrpc server and client.

* :mod:`pdgrpc.rpc.server` — start a ``grpc.aio`` server with ``grpc.health.v1`` and
  reflection, log where it listens, stop gracefully on SIGTERM/SIGINT; :func:`run` puts
  a main coroutine on uvloop when available.
* :mod:`pdgrpc.rpc.channels` — :class:`ChannelPool`: one channel per address, reused.
* :mod:`pdgrpc.rpc.errors` — ``grpc.RpcError`` → pdgrpc's exception tree, by status code.
* :mod:`pdgrpc.rpc.retry` — capped exponential backoff with full jitter.
* :mod:`pdgrpc.rpc.tuning` — process-wide gRPC settings for pdgrpc's entry points.
* :mod:`pdgrpc.rpc.security` — TLS, mTLS and the bearer token of every server and client
  (:class:`Security`, the ``--tls-*`` / ``--auth-token-file`` / ``--insecure`` flags);
  :mod:`pdgrpc.rpc.certs` — a throwaway CA and certificates (``--tls auto``).

Names are imported lazily, so ``import pdgrpc.rpc.tuning`` does not import grpc.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Backoff": "pdgrpc.rpc.retry",
    "ChannelPool": "pdgrpc.rpc.channels",
    "RpcError": "pdgrpc.rpc.errors",
    "RpcServer": "pdgrpc.rpc.server",
    "Security": "pdgrpc.rpc.security",
    "StopSignal": "pdgrpc.rpc.server",
    "map_rpc_error": "pdgrpc.rpc.errors",
    "run": "pdgrpc.rpc.server",
    "serve_until_signal": "pdgrpc.rpc.server",
    "shared_pool": "pdgrpc.rpc.channels",
    "start_server": "pdgrpc.rpc.server",
}

if TYPE_CHECKING:  # for type checkers and IDEs; at run time names load on first use
    from pdgrpc.rpc.channels import ChannelPool, shared_pool
    from pdgrpc.rpc.errors import RpcError, map_rpc_error
    from pdgrpc.rpc.retry import Backoff
    from pdgrpc.rpc.security import Security
    from pdgrpc.rpc.server import RpcServer, StopSignal, run, serve_until_signal, start_server

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pdgrpc.rpc' has no attribute {name!r}")
