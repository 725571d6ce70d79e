"""The one exception tree of pdgrpc.

Every error pdgrpc raises on purpose derives from :class:`PdgrpcError`. Library errors
(grpc, socket, UCX) are mapped into this tree at the boundary where they occur, so a
caller can ``except PdgrpcError`` without knowing which backend was in use. Areas add
narrower subclasses in their own modules; the branches below are the shared ones.
"""

from __future__ import annotations


class PdgrpcError(Exception):
    """Base class of every error pdgrpc raises."""


class ConfigError(PdgrpcError, ValueError):
    """Invalid configuration or argument (bad flag, inconsistent sizes, bad topology)."""


class StateError(PdgrpcError):
    """A state machine was asked to do something its current state does not allow."""


class IllegalTransition(StateError):
    """An event that the current state does not accept. The state is left unchanged."""


class SlotError(StateError):
    """Misuse of a slot or page allocator (double free, freeing an unallocated index)."""


class BootstrapError(PdgrpcError):
    """A bootstrap call failed (after retries, where the call is retried)."""


class CompatibilityError(PdgrpcError):
    """The two sides cannot exchange KV: their compatibility hashes or topologies differ."""


class TransportError(PdgrpcError):
    """A data-plane failure, whatever the backend."""


class TransportUnavailable(TransportError):
    """A transport backend cannot be loaded (unknown name, or an optional dependency is
    missing; the message carries the install hint)."""


class PeerFailure(TransportError):
    """The peer disconnected, died, or stopped answering its liveness checks."""


class UnauthorizedWrite(TransportError):
    """A write outside what the receiver advertised for the room (unknown room, page
    outside the advertised set, or offset/length outside a registered region)."""


class EngineError(PdgrpcError):
    """The serving engine refused or failed a request (e.g. a prompt over its limit)."""
