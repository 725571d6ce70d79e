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


def test_a_prefill_that_refused_the_request_as_invalid_counts_as_a_bad_request_not_a_prefill_error() -> None:
    # The decode's aborts_total then tells a client's mistake from a failing prefill.
    from pdgrpc.decode.statuses import refused_by_prefill

    for code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE):
        reported = prefill_failure(5, code.value[0], "the prompt is longer than the context")
        assert (reported.code, reported.reason) == (code, ServerAbortReason.BAD_REQUEST)
        refused = refused_by_prefill(code, "room 5: handshake refused")
        assert (refused.code, refused.reason) == (code, ServerAbortReason.BAD_REQUEST)
    assert prefill_failure(5, grpc.StatusCode.INTERNAL.value[0], "boom").reason is ServerAbortReason.PREFILL_ERROR
    assert refused_by_prefill(grpc.StatusCode.FAILED_PRECONDITION, "m").reason is ServerAbortReason.PREFILL_ERROR
