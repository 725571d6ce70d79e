"""The fate of one decode request, driven with no loop and no socket."""

from __future__ import annotations

import grpc
import pytest

from pdgrpc.errors import IllegalTransition, RequestFailed
from pdgrpc.kvpoll import KVPoll
from pdgrpc.state.decode_fate import (
    FATE_TRANSITIONS,
    CallAnswered,
    CallFailed,
    Cancel,
    Commit,
    ComputeHere,
    DecodeFate,
    Fail,
    FateEvent,
    FateState,
    Finish,
    HandshakeAccepted,
    NeverForwarded,
    TransportFailed,
)

F = FateState
REFUSED = RequestFailed(grpc.StatusCode.FAILED_PRECONDITION, "room 7: handshake refused")
CANCELLED = RequestFailed(grpc.StatusCode.CANCELLED, "room 7: cancelled")
EVENTS: list[FateEvent] = [
    HandshakeAccepted(), Commit(), ComputeHere(), Cancel(), Cancel(REFUSED), Finish(), Fail(CANCELLED),
    CallFailed("unavailable"), CallAnswered(), TransportFailed("peer closed"), NeverForwarded(),
]  # fmt: skip


def fate_in(state: FateState) -> DecodeFate:
    paths: dict[FateState, list[FateEvent]] = {
        F.WAITING: [],
        F.HANDSHAKEN: [HandshakeAccepted()],
        F.COMPUTING: [ComputeHere()],
        F.RUNNING: [HandshakeAccepted(), Commit()],
        F.ABORTING: [Cancel()],
        F.STOPPING: [HandshakeAccepted(), Commit(), Cancel()],
        F.FINISHED: [HandshakeAccepted(), Commit(), Finish()],
        F.FAILED: [Fail(CANCELLED)],
    }
    f = DecodeFate()
    for ev in paths[state]:
        f.handle(ev)
    assert f.state is state
    return f


def test_a_request_runs_once_its_handshake_is_accepted_and_its_kv_committed() -> None:
    f = DecodeFate()
    assert f.vote(KVPoll.SUCCESS) is KVPoll.BOOTSTRAPPING  # the bootstrap deadline covers the handshake
    assert f.vote(KVPoll.FAILED) is KVPoll.FAILED
    f.handle(HandshakeAccepted())
    assert f.vote(KVPoll.SUCCESS) is KVPoll.SUCCESS and f.in_queues
    f.handle(Commit())
    assert f.state is F.RUNNING and f.live and not f.in_queues
    f.handle(Finish())
    assert f.ended and not f.live


@pytest.mark.parametrize("state", list(F), ids=lambda s: s.name)
@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_an_event_the_state_does_not_accept_raises_and_changes_nothing(state: FateState, event: FateEvent) -> None:
    f = fate_in(state)
    before = (f.state, f.decided, f.last_error, f.transport_error, f.never_forwarded)
    if (state, type(event)) in FATE_TRANSITIONS:
        f.handle(event)
        return
    with pytest.raises(IllegalTransition, match=type(event).__name__):
        f.handle(event)
    assert (f.state, f.decided, f.last_error, f.transport_error, f.never_forwarded) == before


def test_a_cancel_before_commit_goes_to_the_queues_and_one_while_running_to_the_step() -> None:
    assert fate_in(F.ABORTING).in_queues and fate_in(F.ABORTING).ending
    running = fate_in(F.RUNNING)
    running.handle(Cancel())
    assert running.state is F.STOPPING and not running.in_queues and running.ending


def test_the_failure_the_driver_learned_wins_over_the_machines_reason() -> None:
    f = fate_in(F.HANDSHAKEN)
    f.handle(Cancel(REFUSED))
    assert f.outcome(CANCELLED) is REFUSED
    f.handle(Cancel())  # the client went away afterwards: the prefill's status still ends it
    assert f.outcome(CANCELLED) is REFUSED
    assert fate_in(F.ABORTING).outcome(CANCELLED) is CANCELLED  # a plain cancel: the machines decide


def test_reports_name_the_cause_and_a_late_one_is_ignored() -> None:
    f = DecodeFate()
    f.handle(CallFailed("bootstrap unavailable"))
    assert f.last_error == "bootstrap unavailable"
    f.handle(CallAnswered())
    assert f.last_error == ""
    f.handle(TransportFailed("peer closed"))
    f.handle(TransportFailed("untracked"))
    assert f.transport_error == "peer closed"  # the first FAILED names the cause
    f.handle(NeverForwarded())
    assert f.never_forwarded and f.state is F.WAITING
    f.handle(Fail(CANCELLED))
    for late in (HandshakeAccepted(), CallFailed("late"), TransportFailed("late")):
        assert f.handle(late) is F.FAILED
    assert f.last_error == "" and f.transport_error == "peer closed"


def test_a_request_fails_once() -> None:
    f = fate_in(F.STOPPING)
    f.handle(Fail(CANCELLED))
    with pytest.raises(IllegalTransition):
        f.handle(Fail(REFUSED))


def test_a_local_prefill_runs_without_handshake_or_queues_and_a_cancel_goes_to_the_step() -> None:
    f = DecodeFate()
    f.handle(ComputeHere())
    assert f.state is F.COMPUTING and f.live and not f.in_queues
    with pytest.raises(IllegalTransition):
        f.handle(HandshakeAccepted())  # no prefill answers for it
    f.handle(Cancel())
    assert f.state is F.STOPPING and f.ending and not f.in_queues
    g = DecodeFate()
    g.handle(ComputeHere())
    g.handle(Commit())
    g.handle(Finish())
    assert g.ended
