"""The one exception tree of pdgrpc.

Every error pdgrpc raises on purpose derives from :class:`PdgrpcError`. Library errors
(grpc, socket, UCX) are mapped into this tree at the boundary where they occur, so a
caller can ``except PdgrpcError`` without knowing which backend was in use. Areas add
narrower subclasses in their own modules; the branches below are the shared ones.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from pdgrpc.reasons import AnyAbortReason, ServerAbortReason

if TYPE_CHECKING:  # an annotation only: this module loads before grpc is configured
    import grpc


class PdgrpcError(Exception):
    """Base class of every error pdgrpc raises."""


class RequestFailed(PdgrpcError):
    """The one outcome of a request that ends without (further) output, from the transport
    up to the router: ``code`` (the gRPC status its caller gets), ``reason`` (why, for
    ``pdgrpc_aborts_total``: a :class:`~pdgrpc.reasons.AbortReason` or a
    :class:`~pdgrpc.reasons.ServerAbortReason`) and ``message`` (for people).

    Raised where a request is refused or fails, queued where a stream reads it, and turned
    into the RPC's status at the servicer. Decisions read ``code`` and ``reason``, never
    the text of ``message``."""

    def __init__(self, code: grpc.StatusCode, message: str, reason: AnyAbortReason | None = None) -> None:
        super().__init__(message)
        if reason is None:
            reason = ServerAbortReason.INTERNAL_ERROR
        self.code = code
        self.message = message
        self.reason: AnyAbortReason = reason

    def __repr__(self) -> str:
        return f"RequestFailed({self.code.name}, {self.message!r}, {self.reason!r})"


class ConfigError(PdgrpcError, ValueError):
    """Invalid configuration or argument (bad flag, inconsistent sizes, bad topology).

    A configuration class's own checks also say which of its fields break which rule
    (:meth:`broken_rule`): ``fields`` maps each field's name (a dotted path from that class)
    to its value, and :meth:`worded` states the rule with other names for those fields, so
    that a layer which filled them from flags shows the flags its user typed. Any other
    ConfigError has no ``fields``, and its message is all there is."""

    def __init__(self, message: str, *, rule: _Rule | None = None) -> None:
        super().__init__(message)
        self._rule = rule

    @classmethod
    def broken_rule(cls, owner: str, template: str, fields: Mapping[str, object], **terms: object) -> ConfigError:
        """The error for ``fields`` (name: value, in the order ``template`` counts them)
        breaking a rule of ``owner``'s. ``template`` words the rule for :meth:`str.format`:
        ``{0}``, ``{1}``... are the fields' names, ``{0.value}`` the first one's value, and
        ``terms`` the rule's other values, by keyword (its bounds). The message names each
        field ``owner.name``."""
        rule = _Rule(template, dict(fields), terms)
        return cls(rule.word(lambda field: f"{owner}.{field}"), rule=rule)

    @property
    def fields(self) -> dict[str, object]:
        """Each field that breaks the rule, with its value (empty: not a configuration class's refusal)."""
        return {} if self._rule is None else dict(self._rule.fields)

    def worded(self, name: Callable[[str], str]) -> str:
        """The message with each field called ``name(field)`` (the message itself without fields)."""
        return str(self) if self._rule is None else self._rule.word(name)


@dataclasses.dataclass(frozen=True)
class _Rule:
    """A broken rule of a configuration class, for :class:`ConfigError`, words apart from names."""

    template: str
    fields: dict[str, object]
    terms: dict[str, object]

    def word(self, name: Callable[[str], str]) -> str:
        return self.template.format(*(_Mention(name(field), value) for field, value in self.fields.items()), **self.terms)


@dataclasses.dataclass(frozen=True)
class _Mention:
    """A field as a rule's template mentions it: ``{0}`` is its name, ``{0.value}`` its value."""

    name: str
    value: object

    def __format__(self, spec: str) -> str:
        return format(self.name, spec)


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


class BadDescriptor(TransportError):
    """A peer descriptor could not be parsed or is inconsistent (untrusted input)."""


class PeerFailure(TransportError):
    """The peer disconnected, died, or stopped answering its liveness checks."""


class Refusal(enum.IntEnum):
    """Why a receiver refused a write. The value travels in ``NACK`` (0: the room failed
    at the receiver for another reason, not a refused write)."""

    UNKNOWN_ROOM = 1  # never advertised, or already released
    ROOM_CLOSED = 2  # the room is already terminal (row landed, or failed)
    UNKNOWN_REGION = 3  # destination region not registered here
    WRONG_KIND = 4  # page bytes into a metadata region, or a row into a KV region
    OUTSIDE_REGION = 5  # bytes past the region's end (or an empty / negative range)
    OUTSIDE_GRANT = 6  # a page the room was not granted
    WRONG_SLOT = 7  # a metadata slot the room was not granted (or none was)
    MALFORMED = 8  # a second row, or a row whose size disagrees with its header
    BYTE_COUNT = 9  # more KV bytes landed than announced before the row, or written than granted

    @classmethod
    def from_code(cls, code: int) -> "Refusal | None":
        try:
            return cls(code)
        except ValueError:
            return None


class UnauthorizedWrite(TransportError):
    """A receiver refused a write: outside what it advertised for the room (unknown
    room, page outside the advertised set, offset/length outside a registered region),
    or for a room already finished. ``refusal`` says which; the message names the
    offending op."""

    def __init__(self, refusal: Refusal, message: str) -> None:
        super().__init__(f"unauthorized write: {message}")
        self.refusal = refusal


class EngineError(PdgrpcError):
    """The serving engine refused or failed a request (e.g. a prompt over its limit)."""
