"""The engine's narrower errors (the shared tree is :mod:`pdgrpc.errors`)."""

from __future__ import annotations

from pdgrpc.errors import EngineError

__all__ = ["InvalidRequest"]


class InvalidRequest(EngineError, ValueError):
    """A request (prompt, pages, sampling parameters) the engine refuses; the message
    names the offending field. Servers map it to INVALID_ARGUMENT."""
