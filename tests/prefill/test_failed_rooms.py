"""pdgrpc.prefill.failed: the failed-room table is bounded in count and age, and a watch
answers when its room ends (issue 17)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdgrpc.prefill.failed import FailedRooms, Failure, TooManyWatches
from pdgrpc.serving.room_proof import draw_secret, watch_proof


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def failure(why: str = "boom", secret: bytes = b"") -> Failure:
    return Failure(grpc.StatusCode.INTERNAL, why, secret)


def test_the_table_forgets_the_oldest_and_the_expired() -> None:
    clock = Clock()
    t = FailedRooms(capacity=2, ttl_s=10.0, clock=clock)
    t.record(1, failure("one"))
    t.record(2, failure("two"))
    t.record(3, failure("three"))
    assert t.get(1) is None and t.get(2) is not None and len(t) == 2
    clock.t = 10.5
    t.record(4, failure("four"))
    assert t.get(2) is None and t.get(3) is None and t.get(4) is not None


def test_a_watch_proof_is_checked_under_the_rooms_secret() -> None:
    secret = draw_secret()
    f = failure(secret=secret)
    assert FailedRooms.proves(f, b"", 7, watch_proof(secret, 7))
    assert not FailedRooms.proves(f, b"", 7, watch_proof(secret, 8))
    assert not FailedRooms.proves(f, b"", 7, b"")
    assert FailedRooms.proves(None, secret, 7, watch_proof(secret, 7))
    assert FailedRooms.proves(None, b"", 7, b"")  # no secret known: nothing to prove


async def test_a_watch_answers_when_its_room_ends_and_watches_are_bounded() -> None:
    t = FailedRooms(max_watches=1)
    held = asyncio.ensure_future(t.watch(5, 10.0))
    await asyncio.sleep(0)
    with pytest.raises(TooManyWatches):
        await t.watch(6, 10.0)
    t.record(5, failure())
    assert await held is True
    assert await t.watch(6, 0.01) is False  # the slot is free again; nothing ended
    ended = asyncio.ensure_future(t.watch(6, 10.0))
    await asyncio.sleep(0)
    t.ended(6)
    assert await ended is True and t.get(6) is None
