"""Table-driven tests of the decode request machine: every (state, event) pair, and every
state's deadline."""

from __future__ import annotations

import itertools

import pytest

from pdgrpc.errors import IllegalTransition
from pdgrpc.state import AbortReason, DecodeDeadlines, DecodeRequest, DecodeState
from pdgrpc.state.decode_request import (
    TERMINAL_STATES,
    TIMEOUT_REASON,
    TRANSITIONS,
    Abort,
    DecodeEvent,
    DpRankResolved,
    MemoryAllocated,
    PrefillReady,
    TransferDone,
    TransferStarted,
    state_limits,
    timeout_message,
)

S = DecodeState
LIMITS = state_limits(DecodeDeadlines(resolve_dp_rank_s=1, allocate_s=2, bootstrap_s=3, waiting_for_input_s=4, transferring_s=5))
EVENTS: list[DecodeEvent] = [
    DpRankResolved(1),
    MemoryAllocated(3, (4, 5)),
    PrefillReady(),
    TransferStarted(),
    TransferDone(),
    Abort(AbortReason.CANCELLED, "client gone"),
]
# The path that reaches each state from a fresh request.
PATH = [DpRankResolved(1), MemoryAllocated(3, (4, 5)), PrefillReady(), TransferStarted(), TransferDone()]
ORDER = [S.RESOLVING_DP_RANK, S.WAITING_FOR_MEMORY, S.BOOTSTRAPPING, S.WAITING_FOR_INPUT, S.TRANSFERRING, S.COMMITTED]


def request_in(state: DecodeState, now: float = 0.0) -> DecodeRequest:
    r = DecodeRequest(99, now, LIMITS)
    if state is S.ABORTED:
        r.handle(Abort(AbortReason.CANCELLED, "x"), now)
        return r
    for ev in PATH[: ORDER.index(state)]:
        r.handle(ev, now)
    assert r.state is state
    return r


EXPECTED = {
    (S.RESOLVING_DP_RANK, DpRankResolved): S.WAITING_FOR_MEMORY,
    (S.WAITING_FOR_MEMORY, MemoryAllocated): S.BOOTSTRAPPING,
    (S.BOOTSTRAPPING, PrefillReady): S.WAITING_FOR_INPUT,
    (S.WAITING_FOR_INPUT, TransferStarted): S.TRANSFERRING,
    (S.TRANSFERRING, TransferDone): S.COMMITTED,
    **{(s, Abort): S.ABORTED for s in S if s not in TERMINAL_STATES},
}


def test_the_table_is_exactly_the_documented_one() -> None:
    assert TRANSITIONS == EXPECTED


@pytest.mark.parametrize("state, event", list(itertools.product(S, EVENTS)), ids=lambda x: getattr(x, "name", type(x).__name__))
def test_every_state_event_pair(state: DecodeState, event: DecodeEvent) -> None:
    r = request_in(state, now=1.0)
    before = (r.state, r.deadline, r.slot, r.pages, r.dp_rank)
    target = EXPECTED.get((state, type(event)))
    if target is None:
        with pytest.raises(IllegalTransition, match=f"{type(event).__name__} is not allowed in state {state.name}"):
            r.handle(event, 2.0)
        assert (r.state, r.deadline, r.slot, r.pages, r.dp_rank) == before  # unchanged
    else:
        assert r.handle(event, 2.0) is target and r.state is target
        if target in TERMINAL_STATES:
            assert r.deadline == float("inf")
        else:
            assert r.deadline == 2.0 + LIMITS[target]  # the clock restarts in the new state


def test_events_carry_their_data() -> None:
    r = DecodeRequest(99, 0.0, LIMITS, dp_rank=2)
    assert r.state is S.WAITING_FOR_MEMORY and r.dp_rank == 2
    r.handle(MemoryAllocated(7, (1, 2)), 0.0)
    assert (r.slot, r.pages) == (7, (1, 2))


@pytest.mark.parametrize(
    "state, reason",
    [
        (S.RESOLVING_DP_RANK, AbortReason.RESOLVE_DP_RANK_TIMEOUT),
        (S.WAITING_FOR_MEMORY, AbortReason.ALLOCATE_TIMEOUT),
        (S.BOOTSTRAPPING, AbortReason.BOOTSTRAP_TIMEOUT),
        (S.WAITING_FOR_INPUT, AbortReason.WAITING_FOR_INPUT_TIMEOUT),
        (S.TRANSFERRING, AbortReason.TRANSFER_TIMEOUT),
    ],
)
def test_every_non_terminal_state_has_a_deadline(state: DecodeState, reason: AbortReason) -> None:
    r = request_in(state, now=10.0)
    assert r.deadline == 10.0 + LIMITS[state] and TIMEOUT_REASON[state] is reason
    message = timeout_message(state, LIMITS[state], r.room)
    assert state.name in message and f"{LIMITS[state]:g} s" in message
