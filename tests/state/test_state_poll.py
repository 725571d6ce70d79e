"""KVPoll advance: forward only, FAILED wins."""

from __future__ import annotations

import itertools

import pytest

from pdgrpc.state import KVPoll, advance

P = KVPoll


def test_kvpoll_is_reexported_with_its_load_bearing_order() -> None:
    import pdgrpc.kvpoll

    assert KVPoll is pdgrpc.kvpoll.KVPoll
    assert [int(s) for s in (P.FAILED, P.BOOTSTRAPPING, P.WAITING_FOR_INPUT, P.TRANSFERRING, P.SUCCESS)] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("current, reported", list(itertools.product(P, P)))
def test_advance_table(current: KVPoll, reported: KVPoll) -> None:
    new = advance(current, reported)
    if P.FAILED in (current, reported):
        assert new is P.FAILED  # FAILED always wins and is sticky
    else:
        assert new is max(current, reported)  # forward only: a late lower report is ignored

