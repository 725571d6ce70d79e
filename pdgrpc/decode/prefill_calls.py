"""The decode's calls to the prefill side: dp-rank queries and failure watches to its
bootstrap, the handshake to its workers, and AbortRoom.

The scheduler builds one :class:`PrefillCalls` and starts each call as its own task
(:meth:`CallsHost.spawn`). A call goes through
:class:`~pdgrpc.decode.prefills.PrefillDirectory` or
:class:`~pdgrpc.decode.handshake.Handshaker`, and feeds its result back into the pure
queues or ends the request with the prefill's status (:meth:`CallsHost.end_with`); the
scheduler's loop never waits on the network.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import statistics
import time
from typing import Any, Awaitable, Callable, Protocol

from pdgrpc.decode.handshake import ACCEPTED, Handshaker
from pdgrpc.decode.job import Job, SchedulerConfig
from pdgrpc.decode.prefills import PrefillDirectory, restart_failure
from pdgrpc.decode.rank import RankTransfers
from pdgrpc.decode.statuses import Refusal, ending
from pdgrpc.decode.tp import ROOM_WRITERS, ReplicatedQueues
from pdgrpc.errors import PdgrpcError, RequestFailed
from pdgrpc.metrics import DecodeMetrics
from pdgrpc.rpc.errors import RpcError
from pdgrpc.serving.failure_log import FailureLog
from pdgrpc.serving.logs import request_event
from pdgrpc.state import DecodeQueues, QueryDpRanks, SendHandshake
from pdgrpc.state.decode_fate import CallAnswered, CallFailed, FateState, HandshakeAccepted, NeverForwarded

log = logging.getLogger("pdgrpc.decode")

LANDINGS_KEPT = 32  # recent rooms whose handshake -> commit time sets the watch delay

__all__ = ["ASK_FAILURES_AFTER_S", "CallsHost", "PrefillCalls"]

# A room still without a dp rank this long after admission: ask whether its prefill's
# controller refused it (a controller records that within milliseconds).
ASK_FAILURES_AFTER_S = 0.1


class CallsHost(Protocol):
    """What the calls need from the scheduler that owns the requests."""

    @property
    def closing(self) -> bool: ...

    def job(self, room: int) -> Job | None:
        """The unfinished request with ``room``, or None."""

    def end_with(self, job: Job, failure: RequestFailed) -> None:
        """End ``job`` with ``failure`` once its cancel takes effect."""

    def spawn(self, coro: Awaitable[Any], name: str) -> "asyncio.Task[Any]": ...

    def wake(self) -> None:
        """Run the scheduler's loop now: the queues moved."""


class PrefillCalls:
    """``pages_needed(tokens)``: the KV pages a prompt of that many tokens fills."""

    def __init__(
        self,
        host: CallsHost,
        queues: DecodeQueues,
        transfers: RankTransfers,
        directory: PrefillDirectory,
        handshaker: Handshaker,
        config: SchedulerConfig,
        metrics: DecodeMetrics,
        pages_needed: Callable[[int], int],
    ) -> None:
        self.host, self.queues, self.transfers = host, queues, transfers
        self.directory, self.handshaker = directory, handshaker
        self.config, self.metrics, self.pages_needed = config, metrics, pages_needed
        self._query_failures = FailureLog(log, "QueryDpRanks")  # one line per failing bootstrap per 10 s
        # Recent rooms' handshake -> commit seconds, which set when a late room watches.
        self._landings: collections.deque[float] = collections.deque(maxlen=LANDINGS_KEPT)

    # -- dp ranks -----------------------------------------------------------------------------
    async def query_dp_ranks(self, query: QueryDpRanks) -> None:
        addr = query.prefill_address
        try:
            answers, instance = await self.directory.query_dp_ranks(addr, query.rooms)
        except RpcError as exc:
            self.metrics.on_dp_rank_query_failed(len(query.rooms))
            self._query_failures.failed(addr, f"{len(query.rooms)} rooms: {exc}")
            for room in query.rooms:
                if (job := self.host.job(room)) is not None:
                    job.fate.handle(CallFailed(str(exc)))
            return
        self._query_failures.succeeded(addr)
        self.metrics.on_dp_rank_query(len(query.rooms), missing=sum(1 for r in answers.values() if r is None))
        now = time.monotonic()
        good: dict[int, int | None] = {}
        for room, rank in answers.items():
            job = self.host.job(room)
            if job is None:
                continue
            job.fate.handle(CallAnswered())
            if job.prefill.restarted(instance):  # admitted under the instance before: its prefill is lost
                request_event(log, room, "prefill restarted", level=logging.WARNING, prefill=addr, instance=f"{instance:016x}")
                self.host.end_with(job, restart_failure(room, addr))
                continue
            if rank is not None and not 0 <= rank < job.prefill.dp_size:
                self.host.end_with(job, ending(
                    Refusal.INTERNAL, f"room {room}: bootstrap {addr} answered dp rank {rank}, outside [0, {job.prefill.dp_size})"
                ))
                continue
            good[room] = rank
        if self.host.closing:
            return
        moved = self.queues.on_dp_ranks(addr, good, now)
        for room, rank in good.items():
            job = self.host.job(room)
            if rank is not None and job is not None:
                job.dp_rank = rank
                request_event(log, room, "dp rank resolved", prefill=addr, dp_rank=rank)
        if moved:
            self.host.wake()
        missing = {room: job.room_secret for room, r in good.items() if r is None and (job := self.host.job(room)) is not None}
        if missing:
            log.debug("QueryDpRanks to %s: %d of %d rooms not registered yet", addr, len(missing), len(query.rooms))
            # Still not registered: the prefill's controller may have refused them (pdgrpc.prefill.notices).
            missing = {room: s for room, s in missing.items() if (j := self.host.job(room)) is not None and now - j.admitted_at >= ASK_FAILURES_AFTER_S}
            for room, (failure, never_forwarded) in (await self.directory.room_failures(addr, missing) or {}).items():
                job = self.host.job(room)
                if job is not None and job.fate.live and job.dp_rank is None:
                    request_event(log, room, "prefill failed", level=logging.WARNING, message=failure.message)
                    if never_forwarded:
                        job.fate.handle(NeverForwarded())
                    self.host.end_with(job, failure)

    # -- handshake ------------------------------------------------------------------------------
    def start_handshake(self, hs: SendHandshake, now: float) -> None:
        prompt_pages = self.advertise(hs, now)
        if prompt_pages is not None:
            self.send_handshake(hs, prompt_pages)

    def advertise(self, hs: SendHandshake, now: float) -> tuple[int, ...] | None:
        """Record the allocation and advertise the grants; the prompt's pages, or None
        when the transport refused (the request is then cancelled)."""
        job = self.host.job(hs.room)
        assert job is not None
        held = job.lease.pages if job.lease is not None else ()
        job.slot, job.pages, job.dp_rank = hs.slot, held + hs.pages, hs.dp_rank
        job.handshake_sent_at = now
        prompt_pages = job.pages[: self.pages_needed(len(job.input_ids))]
        try:
            # Only the pages the prefill writes: a write into a cached page is refused.
            self.transfers.advertise(hs.room, prompt_pages[len(held) :], hs.slot)
        except PdgrpcError as exc:
            self.host.end_with(job, ending(Refusal.INTERNAL, f"room {hs.room}: transport refused the grant: {exc}"))
            return None
        request_event(log, hs.room, "pages allocated", slot=hs.slot, pages=len(hs.pages), prompt_pages=len(prompt_pages), cached_pages=len(held), dp_rank=hs.dp_rank)
        return prompt_pages

    def send_handshake(self, hs: SendHandshake, prompt_pages: tuple[int, ...]) -> None:
        job = self.host.job(hs.room)
        if job is None or job.fate.ended:
            return
        job.handshake_task = self.host.spawn(self._handshake(job, prompt_pages), f"handshake {hs.room}")

    async def _handshake(self, job: Job, prompt_pages: tuple[int, ...]) -> None:
        deadline = job.handshake_sent_at + self.config.deadlines.bootstrap_s
        if self.handshaker.claim_s:  # workers hold their answers until claimed: watch meanwhile
            asyncio.get_running_loop().call_later(self.watch_delay_s(), self._start_watch, job)
        result = await self.handshaker.handshake(job, prompt_pages, deadline)
        if result is ACCEPTED:
            job.fate.handle(HandshakeAccepted())
            self.host.wake()
            asyncio.get_running_loop().call_later(self.watch_delay_s(), self._start_watch, job)
        elif isinstance(result, RequestFailed):  # refused: the request ends with the prefill's status
            self.host.end_with(job, result)
        # else: gave up at the deadline (the poll aborts the request) or the request ended

    def landed(self, seconds: float) -> None:
        """A room committed ``seconds`` after its handshake went out."""
        self._landings.append(seconds)

    def watch_delay_s(self) -> float:
        """How long a room waits for its KV before it watches its prefill: twice the median
        of recent rooms' handshake -> commit time, within the config's [watch_after_s,
        watch_after_max_s]. A room as fast as usual then never holds a call on the
        bootstrap, whatever the model's compute takes."""
        c = self.config
        typical = statistics.median(self._landings) if self._landings else 0.0
        return min(c.watch_after_max_s, max(c.watch_after_s, 2 * typical))

    def _start_watch(self, job: Job) -> None:
        """The room's KV has not landed soon after the handshake: watch its prefill."""
        waiting = job.fate.state in (FateState.WAITING, FateState.HANDSHAKEN)
        if waiting and job.watch_task is None and job.room_secret and not self.host.closing:
            job.watch_task = self.host.spawn(self._watch(job), f"watch-room {job.room}")

    @staticmethod
    def stop_watch(job: Job) -> None:
        """The room left the queues (committed or ended): end its held failure watch, so
        the call does not keep one of the bootstrap's bounded places."""
        if job.watch_task is not None:
            job.watch_task.cancel()
            job.watch_task = None

    async def _watch(self, job: Job) -> None:
        """Hold QueryRoomFailures on the prefill's bootstrap, where its controller records
        every failed room, until the room's KV lands or its prefill failed (smg, for one,
        does not cancel the decode leg when its prefill leg fails)."""
        while job.fate.in_queues and not self.host.closing:
            found = await self.directory.room_failures(job.prefill.address, {job.room: job.room_secret}, self.config.watch_wait_s)
            if found is None:
                return  # the bootstrap cannot say: the request's own deadlines still bound it
            failed = found.get(job.room)
            if failed is None:
                continue
            failure, never_forwarded = failed
            if job.fate.live:
                request_event(log, job.room, "prefill failed", level=logging.WARNING, message=failure.message)
                if never_forwarded:
                    job.fate.handle(NeverForwarded())
                self.host.end_with(job, failure)
            return

    # -- abort ----------------------------------------------------------------------------------
    async def abort_room(self, job: Job, reason: str) -> None:
        """AbortRoom to the prefill worker(s); their ack releases the quarantined slot
        and pages (else the lease does)."""
        if job.handshake_task is not None:  # never let AbortRoom overtake the Handshake
            await asyncio.gather(job.handshake_task, return_exceptions=True)
        # Every rank follows the writers too: once each rank's transport confirms them
        # gone, the quarantine ends without the ack (a SIGKILLed worker never sends one).
        writers = self.handshaker.writers_by_rank(job)
        self.transfers.watch_writers(job.room, writers[0])
        if isinstance(self.queues, ReplicatedQueues):
            self.queues.note(ROOM_WRITERS, job.room, writers)
        if await self.handshaker.abort_room(job, reason) and self.queues.on_abort_ack(job.room):
            request_event(log, job.room, "abort acknowledged; quarantine released", workers=len(job.contacted))
            self.host.wake()
