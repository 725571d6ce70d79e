"""The router: pdgrpc's front door for clients (``pdgrpc.v1.GenerateService``).

* :mod:`pdgrpc.router.service` -- :class:`GenerateServicer`: draws the bootstrap room,
  sends Prefill and Decode at once, streams the decode's tokens back as text deltas,
  propagates failures both ways, cancels both sides when the client goes away.
* ``python -m pdgrpc.router --help`` -- the router as a process.
"""


from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Names load on first use (PEP 562), so ``python -m pdgrpc.router`` (which imports this
# package before __main__) can configure gRPC before anything imports grpc.
_EXPORTS = {name: "pdgrpc.router.service" for name in ("GenerateServicer", "PrefillBackend", "RouterConfig", "draw_room", "parse_prefill")}

if TYPE_CHECKING:  # for type checkers and IDEs
    from pdgrpc.router.service import GenerateServicer, PrefillBackend, RouterConfig, draw_room, parse_prefill

__all__ = ["GenerateServicer", "PrefillBackend", "RouterConfig", "draw_room", "parse_prefill"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
