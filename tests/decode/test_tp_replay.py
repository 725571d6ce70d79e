"""pdgrpc.decode.tp: rank 0's queue calls, replayed on another rank's queues, keep the two
identical -- same slots, same pages, same commits and aborts in the same order -- when
each rank polls its own transport states and gates on its own metadata rows before the
MIN reduce. No processes here (the e2e TP tests run the real gloo group); the MIN
all-reduce is computed directly over the two ranks' poll tensors."""

from __future__ import annotations

import pickle

import pytest
import torch

from pdgrpc.decode.job import SchedulerConfig
from pdgrpc.decode.rank import make_queues
from pdgrpc.decode.tp import REPLAYED, ROOM_INFO, ReplicatedQueues
from pdgrpc.kvpoll import KVPoll
from pdgrpc.serving.metadata import metadata_layout, row_from_token
from pdgrpc.engine.base import SampledToken
from pdgrpc.state import Aborted, Committed, MetadataBuffers, NewRequest


class Rank:
    def __init__(self, leader: bool = False) -> None:
        self.buffers = MetadataBuffers(4, metadata_layout())
        config = SchedulerConfig()
        if leader:
            self.queues = ReplicatedQueues(self.buffers, 32, config.deadlines, config.query_interval_s)
        else:
            self.queues = make_queues(self.buffers, 32, config)
        self.local: dict[int, KVPoll] = {}

    def poll(self, room: int) -> KVPoll:
        return self.local.get(room, KVPoll.WAITING_FOR_INPUT)

    def land(self, room: int, slot: int) -> None:
        """The transport says SUCCESS and the row is in: the metadata gate opens."""
        self.local[room] = KVPoll.SUCCESS
        self.buffers.write_row(slot, row_from_token(SampledToken(7, -0.5)), room)


def replay(follower: Rank, log: list) -> list:
    # What travels is pickled: the replay must not depend on shared objects.
    out = []
    for name, args in pickle.loads(pickle.dumps(log)):
        if name == ROOM_INFO:
            continue
        assert name in REPLAYED
        out.append((name, getattr(follower.queues, name)(*args)))
    return out


def poll_both(leader: Rank, lq: ReplicatedQueues, follower: Rank, now: float) -> tuple[list, list]:
    replay(follower, lq.take_log())
    a = lq.prepare_poll(now, leader.poll)
    b = follower.queues.prepare_poll(now, follower.poll)
    reduced = torch.minimum(a, b)
    return lq.finish_poll(reduced, now), follower.queues.finish_poll(reduced, now)


def key(outcomes: list) -> list[tuple]:
    return [(type(o).__name__, o.room, getattr(o, "reason", None)) for o in outcomes]


def test_replayed_calls_allocate_and_commit_identically_even_when_one_rank_lags() -> None:
    leader, follower = Rank(leader=True), Rank()
    lq = leader.queues
    now = 100.0
    for room in (11, 12, 13):
        lq.note(ROOM_INFO, room, 1, 1)
        lq.add(NewRequest(room, "p:1", 2, 0), now)
    hs = lq.prealloc(now)
    got = dict(replay(follower, lq.take_log()))["prealloc"]
    assert [(h.room, h.slot, h.pages) for h in hs] == [(h.room, h.slot, h.pages) for h in got]

    # Rank 0's KV and row for rooms 11 and 12 landed; rank 1 has only room 12's so far.
    for h in hs[:2]:
        leader.land(h.room, h.slot)
    follower.land(12, hs[1].slot)
    lead, foll = poll_both(leader, lq, follower, now + 0.1)
    assert key(lead) == key(foll) == [("Committed", 12, None)]  # 11 waits for the slow rank
    # The slow rank's row arrives; room 13 is cancelled by the client on rank 0 only --
    # the cancel is replayed, so both abort it at the same poll.
    follower.land(11, hs[0].slot)
    lq.cancel(13, now + 0.2, "client went away")
    lead, foll = poll_both(leader, lq, follower, now + 0.3)
    assert key(lead) == key(foll)
    assert {(k[0], k[1]) for k in key(lead)} == {("Committed", 11), ("Aborted", 13)}
    assert isinstance(lead[0], (Committed, Aborted))
    # Freed slots are zeroed on both ranks: nothing can be misread by the next request.
    assert int(leader.buffers.room(hs[0].slot)) == int(follower.buffers.room(hs[0].slot)) == 0
    assert leader.queues.pages.num_free == follower.queues.pages.num_free


def test_a_room_corrupted_on_one_rank_aborts_on_every_rank_and_only_that_room() -> None:
    leader, follower = Rank(leader=True), Rank()
    lq = leader.queues
    now = 5.0
    for room in (21, 22):
        lq.add(NewRequest(room, "p:1", 1, 0), now)
    hs = lq.prealloc(now)
    for h in hs:
        leader.land(h.room, h.slot)
        follower.land(h.room, h.slot)
    follower.buffers.write_row(hs[0].slot, row_from_token(SampledToken(7, -0.5)), 999)  # not room 21
    lead, foll = poll_both(leader, lq, follower, now + 0.1)
    assert key(lead) == key(foll)
    by_room = {o.room: o for o in lead}
    assert isinstance(by_room[22], Committed)
    assert isinstance(by_room[21], Aborted) and by_room[21].reason.name == "METADATA_CORRUPTION"
    assert "another TP rank" in by_room[21].message  # rank 0's own row was fine


def test_only_state_changing_calls_are_logged_and_a_refused_call_is_not() -> None:
    leader = Rank(leader=True)
    lq = leader.queues
    lq.add(NewRequest(31, "p:1", 1, 0), 1.0)
    with pytest.raises(Exception):
        lq.add(NewRequest(31, "p:1", 1, 0), 1.0)  # duplicate room: raises, nothing to replay
    assert lq.slot_of(31) is None and lq.num_requests == 1  # reads pass through, unlogged
    assert [name for name, _ in lq.take_log()] == ["add"]
    assert lq.take_log() == []
