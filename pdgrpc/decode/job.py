"""What the decode scheduler keeps per request (:class:`Job`), what it hands the Decode
stream (:class:`Tokens`, or a :class:`~pdgrpc.errors.RequestFailed` that ends it), and the
status an abort of the decode machines ends a request with (:func:`abort_status`)."""

from __future__ import annotations

import asyncio
import dataclasses

from pdgrpc.decode.prefills import PrefillInfo
from pdgrpc.decode.statuses import ending
from pdgrpc.engine.base import SamplingParams
from pdgrpc.state.prefix_cache import Lease
from pdgrpc.errors import RequestFailed
from pdgrpc.rpc import tracing
from pdgrpc.state import AbortReason, Aborted, DecodeDeadlines
from pdgrpc.state.decode_fate import DecodeFate
from pdgrpc.v1 import bootstrap_pb2 as bpb

__all__ = ["Job", "SchedulerConfig", "Tokens", "abort_status"]


@dataclasses.dataclass(frozen=True)
class Tokens:
    """Tokens for the client stream (one DecodeResponse)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str = ""
    bytes_transferred: int = 0  # set on the first message
    transfer_seconds: float = 0.0  # set on the first message
    top: tuple[tuple[tuple[int, ...], tuple[float, ...]], ...] = ()  # per token: (ids, logprobs)
    data_plane_seconds: float = 0.0  # set on the first message: first KV byte arrived -> commit
    cached_tokens: int = 0  # set on the first message: prompt tokens the prefill's cache supplied


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    deadlines: DecodeDeadlines = DecodeDeadlines()
    query_interval_s: float = 0.05  # at most one QueryDpRanks per prefill per interval
    rpc_timeout_s: float = 5.0  # bootstrap calls and AbortRoom
    idle_poll_s: float = 0.02  # loop period while dp-rank queries, quarantined rooms, requests waiting for memory, local prefills or TP transfers wait
    # How long a decode step that serves only requests whose first token the Decode stream
    # is still sending waits for those sends (see Generation.await_first_tokens_sent). 0: never.
    first_token_wait_s: float = 0.002
    compute_nice: int = 0  # added to the compute thread's nice value (pdgrpc.serving.threads)
    # A handshaken room whose KV has not landed in twice the time recent rooms took
    # (handshake -> commit, their median), within [watch_after_s, watch_after_max_s], starts
    # watching its prefill's bootstrap for a failure record (QueryRoomFailures, held): a
    # prefill that fails then ends the request at once. Rooms as fast as usual (the common
    # case) never watch; a failed prefill is seen at most watch_after_max_s after the
    # handshake. Seconds.
    watch_after_s: float = 0.05
    watch_after_max_s: float = 0.25
    # Each held call's max_wait, asked again while the room waits. The call is cancelled
    # when the room leaves the queues, so a landed room frees its place on the bootstrap.
    watch_wait_s: float = 5.0
    # Keep a prefix cache of received and generated pages and ask each prefill only for the
    # pages it lacks (pdgrpc.decode.reuse). On: a chat's next turn then moves only its new
    # message, and cached pages no request holds count as free. A transport that moves bytes only.
    prefix_cache: bool = True
    # Most prompt tokens of local prefills (pdgrpc.decode.local) one iteration computes
    # before its decode step: bounds what a local prefill adds to running streams'
    # inter-token latency.
    local_prefill_chunk: int = 128


@dataclasses.dataclass(eq=False)
class Job:
    """One Decode call, from admission to its last message."""

    room: int
    request_id: str
    input_ids: tuple[int, ...]
    sampling: SamplingParams
    max_new_tokens: int
    prefill: PrefillInfo
    num_pages: int
    out: "asyncio.Queue[Tokens | RequestFailed]"
    admitted_at: float
    # Filled in as the request goes.
    dp_rank: int | None = None
    # DecodeRequest.room_secret: signs this request's Handshake and AbortRoom calls.
    room_secret: bytes = dataclasses.field(default=b"", repr=False)
    slot: int | None = None
    pages: tuple[int, ...] = ()  # every page: the cached prefix the lease holds, then the request's own
    lease: Lease | None = None  # the decode prefix cache's pages it holds, until it ends
    handshake_sent_at: float = 0.0
    contacted: list[bpb.WorkerInfo] = dataclasses.field(default_factory=list)  # sent a handshake
    handshake_task: "asyncio.Task[None] | None" = None
    # The held failure watch on the prefill's bootstrap, while one runs.
    watch_task: "asyncio.Task[None] | None" = None
    # Everything that decides how it ends: drivers feed it events and do what it says.
    fate: DecodeFate = dataclasses.field(default_factory=DecodeFate)
    # Running (after commit): every token sent so far, the first one (from the prefill) included.
    output_ids: list[int] = dataclasses.field(default_factory=list)
    # Set by the Decode stream once its first message is sent (or the stream ended).
    first_sent: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    trace: tracing.Hops | None = None  # the Decode call's span while tracing is on

    @property
    def cached_pages(self) -> int:
        """Leading prompt pages the decode's prefix cache supplied (the prefill skips them)."""
        return self.lease.cached_pages if self.lease is not None else 0

    @property
    def generated(self) -> int:
        return len(self.output_ids)

    @property
    def last_token(self) -> int:
        """The token the next decode step feeds (its KV is not in the pages yet)."""
        return self.output_ids[-1]

    @property
    def position(self) -> int:
        """Position of ``last_token`` (the prompt holds positions [0, len))."""
        return len(self.input_ids) + self.generated - 1

    @property
    def kv_ids(self) -> tuple[int, ...]:
        """The tokens whose KV the pages hold once the prompt landed: the prompt and every
        generated token a step fed back (all but the last)."""
        return self.input_ids + tuple(self.output_ids[:-1])


_PHASE = {
    AbortReason.RESOLVE_DP_RANK_TIMEOUT: "resolving the prefill dp rank",
    AbortReason.ALLOCATE_TIMEOUT: "waiting for free KV pages and a metadata slot",
    AbortReason.BOOTSTRAP_TIMEOUT: "bootstrap (handshake with the prefill worker not accepted)",
    AbortReason.WAITING_FOR_INPUT_TIMEOUT: "waiting for the prefill to send KV",
    AbortReason.TRANSFER_TIMEOUT: "transferring KV and metadata",
}


def abort_status(fate: DecodeFate, a: Aborted) -> RequestFailed:
    """The status a request ends with when the decode machines aborted it: what its
    ``fate`` decided, else one by the machines' reason (a deadline is DEADLINE_EXCEEDED
    naming the phase)."""
    return fate.outcome(_by_reason(fate, a))


def _by_reason(fate: DecodeFate, a: Aborted) -> RequestFailed:
    r = a.reason
    if r is AbortReason.TRANSFER_FAILED:
        return ending(r, f"{a.message}: {fate.transport_error or 'transport failure'}")
    if r is AbortReason.PEER_FAILURE:  # the prefill process or its connection died
        return ending(r, f"{a.message}: {fate.transport_error or 'peer lost'}")
    if r not in _PHASE:
        return ending(r, a.message)
    msg = f"{a.message}: phase {_PHASE[r]}"
    if fate.last_error and r in (AbortReason.BOOTSTRAP_TIMEOUT, AbortReason.RESOLVE_DP_RANK_TIMEOUT):
        msg += f"; last error: {fate.last_error}"
    elif r is AbortReason.RESOLVE_DP_RANK_TIMEOUT:  # the bootstrap answered, without the room
        msg += " (QueryDpRanks found no entry)"
    return ending(r, msg)
