"""A routed request's fate: retry before the first token, migrate after, the limits, which
failures count and which side is blamed. No socket: the router's servicer only executes
what these decide (its tests in tests/router run the same rules over real gRPC)."""

from __future__ import annotations

import pytest

from pdgrpc.errors import IllegalTransition
from pdgrpc.reasons import AbortReason, ServerAbortReason
from pdgrpc.state.route_fate import (
    AttemptFailed, Blame, CallEnd, Ending, Fail, Finish, NoInstance, PrefillCall, Relayed, Reroute, Rerouted, RouteFate,
    RouteLimits, RouteState, Side, Succeeded, blame_decode, decode_outlives, prefill_failure,
)

PEER = ServerAbortReason.PEER_FAILURE
DRAIN = ServerAbortReason.DRAIN_TIMEOUT
GONE_DECODE = CallEnd(Side.DECODE, Ending.UNREACHABLE, PEER)
GONE_PREFILL = prefill_failure(Ending.UNREACHABLE)
REFUSED = prefill_failure(Ending.ANSWERED)  # e.g. the prompt is too long for that prefill


def fate(retries: int = 1, migration_limit: int = 1, seq_len: int = 100, prompt: int = 4, max_new: int = 8) -> RouteFate:
    return RouteFate(list(range(prompt)), max_new, RouteLimits(retries, migration_limit, seq_len))


def test_an_unreachable_call_before_the_first_token_is_retried_on_its_side_up_to_the_limit() -> None:
    f = fate(retries=2)
    v = f.handle(AttemptFailed(GONE_PREFILL, in_time=True))
    assert v == Reroute(Side.PREFILL, [0, 1, 2, 3], None) and f.eject is Side.PREFILL
    f.handle(Rerouted())
    assert f.state is RouteState.STARTING and f.retries == 1
    assert isinstance(f.handle(AttemptFailed(GONE_DECODE, in_time=True)), Reroute)
    f.handle(Rerouted())
    assert isinstance(f.handle(AttemptFailed(GONE_DECODE, in_time=True)), Fail)  # the third: over --retries
    assert f.state is RouteState.FAILED and f.retries == 2


@pytest.mark.parametrize("end", [REFUSED, prefill_failure(Ending.BROKEN), CallEnd(Side.DECODE, Ending.ANSWERED, ServerAbortReason.DECODE_ERROR)])
def test_a_failure_of_the_request_itself_is_not_retried_and_ejects_nobody(end: CallEnd) -> None:
    f = fate(retries=5)
    assert isinstance(f.handle(AttemptFailed(end, in_time=True)), Fail)
    assert f.eject is None


def test_no_retry_past_the_deadline_or_with_retries_off() -> None:
    assert isinstance(fate().handle(AttemptFailed(GONE_DECODE, in_time=False)), Fail)
    f = fate(retries=0)
    assert isinstance(f.handle(AttemptFailed(GONE_DECODE, in_time=True)), Fail)
    assert f.eject is Side.DECODE  # still passed over by the next requests


def test_a_stream_that_fails_after_tokens_migrates_with_prompt_plus_tokens() -> None:
    f = fate(prompt=3)
    f.handle(Relayed([7, 8]))
    assert f.state is RouteState.STREAMING and f.remaining() == 6
    v = f.handle(AttemptFailed(GONE_DECODE, in_time=True))
    assert v == Reroute(Side.DECODE, [0, 1, 2, 7, 8], PEER)
    f.handle(Rerouted())
    assert f.state is RouteState.STREAMING and f.migrations == 1 and f.retries == 0
    f.handle(Relayed([9]))
    assert isinstance(f.handle(AttemptFailed(GONE_DECODE, in_time=True)), Fail)  # over --migration-limit


def test_a_drained_decode_migrates_under_drain_timeout_and_a_reset_stream_as_a_peer_failure() -> None:
    f = fate()
    f.handle(Relayed([1]))
    v = f.handle(AttemptFailed(CallEnd(Side.DECODE, Ending.UNREACHABLE, DRAIN), in_time=True))
    assert isinstance(v, Reroute) and v.migration is DRAIN
    g = fate()
    g.handle(Relayed([1]))
    v = g.handle(AttemptFailed(CallEnd(Side.DECODE, Ending.BROKEN, PEER), in_time=True))
    assert isinstance(v, Reroute) and v.migration is PEER and g.eject is None  # a reset stream ejects nobody


def test_a_request_error_after_tokens_does_not_migrate() -> None:
    f = fate()
    f.handle(Relayed([1]))
    end = CallEnd(Side.DECODE, Ending.ANSWERED, AbortReason.METADATA_CORRUPTION)
    assert isinstance(f.handle(AttemptFailed(end, in_time=True)), Fail)


def test_a_stream_past_the_migration_length_fails() -> None:
    f = fate(prompt=4, seq_len=5)
    f.handle(Relayed([1]))
    assert isinstance(f.handle(AttemptFailed(GONE_DECODE, in_time=True)), Reroute)  # 5 tokens fit
    f = fate(prompt=4, seq_len=5, migration_limit=3)
    f.handle(Relayed([1, 2]))
    assert isinstance(f.handle(AttemptFailed(GONE_DECODE, in_time=True)), Fail)  # 6 do not


def test_a_failure_after_the_last_token_finishes_the_request() -> None:
    f = fate(max_new=2)
    f.handle(Relayed([1, 2]))  # every token, no finish message yet
    assert f.state is RouteState.FINISHED
    assert isinstance(f.handle(AttemptFailed(GONE_DECODE, in_time=True)), Finish) and f.eject is None
    g = fate()
    g.handle(Relayed([1], last=True))
    assert isinstance(g.handle(AttemptFailed(GONE_DECODE, in_time=True)), Finish)
    g.handle(Succeeded())
    assert g.state is RouteState.FINISHED


def test_no_other_instance_fails_the_request_and_events_out_of_turn_are_refused() -> None:
    f = fate()
    f.handle(AttemptFailed(GONE_DECODE, in_time=True))
    f.handle(NoInstance())
    assert f.state is RouteState.FAILED and f.retries == 0
    with pytest.raises(IllegalTransition):
        f.handle(Rerouted())
    with pytest.raises(IllegalTransition):
        fate().handle(Rerouted())
    assert fate().handle(Succeeded()) is None


def test_blame_a_lost_or_drained_decode_on_the_decode() -> None:
    for ending in (Ending.UNREACHABLE, Ending.BROKEN):
        assert blame_decode(ending, None, PrefillCall.RUNNING, None, waited=False) == (Blame.DECODE, CallEnd(Side.DECODE, ending, PEER))
    drained = blame_decode(Ending.UNREACHABLE, DRAIN.value, PrefillCall.RUNNING, None, waited=False)
    assert drained == (Blame.DECODE, CallEnd(Side.DECODE, Ending.UNREACHABLE, DRAIN))


def test_blame_the_prefill_a_decode_names_while_it_runs() -> None:
    named = blame_decode(Ending.UNREACHABLE, "prefill_error", PrefillCall.RUNNING, None, waited=False)
    assert named == (Blame.PREFILL_NAMED, CallEnd(Side.PREFILL, Ending.UNREACHABLE, ServerAbortReason.PREFILL_ERROR))


def test_a_decode_abort_waits_once_for_its_prefill_whose_failure_wins() -> None:
    aborted = (Ending.ANSWERED, "cancelled")
    assert blame_decode(*aborted, PrefillCall.RUNNING, None, waited=False) is None
    assert blame_decode(*aborted, PrefillCall.FAILED, REFUSED, waited=True) == (Blame.PREFILL_CAUSE, REFUSED)
    # the prefill answered or still runs after the wait: the decode's own failure
    assert blame_decode(*aborted, PrefillCall.RUNNING, None, waited=True) == (
        Blame.DECODE, CallEnd(Side.DECODE, Ending.ANSWERED, ServerAbortReason.DECODE_ERROR)
    )
    assert blame_decode(Ending.UNREACHABLE, "shutdown", PrefillCall.ANSWERED, None, waited=False) == (
        Blame.DECODE, CallEnd(Side.DECODE, Ending.UNREACHABLE, PEER)
    )
    with pytest.raises(ValueError, match="prefill_end"):
        blame_decode(*aborted, PrefillCall.FAILED, None, waited=True)


def test_a_prefill_that_gave_up_leaves_its_decode_a_moment_to_say_it_died() -> None:
    assert decode_outlives(prefill_failure(Ending.ABORTED))
    assert not decode_outlives(REFUSED) and not decode_outlives(GONE_PREFILL)
    # the decode's stream then ends by a lost connection: the decode is blamed, and replaced
    lost = blame_decode(Ending.UNREACHABLE, None, PrefillCall.FAILED, prefill_failure(Ending.ABORTED), waited=False)
    assert lost == (Blame.DECODE, GONE_DECODE)
    # a decode that gave the request up itself, naming no reason, lost no connection
    assert blame_decode(Ending.ABORTED, None, PrefillCall.RUNNING, None, waited=False) is None


BAD = ServerAbortReason.BAD_REQUEST


def test_a_request_a_prefill_refuses_as_invalid_counts_as_a_bad_request_not_a_prefill_error() -> None:
    """The client's mistake: no retry, nobody ejected, no migration after tokens, and the
    decode call is cancelled at once."""
    refused = prefill_failure(Ending.INVALID)
    assert refused == CallEnd(Side.PREFILL, Ending.INVALID, BAD)
    f = fate(retries=5)
    assert isinstance(f.handle(AttemptFailed(refused, in_time=True)), Fail) and f.eject is None
    g = fate(migration_limit=5)
    g.handle(Relayed([7]))
    assert isinstance(g.handle(AttemptFailed(refused, in_time=True)), Fail) and g.eject is None
    assert not decode_outlives(refused)


def test_a_request_a_decode_refuses_as_invalid_counts_as_a_bad_request_not_a_decode_error() -> None:
    for prefill in (PrefillCall.ANSWERED, PrefillCall.RUNNING):
        assert blame_decode(Ending.INVALID, None, prefill, None, waited=True) == (
            Blame.DECODE, CallEnd(Side.DECODE, Ending.INVALID, BAD)
        )
    # a prefill that failed too still knows the cause
    assert blame_decode(Ending.INVALID, None, PrefillCall.FAILED, GONE_PREFILL, waited=True) == (Blame.PREFILL_CAUSE, GONE_PREFILL)
