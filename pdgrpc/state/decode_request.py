"""The decode-side machine of one request, h11 style: states, events, a transition table.

::

    RESOLVING_DP_RANK --DpRankResolved--> WAITING_FOR_MEMORY --MemoryAllocated--> BOOTSTRAPPING
    BOOTSTRAPPING --PrefillReady--> WAITING_FOR_INPUT --TransferStarted--> TRANSFERRING
    TRANSFERRING --TransferDone--> COMMITTED
    (any non-terminal) --Abort--> ABORTED

An event the current state does not accept raises :class:`~pdgrpc.errors.IllegalTransition`
and leaves the state unchanged. Every non-terminal state has a deadline, counted from
entering it (:class:`~pdgrpc.state.config.DecodeDeadlines`); the decode queues abort an
overdue request with the reason that names the state (:data:`TIMEOUT_REASON`).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Union

from pdgrpc.errors import IllegalTransition
from pdgrpc.state.config import DecodeDeadlines
from pdgrpc.state.outcomes import AbortReason

__all__ = [
    "Abort",
    "DecodeEvent",
    "DecodeRequest",
    "DecodeState",
    "DpRankResolved",
    "MemoryAllocated",
    "PrefillReady",
    "TERMINAL_STATES",
    "TIMEOUT_REASON",
    "TRANSITIONS",
    "TransferDone",
    "TransferStarted",
]


class DecodeState(enum.Enum):
    # Members are singletons: identity hashing keeps the per-event table lookups in C
    # (Enum's default hashes the name in Python).
    __hash__ = object.__hash__

    RESOLVING_DP_RANK = "resolving_dp_rank"
    WAITING_FOR_MEMORY = "waiting_for_memory"
    BOOTSTRAPPING = "bootstrapping"
    WAITING_FOR_INPUT = "waiting_for_input"
    TRANSFERRING = "transferring"
    COMMITTED = "committed"
    ABORTED = "aborted"


@dataclasses.dataclass(frozen=True)
class DpRankResolved:
    dp_rank: int


@dataclasses.dataclass(frozen=True)
class MemoryAllocated:
    slot: int
    pages: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class PrefillReady:
    """Every TP rank's transport reached WAITING_FOR_INPUT (handshake accepted)."""


@dataclasses.dataclass(frozen=True)
class TransferStarted:
    """The reduced poll state reached TRANSFERRING."""


@dataclasses.dataclass(frozen=True)
class TransferDone:
    """Reduced SUCCESS: KV complete and the expected room in the slot on every rank."""


@dataclasses.dataclass(frozen=True)
class Abort:
    reason: AbortReason
    message: str


DecodeEvent = Union[DpRankResolved, MemoryAllocated, PrefillReady, TransferStarted, TransferDone, Abort]

S = DecodeState
TERMINAL_STATES = frozenset({S.COMMITTED, S.ABORTED})
NON_TERMINAL_STATES = tuple(s for s in S if s not in TERMINAL_STATES)

TRANSITIONS: dict[tuple[DecodeState, type], DecodeState] = {
    (S.RESOLVING_DP_RANK, DpRankResolved): S.WAITING_FOR_MEMORY,
    (S.WAITING_FOR_MEMORY, MemoryAllocated): S.BOOTSTRAPPING,
    (S.BOOTSTRAPPING, PrefillReady): S.WAITING_FOR_INPUT,
    (S.WAITING_FOR_INPUT, TransferStarted): S.TRANSFERRING,
    (S.TRANSFERRING, TransferDone): S.COMMITTED,
    **{(s, Abort): S.ABORTED for s in NON_TERMINAL_STATES},
}

TIMEOUT_REASON: dict[DecodeState, AbortReason] = {
    S.RESOLVING_DP_RANK: AbortReason.RESOLVE_DP_RANK_TIMEOUT,
    S.WAITING_FOR_MEMORY: AbortReason.ALLOCATE_TIMEOUT,
    S.BOOTSTRAPPING: AbortReason.BOOTSTRAP_TIMEOUT,
    S.WAITING_FOR_INPUT: AbortReason.WAITING_FOR_INPUT_TIMEOUT,
    S.TRANSFERRING: AbortReason.TRANSFER_TIMEOUT,
}


def state_limits(deadlines: DecodeDeadlines) -> dict[DecodeState, float]:
    return {
        S.RESOLVING_DP_RANK: deadlines.resolve_dp_rank_s,
        S.WAITING_FOR_MEMORY: deadlines.allocate_s,
        S.BOOTSTRAPPING: deadlines.bootstrap_s,
        S.WAITING_FOR_INPUT: deadlines.waiting_for_input_s,
        S.TRANSFERRING: deadlines.transferring_s,
    }


def timeout_message(state: DecodeState, limit: float, room: int) -> str:
    return f"room {room}: deadline exceeded in state {state.name} (limit {limit:g} s)"


class DecodeRequest:
    """One request's decode-side state. Not thread-safe (nothing in pdgrpc.state is)."""

    __slots__ = ("room", "state", "deadline", "dp_rank", "slot", "pages", "_limits")

    def __init__(self, room: int, now: float, limits: dict[DecodeState, float], dp_rank: int | None = None) -> None:
        self.room = room
        self._limits = limits
        self.dp_rank: int | None = None
        self.slot: int | None = None
        self.pages: tuple[int, ...] = ()
        self.state = S.RESOLVING_DP_RANK
        self.deadline = now + limits[S.RESOLVING_DP_RANK]
        if dp_rank is not None:
            self.handle(DpRankResolved(dp_rank), now)

    @property
    def is_terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    def handle(self, event: DecodeEvent, now: float) -> DecodeState:
        try:
            new = TRANSITIONS[(self.state, type(event))]
        except KeyError:
            raise IllegalTransition(
                f"room {self.room}: event {type(event).__name__} is not allowed in state {self.state.name}"
            ) from None
        if isinstance(event, DpRankResolved):
            self.dp_rank = event.dp_rank
        elif isinstance(event, MemoryAllocated):
            self.slot, self.pages = event.slot, event.pages
        self.state = new
        self.deadline = now + self._limits[new] if new not in TERMINAL_STATES else float("inf")
        return new

    def __repr__(self) -> str:
        return f"DecodeRequest(room={self.room}, state={self.state.name}, slot={self.slot})"
