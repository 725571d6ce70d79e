"""The fate of one routed request, from its first attempt to its last token, h11 style.

::

    STARTING --Relayed--> STREAMING --Relayed(last)--> FINISHED
    STARTING, STREAMING --Succeeded--> FINISHED
    STARTING, STREAMING --AttemptFailed--> REROUTING | FAILED   (FINISHED once the client has every token)
    REROUTING --Rerouted--> STARTING (a retry) | STREAMING (a migration)
    REROUTING --NoInstance--> FAILED

The router (:mod:`pdgrpc.router.service`) sends one attempt -- a prefill call and a
decode call -- at a time and reports here what the client received and how the attempt
ended; this machine decides whether the request goes again, where the failure lies and
which reason it counts under. The driver classifies a call's status once, at its
boundary (:class:`Ending`), and never re-decides.

* Before the first token reached the client, a call whose server is unreachable
  (:attr:`Ending.UNREACHABLE`) is retried on another instance of its role, up to
  ``retries`` times and within the deadline. No other failure is retried.
* After the first token, a failure of a peer or a drain migrates the stream to another
  prefill and decode (the prompt plus the tokens relayed), up to ``migration_limit``
  times and while prompt + generated tokens fit ``migration_seq_len``.
* An instance whose call ended unreachable is ejected (passed over for a while).

Any event the state does not accept raises :class:`~pdgrpc.errors.IllegalTransition` and
leaves the state unchanged.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Sequence, Union

from pdgrpc.errors import IllegalTransition
from pdgrpc.reasons import AnyAbortReason, ServerAbortReason

__all__ = [
    "AttemptFailed", "Blame", "CallEnd", "Ending", "Fail", "Finish", "NoInstance", "PrefillCall", "Relayed", "Reroute",
    "Rerouted", "ROUTE_TRANSITIONS", "RouteEvent", "RouteFate", "RouteLimits", "RouteState", "Side", "Succeeded",
    "Verdict", "blame_decode", "decode_outlives", "prefill_failure",
]  # fmt: skip


class Side(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class Ending(enum.Enum):
    """How a call ended, as its status says (classified once, at the driver's boundary)."""

    UNREACHABLE = "unreachable"  # UNAVAILABLE: its server, or a worker behind it, is gone, unreachable or draining
    BROKEN = "broken"  # INTERNAL: a reset stream, unless the server named a reason
    ABORTED = "aborted"  # ABORTED: the server gave the request up (a prefill whose decode died does)
    INVALID = "invalid"  # INVALID_ARGUMENT, OUT_OF_RANGE: the server refused the request itself as wrong
    ANSWERED = "answered"  # any other status: the server's own answer


class PrefillCall(enum.Enum):
    """Where the prefill call of an attempt stands when its decode call failed."""

    RUNNING = "running"
    ANSWERED = "answered"
    FAILED = "failed"


class Blame(enum.Enum):
    """Which side a failed decode call is put down to, and so which one is replaced."""

    DECODE = "decode"  # the decode failed: its status and reason
    PREFILL_NAMED = "prefill named"  # the decode named its prefill as the cause: replace the prefill
    PREFILL_CAUSE = "prefill cause"  # the prefill failed too: its status and reason win, it knows the cause


@dataclasses.dataclass(frozen=True)
class CallEnd:
    """How one call of an attempt ended: the side whose call it was, its ending, and the
    reason it counts under."""

    side: Side
    ending: Ending
    reason: AnyAbortReason


# Endings whose reason is not the failed side's: an unreachable server is a peer failure,
# not an error of the request (a dead worker's requests end this way); a request refused
# as wrong is the client's mistake, and the server that said so did not fail.
_REASON_OF_ENDING: dict[Ending, ServerAbortReason] = {
    Ending.UNREACHABLE: ServerAbortReason.PEER_FAILURE,
    Ending.INVALID: ServerAbortReason.BAD_REQUEST,
}


def _reason(ending: Ending, side_failed: ServerAbortReason) -> ServerAbortReason:
    return _REASON_OF_ENDING.get(ending, side_failed)


def prefill_failure(ending: Ending) -> CallEnd:
    """A failed prefill call."""
    return CallEnd(Side.PREFILL, ending, _reason(ending, ServerAbortReason.PREFILL_ERROR))


def decode_outlives(prefill_end: CallEnd) -> bool:
    """Whether the decode call of a failed prefill keeps running a moment (the driver's
    cause window) before it is cancelled: when the prefill gave the request up, as one
    whose decode died does. The decode's own status then arrives first and names the
    decode, so the request goes on on another decode, which the prefill's status alone
    would not allow. Any other prefill failure (a refusal, a prefill that is gone)
    cancels the decode call at once."""
    return prefill_end.side is Side.PREFILL and prefill_end.ending is Ending.ABORTED


def blame_decode(
    ending: Ending, said: str | None, prefill: PrefillCall, prefill_end: CallEnd | None, waited: bool
) -> tuple[Blame, CallEnd] | None:
    """Where a failed decode call's failure lies. ``said``: the abort reason the decode
    named (None: the connection ended the call, not the decode); ``prefill``: the same
    attempt's prefill call, and ``prefill_end`` how it failed; ``waited``: the driver
    already gave a running prefill a moment to fail. None: wait that moment, then ask
    again, since a decode that failed because its prefill did reports less than the
    prefill."""
    decode = Side.DECODE
    if said is None and ending in (Ending.UNREACHABLE, Ending.BROKEN):
        # The decode is gone or its stream was reset; a prefill failing now lost its
        # transfer's peer. The decode is the side to replace.
        return Blame.DECODE, CallEnd(decode, ending, ServerAbortReason.PEER_FAILURE)
    if said == ServerAbortReason.DRAIN_TIMEOUT.value:
        return Blame.DECODE, CallEnd(decode, ending, ServerAbortReason.DRAIN_TIMEOUT)
    if said == ServerAbortReason.PREFILL_ERROR.value and prefill is PrefillCall.RUNNING:
        # E.g. the prefill's bootstrap has no worker yet (it is restarting).
        return Blame.PREFILL_NAMED, CallEnd(Side.PREFILL, ending, ServerAbortReason.PREFILL_ERROR)
    if prefill is PrefillCall.RUNNING and not waited:
        return None
    if prefill is PrefillCall.FAILED:
        if prefill_end is None:
            raise ValueError("prefill_end: a failed prefill call needs its end")
        return Blame.PREFILL_CAUSE, prefill_end
    return Blame.DECODE, CallEnd(decode, ending, _reason(ending, ServerAbortReason.DECODE_ERROR))


class RouteState(enum.Enum):
    __hash__ = object.__hash__  # identity hashing: table lookups stay in C

    STARTING = "starting"  # an attempt runs; no token reached the client
    STREAMING = "streaming"  # tokens reached the client
    REROUTING = "rerouting"  # the request goes again once the driver found another pair
    FINISHED = "finished"  # the client has every token
    FAILED = "failed"  # the failure reaches the client


# -- events: what happened to the request ------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Relayed:
    """``token_ids`` reached the client; ``last``: their message ended the stream."""

    token_ids: Sequence[int]
    last: bool = False


@dataclasses.dataclass(frozen=True)
class Succeeded:
    """The attempt's decode stream ended normally."""


@dataclasses.dataclass(frozen=True)
class AttemptFailed:
    """The attempt ended with ``end``; ``in_time``: the request's deadline has not passed."""

    end: CallEnd
    in_time: bool


@dataclasses.dataclass(frozen=True)
class Rerouted:
    """The driver found another pair and sends the request again."""


@dataclasses.dataclass(frozen=True)
class NoInstance:
    """No other instance of the failed side is there to go to."""


RouteEvent = Union[Relayed, Succeeded, AttemptFailed, Rerouted, NoInstance]


# -- verdicts: what the driver does after a failed attempt -------------------------------
@dataclasses.dataclass(frozen=True)
class Finish:
    """The client already has every token: the request ends well."""


@dataclasses.dataclass(frozen=True)
class Fail:
    """The failure reaches the client."""


@dataclasses.dataclass(frozen=True)
class Reroute:
    """Send the request again, on a pair whose ``side`` instance is another one.
    ``migration``: the reason a running stream migrates; None for a retry."""

    side: Side
    input_ids: Sequence[int]
    migration: ServerAbortReason | None


Verdict = Union[Finish, Fail, Reroute]

S = RouteState
_LIVE = (S.STARTING, S.STREAMING)

# Events each state accepts, and the state they lead to when the handler does not choose
# among several (None: the handler chooses).
ROUTE_TRANSITIONS: dict[tuple[RouteState, type], RouteState | None] = {
    (S.STARTING, Relayed): None,
    (S.STREAMING, Relayed): None,
    (S.FINISHED, Relayed): S.FINISHED,  # a message after the last token (it carries none)
    **{(s, Succeeded): S.FINISHED for s in _LIVE},
    (S.FINISHED, Succeeded): S.FINISHED,
    **{(s, AttemptFailed): None for s in _LIVE},
    (S.FINISHED, AttemptFailed): S.FINISHED,  # a failure after the last token changes nothing
    (S.REROUTING, Rerouted): None,
    (S.REROUTING, NoInstance): S.FAILED,
}


@dataclasses.dataclass(frozen=True)
class RouteLimits:
    retries: int  # times a request goes again before its first token
    migration_limit: int  # times a running stream moves
    migration_seq_len: int  # longest prompt + generated tokens a stream moves with


class RouteFate:
    """One routed request's fate (see the module doc). Not thread-safe."""

    __slots__ = ("state", "limits", "prompt", "max_new_tokens", "generated", "retries", "migrations", "eject", "_pending")

    def __init__(self, prompt: Sequence[int], max_new_tokens: int, limits: RouteLimits) -> None:
        self.state = S.STARTING
        self.limits = limits
        self.prompt = list(prompt)
        self.max_new_tokens = max_new_tokens
        self.generated: list[int] = []  # what the client has: a migration goes on from here
        self.retries = 0
        self.migrations = 0
        self.eject: Side | None = None  # the side whose instance the last failure ejects
        self._pending: Reroute | None = None

    @property
    def started(self) -> bool:
        """A token reached the client: the request can no longer simply go again."""
        return bool(self.generated)

    def input_ids(self) -> list[int]:
        return self.prompt + self.generated

    def remaining(self) -> int:
        return self.max_new_tokens - len(self.generated)

    def handle(self, event: RouteEvent) -> Verdict | None:
        """Apply ``event``; after :class:`AttemptFailed`, what the driver does."""
        try:
            fixed = ROUTE_TRANSITIONS[(self.state, type(event))]
        except KeyError:
            raise IllegalTransition(f"event {type(event).__name__} is not allowed in state {self.state.name}") from None
        verdict: Verdict | None = None
        if isinstance(event, Relayed):
            self.generated += event.token_ids
            if fixed is None:
                fixed = S.FINISHED if event.last or self.remaining() <= 0 else S.STREAMING
        elif isinstance(event, AttemptFailed):
            self.eject = None
            verdict = Finish() if self.state is S.FINISHED else self._after(event)
            fixed = {Finish: S.FINISHED, Fail: S.FAILED, Reroute: S.REROUTING}[type(verdict)]
        elif isinstance(event, Rerouted):
            assert self._pending is not None
            if self._pending.migration is None:
                self.retries += 1
            else:
                self.migrations += 1
            self._pending = None
            fixed = S.STREAMING if self.started else S.STARTING
        assert fixed is not None
        self.state = fixed
        return verdict

    def _after(self, failed: AttemptFailed) -> Verdict:
        end = failed.end
        self.eject = end.side if end.ending is Ending.UNREACHABLE else None
        limits = self.limits
        if not self.started:
            if end.ending is not Ending.UNREACHABLE or not failed.in_time or self.retries >= limits.retries:
                return Fail()
            self._pending = Reroute(end.side, self.input_ids(), None)
            return self._pending
        reason = _migration_reason(end)
        if (
            reason is None or not failed.in_time or self.migrations >= limits.migration_limit
            or len(self.prompt) + len(self.generated) > limits.migration_seq_len
        ):
            return Fail()
        self._pending = Reroute(end.side, self.input_ids(), reason)
        return self._pending


def _migration_reason(end: CallEnd) -> ServerAbortReason | None:
    # A stream migrates when a peer failed or drained; a failure of the request itself
    # (e.g. metadata corruption) would fail again anywhere.
    if end.reason == ServerAbortReason.DRAIN_TIMEOUT:
        return ServerAbortReason.DRAIN_TIMEOUT
    if end.ending is Ending.UNREACHABLE or end.reason == ServerAbortReason.PEER_FAILURE:
        return ServerAbortReason.PEER_FAILURE
    return None
