"""KVPoll combine (MIN across ranks) and advance (forward only, FAILED wins, untracked ignored)."""

from __future__ import annotations

import itertools

import pytest

from pdgrpc.errors import StateError
from pdgrpc.state import KVPoll, RoomStatusTable, advance, combine

P = KVPoll


def test_kvpoll_is_reexported_with_its_load_bearing_order() -> None:
    import pdgrpc.kvpoll

    assert KVPoll is pdgrpc.kvpoll.KVPoll
    assert [int(s) for s in (P.FAILED, P.BOOTSTRAPPING, P.WAITING_FOR_INPUT, P.TRANSFERRING, P.SUCCESS)] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    "states, expected",
    [
        ([P.SUCCESS], P.SUCCESS),
        ([P.SUCCESS, P.TRANSFERRING], P.TRANSFERRING),
        ([P.SUCCESS, P.SUCCESS, P.SUCCESS, P.BOOTSTRAPPING], P.BOOTSTRAPPING),
        ([P.SUCCESS, P.FAILED, P.SUCCESS], P.FAILED),
        ([P.WAITING_FOR_INPUT, P.TRANSFERRING], P.WAITING_FOR_INPUT),
    ],
)
def test_combine_is_min_across_ranks(states: list[KVPoll], expected: KVPoll) -> None:
    assert combine(states) is expected


def test_combine_of_nothing_is_an_error_not_success() -> None:
    with pytest.raises(StateError):
        combine([])


@pytest.mark.parametrize("current, reported", list(itertools.product(P, P)))
def test_advance_table(current: KVPoll, reported: KVPoll) -> None:
    new = advance(current, reported)
    if P.FAILED in (current, reported):
        assert new is P.FAILED  # FAILED always wins and is sticky
    else:
        assert new is max(current, reported)  # forward only: a late lower report is ignored


def test_room_table_tracks_forward_and_ignores_untracked_failures() -> None:
    t = RoomStatusTable()
    t.track(7)
    assert t.get(7) is P.BOOTSTRAPPING
    assert t.report(7, P.TRANSFERRING) is P.TRANSFERRING
    assert t.report(7, P.WAITING_FOR_INPUT) is P.TRANSFERRING
    assert t.report(7, P.FAILED) is P.FAILED
    assert t.report(7, P.SUCCESS) is P.FAILED
    t.untrack(7)
    assert t.report(7, P.FAILED) is None and 7 not in t and len(t) == 0
    with pytest.raises(StateError, match="already tracked"):
        t.track(8)
        t.track(8)
