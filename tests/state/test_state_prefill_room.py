"""The fate of one room on a prefill rank, driven with no loop and no socket."""

from __future__ import annotations

import itertools

import pytest

from pdgrpc.errors import IllegalTransition
from pdgrpc.state.prefill_room import ROOM_TRANSITIONS, Abort, Close, Failed, PrefillRoom, RoomState

R = RoomState
EVENTS = [Abort("decode gave up"), Abort("shutting down", shutdown=True), Failed("ABORTED"), Close()]


def room_in(state: RoomState) -> PrefillRoom[str]:
    paths = {
        R.RUNNING: [],
        R.ABORTING: [Abort("decode gave up")],
        R.FAILED: [Failed("INTERNAL")],
        R.CLOSING: [Close()],
    }
    r: PrefillRoom[str] = PrefillRoom(7)
    for ev in paths[state]:
        r.handle(ev)
    assert r.state is state
    return r


@pytest.mark.parametrize("state, event", list(itertools.product(R, EVENTS)), ids=str)
def test_an_event_the_state_does_not_accept_raises_and_changes_nothing(state: RoomState, event: object) -> None:
    r = room_in(state)
    before = (r.state, r.abort, r.failure)
    if (state, type(event)) in ROOM_TRANSITIONS:
        r.handle(event)  # type: ignore[arg-type]
        return
    with pytest.raises(IllegalTransition, match=f"room 7: event {type(event).__name__}"):
        r.handle(event)  # type: ignore[arg-type]
    assert (r.state, r.abort, r.failure) == before


def test_an_abort_stops_a_running_room_and_the_latest_names_it() -> None:
    r: PrefillRoom[str] = PrefillRoom(7)
    assert r.stoppable and r.abort is None  # a cancellation now is its caller's
    r.handle(Abort("decode gave up"))
    assert r.stoppable and r.abort == Abort("decode gave up")
    r.handle(Abort("shutting down", shutdown=True))
    assert r.abort is not None and r.abort.shutdown


def test_a_room_that_ended_has_nothing_left_to_stop() -> None:
    for state in (R.FAILED, R.CLOSING):
        r = room_in(state)
        r.handle(Abort("late"))
        assert not r.stoppable and r.abort is None and r.state is state


def test_its_failure_is_what_its_decode_is_told_once_it_closes() -> None:
    r = room_in(R.ABORTING)
    r.handle(Failed("ABORTED: decode gave up"))
    r.handle(Close())
    assert r.state is R.CLOSING and r.failure == "ABORTED: decode gave up"
    ok = room_in(R.RUNNING)
    ok.handle(Close())
    assert ok.state is R.CLOSING and ok.failure is None
