"""The fate of one decode request, from admission to its last message, h11 style.

::

    WAITING --HandshakeAccepted--> HANDSHAKEN --Commit--> RUNNING --Finish--> FINISHED
    WAITING --ComputeHere--> COMPUTING --Commit--> RUNNING   (local prefill: no prefill, no queues)
    WAITING, HANDSHAKEN --Cancel--> ABORTING      (the decode queues abort it)
    COMPUTING, RUNNING --Cancel--> STOPPING       (the next compute step drops it)
    (any non-terminal) --Fail--> FAILED

:class:`~pdgrpc.state.decode_request.DecodeRequest` follows the transfer inside the decode
queues; this machine follows what decides how the request ends: whether its handshake was
accepted, whether an end was decided and with which failure, and the errors that name
the cause when a deadline ends it. The reports (:class:`CallFailed`, :class:`CallAnswered`,
:class:`TransportFailed`, :class:`NeverForwarded`) keep the state; a report, or a late
:class:`HandshakeAccepted`, for a request that has ended is ignored (it arrives from a
task that outlived it). Any other event the state does not accept raises
:class:`~pdgrpc.errors.IllegalTransition` and leaves the state unchanged.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Union

from pdgrpc.errors import IllegalTransition, RequestFailed
from pdgrpc.kvpoll import KVPoll

__all__ = [
    "CallAnswered", "CallFailed", "Cancel", "Commit", "ComputeHere", "DecodeFate", "FATE_TRANSITIONS", "Fail", "FateEvent", "FateState",
    "Finish", "HandshakeAccepted", "NeverForwarded", "TransportFailed",
]  # fmt: skip


class FateState(enum.Enum):
    __hash__ = object.__hash__  # identity hashing: table lookups stay in C

    WAITING = "waiting"  # in the decode queues; its handshake not accepted yet
    HANDSHAKEN = "handshaken"  # every prefill worker accepted the handshake; KV on its way
    COMPUTING = "computing"  # local prefill: the decode computes the prompt itself
    RUNNING = "running"  # committed: generating
    ABORTING = "aborting"  # an end was decided before commit: the decode queues abort it
    STOPPING = "stopping"  # an end was decided while running: the next step drops it
    FINISHED = "finished"  # its last tokens are queued
    FAILED = "failed"  # its failure is queued


# -- events: what happened to the request ------------------------------------------------
@dataclasses.dataclass(frozen=True)
class HandshakeAccepted:
    """Every prefill worker of its dp rank accepted the handshake."""


@dataclasses.dataclass(frozen=True)
class Commit:
    """Its first token is known: the transfer poll committed it, or its local prefill
    computed the prompt."""


@dataclasses.dataclass(frozen=True)
class ComputeHere:
    """It asked for a local prefill: the decode computes its prompt, nothing is received."""


@dataclasses.dataclass(frozen=True)
class Cancel:
    """End it: the client went away (``failure`` None), or the driver learned how it ends."""

    failure: RequestFailed | None = None


@dataclasses.dataclass(frozen=True)
class Finish:
    """Its last token is queued."""


@dataclasses.dataclass(frozen=True)
class Fail:
    """Its failure, the last message of its stream, is queued."""

    failure: RequestFailed


@dataclasses.dataclass(frozen=True)
class CallFailed:
    """A bootstrap query or a handshake attempt failed (retried); ``error`` names why."""

    error: str


@dataclasses.dataclass(frozen=True)
class CallAnswered:
    """Its bootstrap answered: an earlier failure is no longer why it waits."""


@dataclasses.dataclass(frozen=True)
class TransportFailed:
    why: str | None  # the transport's reason for failing the room


@dataclasses.dataclass(frozen=True)
class NeverForwarded:
    """The prefill's controller forwarded it to no worker: nothing writes into its pages."""


FateEvent = Union[HandshakeAccepted, Commit, ComputeHere, Cancel, Finish, Fail, CallFailed, CallAnswered, TransportFailed, NeverForwarded]

S = FateState
_TERMINAL = frozenset({S.FINISHED, S.FAILED})
_NON_TERMINAL = tuple(s for s in S if s not in _TERMINAL)
_REPORTS = (CallFailed, CallAnswered, TransportFailed, NeverForwarded)

FATE_TRANSITIONS: dict[tuple[FateState, type], FateState] = {
    (S.WAITING, HandshakeAccepted): S.HANDSHAKEN,
    (S.ABORTING, HandshakeAccepted): S.ABORTING,  # accepted after its end was decided: it still ends
    (S.HANDSHAKEN, Commit): S.RUNNING,
    (S.WAITING, ComputeHere): S.COMPUTING,
    (S.COMPUTING, Commit): S.RUNNING,
    (S.COMPUTING, Cancel): S.STOPPING,
    (S.WAITING, Cancel): S.ABORTING,
    (S.HANDSHAKEN, Cancel): S.ABORTING,
    (S.ABORTING, Cancel): S.ABORTING,
    (S.RUNNING, Cancel): S.STOPPING,
    (S.STOPPING, Cancel): S.STOPPING,
    (S.RUNNING, Finish): S.FINISHED,
    **{(s, Fail): S.FAILED for s in _NON_TERMINAL},
    **{(s, e): s for s in S for e in _REPORTS},
    **{(s, HandshakeAccepted): s for s in _TERMINAL},
}


class DecodeFate:
    """One request's fate (see the module doc). Not thread-safe."""

    __slots__ = ("state", "decided", "last_error", "transport_error", "never_forwarded")

    def __init__(self) -> None:
        self.state = S.WAITING
        self.decided: RequestFailed | None = None  # how it ends, when the driver learned it
        self.last_error = ""  # the last failed bootstrap query or handshake attempt
        self.transport_error: str | None = None  # the transport's reason for the first FAILED
        self.never_forwarded = False

    def handle(self, event: FateEvent) -> FateState:
        try:
            new = FATE_TRANSITIONS[(self.state, type(event))]
        except KeyError:
            raise IllegalTransition(f"event {type(event).__name__} is not allowed in state {self.state.name}") from None
        if self.state in _TERMINAL:
            return self.state  # a late report changes nothing
        if isinstance(event, Cancel):
            if event.failure is not None:
                self.decided = event.failure
        elif isinstance(event, CallFailed):
            self.last_error = event.error
        elif isinstance(event, CallAnswered):
            self.last_error = ""
        elif isinstance(event, TransportFailed):
            if self.transport_error is None:
                self.transport_error = event.why
        elif isinstance(event, NeverForwarded):
            self.never_forwarded = True
        self.state = new
        return new

    # -- what it decides ----------------------------------------------------------------------
    @property
    def ended(self) -> bool:  # its last message is queued
        return self.state in _TERMINAL

    @property
    def live(self) -> bool:  # not ended, and no end decided
        return self.state in (S.WAITING, S.HANDSHAKEN, S.COMPUTING, S.RUNNING)

    @property
    def ending(self) -> bool:  # an end was decided and is not carried out yet
        return self.state in (S.ABORTING, S.STOPPING)

    @property
    def in_queues(self) -> bool:  # before its commit: the decode queues hold it and carry out its cancel
        return self.state in (S.WAITING, S.HANDSHAKEN, S.ABORTING)

    def vote(self, local: KVPoll) -> KVPoll:
        """This rank's poll state of the room given its transport's: BOOTSTRAPPING at most
        until the handshake is accepted, so the bootstrap deadline covers an unanswered
        handshake."""
        return local if self.state is not S.WAITING else min(local, KVPoll.BOOTSTRAPPING)

    def outcome(self, otherwise: RequestFailed) -> RequestFailed:
        """The failure it ends with: the one the driver learned, else ``otherwise``."""
        return self.decided if self.decided is not None else otherwise
