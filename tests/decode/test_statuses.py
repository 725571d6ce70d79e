"""pdgrpc.decode.statuses: the decode's one table of statuses (no sockets)."""

from __future__ import annotations

import grpc

from pdgrpc.decode.statuses import PeerAnswer, Refusal, ending, peer_answer, prefill_failure
from pdgrpc.reasons import AbortReason, ServerAbortReason


def test_every_failure_the_decode_names_has_a_status() -> None:
    for why in [*Refusal, *AbortReason]:
        assert ending(why, "m").code != grpc.StatusCode.OK
    assert ending(Refusal.BAD_REQUEST, "sampling is not set").code == grpc.StatusCode.INVALID_ARGUMENT
    assert ending(Refusal.ROOM_IN_USE, "m").code == grpc.StatusCode.ALREADY_EXISTS
    # the two a router sends again elsewhere
    assert ending(Refusal.SHUTTING_DOWN, "m").code == grpc.StatusCode.UNAVAILABLE
    assert ending(AbortReason.PEER_FAILURE, "m").code == grpc.StatusCode.UNAVAILABLE
    assert {ending(r, "m").code for r in AbortReason if r.name.endswith("_TIMEOUT")} == {grpc.StatusCode.DEADLINE_EXCEEDED}


def test_the_abort_reason_follows_the_failure_unless_given() -> None:
    assert ending(AbortReason.ALLOCATE_TIMEOUT, "m").reason is AbortReason.ALLOCATE_TIMEOUT
    assert ending(Refusal.SHUTTING_DOWN, "m").reason is ServerAbortReason.SHUTDOWN
    assert ending(Refusal.PREFILL_GONE, "m").reason is ServerAbortReason.PREFILL_ERROR
    assert ending(Refusal.INTERNAL, "m").reason is ServerAbortReason.INTERNAL_ERROR


def test_a_peer_status_is_read_in_one_place() -> None:
    assert peer_answer(grpc.StatusCode.UNAVAILABLE) is PeerAnswer.GONE
    assert peer_answer(grpc.StatusCode.DEADLINE_EXCEEDED).retryable
    assert peer_answer(grpc.StatusCode.UNIMPLEMENTED) is PeerAnswer.UNSUPPORTED
    assert not peer_answer(grpc.StatusCode.INVALID_ARGUMENT).retryable
    # a prefill's reported code is relayed; OK or an unknown one is ABORTED
    assert prefill_failure(5, grpc.StatusCode.INVALID_ARGUMENT.value[0], "too long").code == grpc.StatusCode.INVALID_ARGUMENT
    assert prefill_failure(5, 0, "?").code == grpc.StatusCode.ABORTED
    assert prefill_failure(5, 99, "?").code == grpc.StatusCode.ABORTED
    assert prefill_failure(5, grpc.StatusCode.CANCELLED.value[0], "gone").reason is AbortReason.CANCELLED
