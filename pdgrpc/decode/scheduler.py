"""The decode scheduler: one asyncio task driving the pure decode machines.

Each iteration of :meth:`DecodeScheduler._run`, in this order::

    cancels of running requests      (a client that went away)
    queues.tick(now)                 pre-transfer deadlines (resolving dp rank, memory)
    queues.poll_dp_ranks(now)        -> batched, throttled QueryDpRanks (background tasks)
    queues.prealloc(now)             -> pages + slot; advertise the grant, THEN handshake
    queues.poll_transfers(now, ...)  local poll -> metadata gate -> MIN (TP=1: identity)
                                      -> Committed (first token from the slot row)
                                      -> Aborted  (status to the client, AbortRoom to prefill)
    engine.decode_step(running)      in a worker thread; one token per running request

Network calls (bootstrap queries, handshakes and AbortRoom through
:class:`~pdgrpc.decode.handshake.Handshaker`) run as their own tasks and feed their
results back into the pure state; the loop itself never waits on the network.
Only the scheduler task touches the engine, and :class:`~pdgrpc.state.DecodeQueues` is
only touched by synchronous code on the loop, so no lock is needed.

**Who owns the pages.** The decode queues' page allocator is the one source of truth for
this pool; the engine's own allocator is never used on decode (the engine only reads and
writes the pages each call names). A request gets, before its handshake, every page it
can ever need -- prompt + ``max_new_tokens`` -- so a running request never waits for a
page and nothing needs preempting; pages of an aborted request stay quarantined until
the prefill acknowledged the abort (or the lease ran out), which the queues decide.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Awaitable

import grpc
import torch

from pdgrpc.decode.handshake import ACCEPTED, Handshaker
from pdgrpc.decode.job import DecodeFailure, Failed, Job, SchedulerConfig, Tokens
from pdgrpc.decode.prefills import PrefillDirectory, PrefillInfo
from pdgrpc.engine.base import DecodeRequest as EngineDecodeRequest
from pdgrpc.engine.base import Engine, PrefillRequest, SampledToken, SamplingParams, stop_reason
from pdgrpc.errors import PdgrpcError
from pdgrpc.kvpoll import KVPoll
from pdgrpc.metrics import DecodeMetrics, ServerAbortReason
from pdgrpc.rpc.errors import RpcError
from pdgrpc.serving.logs import request_event
from pdgrpc.serving.metadata import compat_hash_bytes, metadata_layout
from pdgrpc.serving.threads import compute_executor
from pdgrpc.state import AbortReason, Aborted, Committed, DecodeQueues, DpConfig, MetadataBuffers
from pdgrpc.state import NewRequest, QueryDpRanks, SendHandshake, resolve_locally
from pdgrpc.serving.tp import METADATA_SINK_REGION_ID, check_tp_sizes, senders_of, transfer_room
from pdgrpc.decode.tp import ROOM_INFO, ReplicatedQueues, TpGroup, TpGroupBroken
from pdgrpc.transport.base import MemoryRegion, RegionKind, RoomGrant, Transport, UnknownRoom
from pdgrpc.transport.pages import kv_regions, metadata_region

if TYPE_CHECKING:
    from pdgrpc.metrics.reasons import AnyAbortReason

log = logging.getLogger("pdgrpc.decode")

__all__ = ["DecodeScheduler"]

# The queues resolve dp ranks for many prefill instances of different dp sizes, but take
# one DpConfig. The driver therefore resolves every rank it can itself (per instance, see
# PrefillDirectory) and hands the queues only the rooms that need a query; this config
# makes the queues query every room they are given and accept any rank the driver
# checked against the right instance's dp size.
_ANY_DP_SIZE = 1 << 16


class DecodeScheduler:
    def __init__(
        self,
        engine: Engine,
        transport: Transport,
        num_slots: int,
        config: SchedulerConfig = SchedulerConfig(),
        directory: PrefillDirectory | None = None,
        metrics: DecodeMetrics | None = None,
        tp: TpGroup | None = None,
    ) -> None:
        self.engine = engine
        # TP > 1: this is rank 0; the other ranks replay its queue calls (pdgrpc.decode.tp).
        self.tp = tp
        self.tp_size = tp.size if tp is not None else 1
        # Outcomes are counted where they are decided (_finish, _fail, the dp-rank query);
        # the live gauges come from stats() at scrape time, never from counters here.
        self.metrics = metrics or DecodeMetrics(transport=transport.name)
        self.transport = transport
        self.config = config
        self.buffers = MetadataBuffers(num_slots, metadata_layout())
        # Rows written by the prefill ranks that are not this rank's designated metadata
        # writer (TP sizes differ): the same slot, never read (pdgrpc.serving.tp).
        self.sink = torch.zeros_like(self.buffers.tensor)
        queues = make_queues(self.buffers, engine.num_pages, config)
        self.queues: Any = ReplicatedQueues(queues) if tp is not None else queues
        self.directory = directory or PrefillDirectory(timeout=config.rpc_timeout_s, query_interval_s=config.query_interval_s)
        self.compat_hash = compat_hash_bytes(engine)
        self.descriptor = b""
        # Its descriptor is filled in by start(), once the transport registered the pools.
        self.handshaker = Handshaker(self.directory, transport.name, b"", self.compat_hash, config.rpc_timeout_s)
        self.fatal: asyncio.Future[str] | None = None  # (start) set when a TP rank is lost
        self._room_keys: dict[int, list[int]] = {}  # transport rooms per room, until released
        self._jobs: dict[int, Job] = {}  # every admitted, unfinished request
        self._reserved: set[int] = set()  # rooms being admitted (awaiting prefill info)
        self._running: list[Job] = []
        self._prefill_locally: list[Job] = []  # fake transfers: compute the prompt's KV here
        self._tasks: set[asyncio.Task[Any]] = set()
        self._poll_pending = False  # a transport room ended; _transfer_ended is scheduled
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._closing = False
        # Every engine call runs here, one at a time (the engine is not thread-safe).
        self._engine_thread = compute_executor("decode-compute", config.compute_nice)
        self.page_bytes = sum(t[0].numel() * t.element_size() for t in (*engine.kv_buffers().k, *engine.kv_buffers().v))

    # -- life cycle ---------------------------------------------------------------------
    async def start(self) -> None:
        self.fatal = asyncio.get_running_loop().create_future()
        kv = self.engine.kv_buffers()
        regions = [*kv_regions(kv.k, kv.v), metadata_region(self.buffers.tensor), sink_region(self.sink)]
        self.descriptor = await self.transport.register(regions)
        self.handshaker.descriptor = self.descriptor
        if self.tp is not None:  # every rank's descriptor, for the handshakes sent on its behalf
            self.handshaker.descriptors = tuple(await asyncio.to_thread(self.tp.all_gather, self.descriptor))
        self.transport.rooms.add_listener(self._on_transport_terminal)
        self._engine_thread.submit(lambda: None)  # the compute thread starts (and is reniced) now
        self._loop_task = asyncio.create_task(self._run(), name="decode-scheduler")

    async def close(self, abort_wait_s: float = 1.0) -> None:
        """Fail what is in flight (UNAVAILABLE), tell the prefills (AbortRoom, waiting at
        most ``abort_wait_s``), stop every task, close the transport."""
        self._closing = True
        self._wake.set()
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        aborts = []
        for job in list(self._jobs.values()):
            msg = f"room {job.room}: decode server is shutting down"
            self._fail(job, Failed(grpc.StatusCode.UNAVAILABLE, msg), ServerAbortReason.SHUTDOWN)
            if job.handshake_task is not None:
                job.handshake_task.cancel()
            if job.slot is not None:  # a prefill may be writing for it: best effort
                aborts.append(asyncio.ensure_future(self._abort_room(job, msg)))
        if aborts:
            await asyncio.wait(aborts, timeout=abort_wait_s)
        tasks = [*aborts, *self._tasks]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.tp is not None and self.fatal is not None and not self.fatal.done():
            try:  # the other ranks leave their loops and exit
                await asyncio.wait_for(asyncio.to_thread(self.tp.broadcast, ("stop", None)), 10.0)
            except (TpGroupBroken, asyncio.TimeoutError) as exc:
                log.warning("could not tell the other TP ranks to stop: %s", exc)
        self._engine_thread.shutdown(wait=False)  # a step still running (TP group stuck) must not block the exit
        await self.transport.close()

    def _spawn(self, coro: Awaitable[Any], name: str) -> "asyncio.Task[Any]":
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: "asyncio.Task[Any]") -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task %s failed", task.get_name(), exc_info=task.exception())

    # -- admission (called from the Decode RPC) -----------------------------------------
    async def submit(
        self,
        room: int,
        request_id: str,
        input_ids: tuple[int, ...],
        sampling: SamplingParams,
        max_new_tokens: int,
        prefill_address: str,
        routed_dp_rank: int | None,
    ) -> Job:
        """Admit a request (fields already validated by the servicer) or raise DecodeFailure."""
        if self._closing:
            raise DecodeFailure(grpc.StatusCode.UNAVAILABLE, "decode server is shutting down")
        if room in self._jobs or room in self._reserved or self.queues.slot_of(room) is not None:
            raise DecodeFailure(grpc.StatusCode.ALREADY_EXISTS, f"bootstrap_room {room} is already in use on this decode")
        n_pages = max(self.engine.pages_needed(len(input_ids)), self.engine.pages_needed(len(input_ids) + max_new_tokens - 1))
        if n_pages > self.engine.num_pages:
            raise DecodeFailure(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"max_new_tokens: prompt ({len(input_ids)}) + max_new_tokens ({max_new_tokens}) needs {n_pages} KV pages, "
                f"the decode pool has {self.engine.num_pages}",
            )
        self._reserved.add(room)
        try:
            prefill = await self._prefill_info(prefill_address)
        finally:
            self._reserved.discard(room)
        if self._closing:
            raise DecodeFailure(grpc.StatusCode.UNAVAILABLE, "decode server is shutting down")
        theirs = bytes(prefill.info.compatibility_hash)
        if theirs != self.compat_hash:
            raise DecodeFailure(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"compatibility hash mismatch: prefill {prefill_address} has {theirs.hex() or '(empty)'}, "
                f"this decode has {self.compat_hash.hex()} (model, page size, KV dtype or layout differ)",
            )
        prefill_tp = max(1, int(prefill.info.tp_size))
        try:
            check_tp_sizes(prefill_tp, self.tp_size)
        except PdgrpcError as exc:
            raise DecodeFailure(grpc.StatusCode.FAILED_PRECONDITION, f"prefill {prefill_address}: {exc}") from None
        try:
            rank = resolve_locally(room, routed_dp_rank, prefill.dp)
        except PdgrpcError as exc:
            raise DecodeFailure(grpc.StatusCode.INVALID_ARGUMENT, f"routed_dp_rank: {exc}") from None
        now = time.monotonic()
        job = Job(room, request_id, input_ids, sampling, max_new_tokens, prefill, n_pages, asyncio.Queue(), now, dp_rank=rank)
        if self.tp is not None:  # the other ranks advertise their own grants for it
            self.queues.note(ROOM_INFO, room, self.engine.pages_needed(len(input_ids)), prefill_tp)
        self.queues.add(NewRequest(room, prefill_address, n_pages, rank, fake=not self.transport.moves_bytes), now)
        self._room_keys[room] = self._keys(room, prefill_tp)
        self._jobs[room] = job
        how = "routed" if routed_dp_rank is not None else ("local rule" if rank is not None else "query bootstrap")
        request_event(
            log, room, "admitted", request_id=request_id, prompt_tokens=len(input_ids), max_new_tokens=max_new_tokens,
            prefill=prefill_address, dp_rank=rank if rank is not None else "?", dp_rank_from=how, pages=n_pages,
        )
        self._wake.set()
        return job

    async def _prefill_info(self, address: str) -> PrefillInfo:
        try:
            return await self.directory.parallel_info(address, wait_for=self.config.deadlines.resolve_dp_rank_s)
        except RpcError as exc:
            code = exc.code if exc.code != grpc.StatusCode.UNKNOWN else grpc.StatusCode.UNAVAILABLE
            raise DecodeFailure(code, f"prefill_bootstrap_address {address}: GetParallelInfo failed: {exc.details}") from None

    def cancel(self, room: int, message: str) -> None:
        """Abort ``room`` (the client went away). Takes effect at once before the
        handshake, at the next poll during the transfer, before the next step when running."""
        job = self._jobs.get(room)
        if job is None or job.finished:
            return
        job.cancelled = True
        request_event(log, room, "cancel requested", why=message)
        if not job.running and job not in self._prefill_locally:
            aborted = self.queues.cancel(room, time.monotonic(), message)
            if aborted is not None:
                self._on_aborted(aborted)
        self._wake.set()

    # -- stats ------------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        return queue_stats(self.queues, len(self._jobs), len(self.transport.rooms))

    # -- the loop ---------------------------------------------------------------------------
    async def _run(self) -> None:
        while not self._closing:
            # Cleared before the work: a wake-up set during it runs the next iteration at once.
            self._wake.clear()
            try:
                busy = await self._iteration()
            except Exception:  # a bug must be loud, and must not stop the server
                log.exception("decode scheduler iteration failed")
                busy = False
            if busy:
                await asyncio.sleep(0)  # let RPCs and transport callbacks in between steps
                continue
            q = self.queues
            timeout = self.config.idle_poll_s if (q.num_requests or q.num_quarantined) else 1.0
            # asyncio.timeout, not wait_for: wait_for wraps the wait in a task of its own,
            # which costs two more loop passes between a KV landing and its first token.
            try:
                async with asyncio.timeout(timeout):
                    await self._wake.wait()
            except TimeoutError:
                pass

    async def _iteration(self) -> bool:
        """One pass over the machines; True when it computed (more work is likely)."""
        q = self.queues
        now = time.monotonic()
        self._drop_cancelled_running()
        for aborted in q.tick(now):
            self._on_aborted(aborted)
        for query in q.poll_dp_ranks(now):
            self._spawn(self._query_dp_ranks(query), f"query-dp-ranks {query.prefill_address}")
        handshakes = q.prealloc(now)
        if self.tp is None:
            for hs in handshakes:
                self._start_handshake(hs, now)
            outcomes = q.poll_transfers(now, local_poll=self._local_poll)
        else:
            advertised = [(hs, self._advertise(hs, now)) for hs in handshakes]
            outcomes = self._tp_poll(now)
            # Only now: every rank has replayed prealloc and advertised its grants, so a
            # prefill rank that writes at once finds them.
            for hs, prompt_pages in advertised:
                if prompt_pages is not None:
                    self._send_handshake(hs, prompt_pages)
        self._act_on(outcomes, now)
        if self._prefill_locally or self._running:
            await self._compute()
            return True
        return False

    def _tp_poll(self, now: float) -> list[Any]:
        """Broadcast the queue calls since the last poll, then poll collectively: every
        rank gates on its own rows before the MIN all-reduce (pdgrpc.state.transfer_poll).
        Blocks the loop for the two collectives (well under a millisecond when the other
        ranks wait for it, which they do): nothing may touch the queues in between."""
        assert self.tp is not None
        t = self.queues.prepare_poll(now, self._local_poll)
        try:
            self.tp.broadcast(("sync", (self.queues.take_log(), now)))
            reduced = self.tp.all_reduce_min(t)
        except TpGroupBroken as exc:
            self.rank_lost(str(exc))
            return []
        return list(self.queues.finish_poll(reduced, now))

    def rank_lost(self, why: str) -> None:
        """Another TP rank is gone (its collective failed, or its process exited): this
        instance cannot go on. Sets :attr:`fatal`; no-op once closing."""
        if self._closing or self.fatal is None or self.fatal.done():
            return
        log.error("%s; this decode instance cannot continue", why)
        self.fatal.set_result(why)
        self._closing = True
        self._wake.set()

    def _keys(self, room: int, prefill_tp: int) -> list[int]:
        """This rank's transport rooms for ``room``: one per prefill rank it waits for."""
        if prefill_tp == 1 and self.tp_size == 1:
            return [room]
        return [transfer_room(room, p, 0) for p in senders_of(0, self.tp_size, prefill_tp)]

    def _job_keys(self, room: int) -> list[int]:
        return self._room_keys.get(room) or [room]

    def _local_poll(self, room: int) -> KVPoll:
        """This rank's view of ``room`` for the transfer poll. Until every prefill worker
        accepted the handshake the room counts as BOOTSTRAPPING, so the bootstrap
        deadline covers an unanswered handshake."""
        job = self._jobs.get(room)
        try:
            st = min((self.transport.status(k) for k in self._job_keys(room)), key=lambda s: s.state)
        except UnknownRoom:
            if job is not None:
                job.transport_reason = "the transport no longer tracks the room"
            return KVPoll.FAILED
        if st.state is KVPoll.FAILED:
            if job is not None and job.transport_reason is None:
                job.transport_reason = st.reason or "no reason given"
            return KVPoll.FAILED
        if job is not None and not job.handshaken:
            return min(st.state, KVPoll.BOOTSTRAPPING)
        return st.state

    # -- dp ranks -----------------------------------------------------------------------------
    async def _query_dp_ranks(self, query: QueryDpRanks) -> None:
        addr = query.prefill_address
        try:
            answers = await self.directory.query_dp_ranks(addr, query.rooms)
        except RpcError as exc:
            self.metrics.on_dp_rank_query_failed(len(query.rooms))
            log.warning("QueryDpRanks to %s for %d rooms failed (asked again next interval): %s", addr, len(query.rooms), exc)
            return
        self.metrics.on_dp_rank_query(len(query.rooms), missing=sum(1 for r in answers.values() if r is None))
        now = time.monotonic()
        good: dict[int, int | None] = {}
        for room, rank in answers.items():
            job = self._jobs.get(room)
            if job is None:
                continue
            if rank is not None and not 0 <= rank < job.prefill.dp_size:
                job.abort_cause = ServerAbortReason.INTERNAL_ERROR
                job.override = Failed(
                    grpc.StatusCode.INTERNAL,
                    f"room {room}: bootstrap {addr} answered dp rank {rank}, outside [0, {job.prefill.dp_size})",
                )
                self.cancel(room, job.override.message)
                continue
            good[room] = rank
        if self._closing:
            return
        moved = self.queues.on_dp_ranks(addr, good, now)
        for room, rank in good.items():
            job = self._jobs.get(room)
            if rank is not None and job is not None:
                job.dp_rank = rank
                request_event(log, room, "dp rank resolved", prefill=addr, dp_rank=rank)
        if moved:
            self._wake.set()
        missing = sum(1 for r in good.values() if r is None)
        if missing:
            log.debug("QueryDpRanks to %s: %d of %d rooms not registered yet", addr, missing, len(query.rooms))

    # -- handshake ------------------------------------------------------------------------------
    def _start_handshake(self, hs: SendHandshake, now: float) -> None:
        prompt_pages = self._advertise(hs, now)
        if prompt_pages is not None:
            self._send_handshake(hs, prompt_pages)

    def _advertise(self, hs: SendHandshake, now: float) -> tuple[int, ...] | None:
        """Record the allocation and advertise the grants; the prompt's pages, or None
        when the transport refused (the request is then cancelled)."""
        job = self._jobs[hs.room]
        job.slot, job.pages, job.dp_rank = hs.slot, hs.pages, hs.dp_rank
        job.handshake_sent_at = now
        prompt_pages = hs.pages[: self.engine.pages_needed(len(job.input_ids))]
        try:
            # Advertise BEFORE the handshake: a prefill that writes at once finds the grant.
            for key in self._job_keys(hs.room):
                self.transport.advertise(RoomGrant.of(key, prompt_pages, hs.slot))
        except PdgrpcError as exc:
            job.abort_cause = ServerAbortReason.INTERNAL_ERROR
            job.override = Failed(grpc.StatusCode.INTERNAL, f"room {hs.room}: transport refused the grant: {exc}")
            self.cancel(hs.room, job.override.message)
            return None
        request_event(log, hs.room, "pages allocated", slot=hs.slot, pages=len(hs.pages), prompt_pages=len(prompt_pages), dp_rank=hs.dp_rank)
        return prompt_pages

    def _send_handshake(self, hs: SendHandshake, prompt_pages: tuple[int, ...]) -> None:
        job = self._jobs.get(hs.room)
        if job is None or job.finished:
            return
        job.handshake_task = self._spawn(self._handshake(job, prompt_pages), f"handshake {hs.room}")

    def _on_transport_terminal(self, key: int) -> None:
        """The transport's listener: a transport room landed or failed. Acted on at the
        next turn of the loop, outside the transport's own receive path, once for all
        the rooms that ended until then (a lost peer fails many at once)."""
        if not self._poll_pending and not self._closing:
            self._poll_pending = True
            asyncio.get_running_loop().call_soon(self._transfer_ended)

    def _transfer_ended(self) -> None:
        self._poll_pending = False
        if self._closing:
            return
        if self.tp is None:
            self._poll_now()
        self._wake.set()  # TP: the collective poll runs in the loop, on every rank together

    def _poll_now(self) -> None:
        """One rank (no collective to keep in step): the transfer poll right away, so a
        landed room commits and its first token goes out now rather than after the loop
        wakes up and runs a whole iteration. The loop still runs the decode steps. Safe
        between iterations and while one awaits its compute step: the poll touches only
        slots in transfer or quarantine, and a job committed here joins ``_running`` for
        the next step."""
        now = time.monotonic()
        self._act_on(self.queues.poll_transfers(now, local_poll=self._local_poll), now)

    def _act_on(self, outcomes: list[Any], now: float) -> None:
        for outcome in outcomes:
            if isinstance(outcome, Committed):
                self._on_committed(outcome, now)
            else:
                self._on_aborted(outcome)

    async def _handshake(self, job: Job, prompt_pages: tuple[int, ...]) -> None:
        deadline = job.handshake_sent_at + self.config.deadlines.bootstrap_s
        result = await self.handshaker.handshake(job, prompt_pages, deadline)
        if result is ACCEPTED:
            job.handshaken = True
            self._wake.set()
        elif isinstance(result, Failed):  # refused: the request ends with the prefill's status
            job.abort_cause = ServerAbortReason.PREFILL_ERROR
            job.override = result
            self.cancel(job.room, result.message)
        # else: gave up at the deadline (the poll aborts the request) or the request ended

    # -- outcomes ------------------------------------------------------------------------------
    def _on_committed(self, c: Committed, now: float) -> None:
        job = self._jobs[c.room]
        self._release_transport(c.room)
        transfer_s = now - job.handshake_sent_at
        if c.row is None:  # fake transport: nothing was written; compute the prompt's KV here
            self.metrics.on_transfer(0, transfer_s)
            request_event(log, c.room, "committed (fake transfer: prefilling locally)", transfer_s=f"{transfer_s:.4f}")
            job.running = True
            self._prefill_locally.append(job)
            return
        row = c.row
        # The row holds top_k (20) entries; the request asked for sampling.top_logprobs of them.
        k = job.sampling.top_logprobs
        first = SampledToken(row.output_id, row.output_token_logprob_value, tuple(row.top_logprobs_indices[:k]), tuple(row.top_logprobs_values[:k]))
        # Every rank received the same share: the request's KV is tp_size times this rank's.
        nbytes = len(c.pages[: self.engine.pages_needed(len(job.input_ids))]) * self.page_bytes * self.tp_size + self.buffers.layout.row_bytes
        self.metrics.on_transfer(nbytes, transfer_s)
        job.running = True
        self._emit_first(job, first, nbytes, transfer_s)
        # After the stream's wake-up: the first token goes out before this line is written.
        request_event(log, c.room, "committed", slot=c.slot, first_token=row.output_id, bytes=nbytes, transfer_s=f"{transfer_s:.4f}", defer=True)

    def _emit_first(self, job: Job, first: SampledToken, nbytes: int, transfer_s: float) -> None:
        job.generated = 1
        job.last_token = first.token_id
        reason = stop_reason(first.token_id, 1, job.max_new_tokens, job.sampling, self.engine.tokenizer.eos_token_id)
        job.out.put_nowait(Tokens((first.token_id,), (first.logprob,), reason or "", nbytes, transfer_s, _top(first)))
        if reason is not None:
            self._finish(job, reason)
        else:
            self._running.append(job)

    def _on_aborted(self, a: Aborted) -> None:
        job = self._jobs.get(a.room)
        if job is None:
            self._release_transport(a.room, a.message)
            return
        status = self._status_of(job, a)
        self._release_transport(a.room, status.message)
        request_event(
            log, a.room, "aborted", level=logging.WARNING, state=a.state, reason=a.reason.name,
            status=status.code.name, message=status.message, quarantined=a.awaiting_ack,
        )
        # A status the driver decided (handshake refused, bad grant, bad rank) has its own
        # cause; otherwise the state machine's reason is the cause.
        self._fail(job, status, job.abort_cause or a.reason)
        if a.awaiting_ack:
            self._spawn(self._abort_room(job, status.message), f"abort-room {a.room}")

    def _status_of(self, job: Job, a: Aborted) -> Failed:
        if job.override is not None:
            return job.override
        r = a.reason
        if r is AbortReason.METADATA_CORRUPTION:
            return Failed(grpc.StatusCode.ABORTED, a.message)
        if r is AbortReason.TRANSFER_FAILED:
            return Failed(grpc.StatusCode.ABORTED, f"{a.message}: {job.transport_reason or 'transport failure'}")
        if r is AbortReason.CANCELLED:
            return Failed(grpc.StatusCode.CANCELLED, a.message)
        if r is AbortReason.TP_DESYNC:
            return Failed(grpc.StatusCode.INTERNAL, a.message)
        phase = {
            AbortReason.RESOLVE_DP_RANK_TIMEOUT: "resolving the prefill dp rank (QueryDpRanks found no entry)",
            AbortReason.ALLOCATE_TIMEOUT: "waiting for free KV pages and a metadata slot",
            AbortReason.BOOTSTRAP_TIMEOUT: "bootstrap (handshake with the prefill worker not accepted)",
            AbortReason.WAITING_FOR_INPUT_TIMEOUT: "waiting for the prefill to send KV",
            AbortReason.TRANSFER_TIMEOUT: "transferring KV and metadata",
        }.get(r, r.name)
        msg = f"{a.message}: phase {phase}"
        if job.last_error and r is AbortReason.BOOTSTRAP_TIMEOUT:
            msg += f"; last error: {job.last_error}"
        return Failed(grpc.StatusCode.DEADLINE_EXCEEDED, msg)

    async def _abort_room(self, job: Job, reason: str) -> None:
        """AbortRoom to the prefill worker(s); their ack releases the quarantined slot
        and pages (else the lease does)."""
        if job.handshake_task is not None:  # never let AbortRoom overtake the Handshake
            await asyncio.gather(job.handshake_task, return_exceptions=True)
        if await self.handshaker.abort_room(job, reason) and self.queues.on_abort_ack(job.room):
            request_event(log, job.room, "abort acknowledged; quarantine released", workers=len(job.contacted))
            self._wake.set()

    def _release_transport(self, room: int, abort_message: str | None = None) -> None:
        """Release ``room``'s transport rooms; an aborted room's message goes into the
        refusal of any write that comes for it later, so the prefill reports the cause."""
        for key in self._room_keys.pop(room, [room]):
            if abort_message is None:
                self.transport.release(key)
            else:
                self.transport.release_because(key, abort_message)

    def _fail(self, job: Job, status: Failed, reason: AnyAbortReason) -> None:
        if job.finished:
            return
        self.metrics.on_abort(reason)  # exactly once per request: `finished` guards it
        job.finished = True
        self._jobs.pop(job.room, None)
        job.out.put_nowait(status)

    def _finish(self, job: Job, reason: str) -> None:
        self.metrics.on_finished()
        job.finished = True
        self._jobs.pop(job.room, None)
        self.queues.release_pages(job.pages)
        request_event(log, job.room, "finished", reason=reason, tokens=job.generated)

    def _drop_cancelled_running(self) -> None:
        keep = []
        for job in self._running:
            if job.cancelled:
                self.queues.release_pages(job.pages)
                request_event(log, job.room, "cancelled while generating", tokens=job.generated)
                self._fail(job, Failed(grpc.StatusCode.CANCELLED, f"room {job.room}: cancelled"), AbortReason.CANCELLED)
            else:
                keep.append(job)
        self._running = keep

    # -- compute ---------------------------------------------------------------------------------
    async def _compute(self) -> None:
        """Local prefills (fake transfers), then one decode step over every running request,
        in a worker thread so the loop keeps serving RPCs and transport callbacks."""
        if self._prefill_locally:
            jobs, self._prefill_locally = self._prefill_locally, []
            firsts = await self._in_step_thread(self._prefill_jobs, jobs)
            if firsts is None:
                return
            for job, first in zip(jobs, firsts):
                if isinstance(first, BaseException):
                    self._crash(job, first)
                elif job.cancelled:
                    self.queues.release_pages(job.pages)
                    self._fail(job, Failed(grpc.StatusCode.CANCELLED, f"room {job.room}: cancelled"), AbortReason.CANCELLED)
                else:
                    self._emit_first(job, first, 0, time.monotonic() - job.handshake_sent_at)
        batch = [j for j in self._running if not j.cancelled]
        if not batch:
            return
        await self._await_first_tokens_sent(batch)
        batch = [j for j in batch if not j.cancelled]
        if not batch:
            return
        reqs = [EngineDecodeRequest(j.last_token, j.position, j.pages, j.sampling) for j in batch]
        try:
            toks = await self._in_step_thread(self._decode_step, reqs)
            if toks is None:
                return
        except Exception as exc:  # an engine bug must not wedge the server: fail the batch
            log.exception("decode step over %d requests failed", len(batch))
            for job in batch:
                self._crash(job, exc)
            self._running = [j for j in self._running if not j.finished]
            return
        eos = self.engine.tokenizer.eos_token_id
        for job, tok in zip(batch, toks):
            if job.cancelled:
                continue  # dropped (and its pages freed) at the top of the next iteration
            job.generated += 1
            job.last_token = tok.token_id
            reason = stop_reason(tok.token_id, job.generated, job.max_new_tokens, job.sampling, eos)
            job.out.put_nowait(Tokens((tok.token_id,), (tok.logprob,), reason or "", top=_top(tok)))
            if reason is not None:
                self._finish(job, reason)
        self._running = [j for j in self._running if not j.finished]

    async def _await_first_tokens_sent(self, batch: list[Job]) -> None:
        """Hold a step that serves only requests whose first token is still being sent.

        The step's Python holds the GIL for most of a step, and gRPC needs it to send: on a
        small host a step started right after a commit delayed the first token's send from
        ~0.5 to ~1.2 ms (traced). Its tokens cannot reach these clients before their first
        one anyway, so waiting costs them nothing; a batch with a request already streaming
        does not wait (its next token would be late). Bounded by ``first_token_wait_s``.
        """
        wait_s = self.config.first_token_wait_s
        if wait_s <= 0 or any(j.first_sent.is_set() for j in batch):
            return
        pending = [asyncio.ensure_future(j.first_sent.wait()) for j in batch]
        try:
            await asyncio.wait(pending, timeout=wait_s)
        finally:
            for f in pending:
                f.cancel()

    async def _in_step_thread(self, fn: Any, arg: Any) -> Any:
        """Run a compute step in a worker thread; None when the TP group broke."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._engine_thread, fn, arg)
        except TpGroupBroken as exc:
            self.rank_lost(str(exc))
            return None

    def _decode_step(self, reqs: list[EngineDecodeRequest]) -> list[SampledToken]:
        if self.tp is not None:  # the other ranks run the same step (the engine all-reduces)
            self.tp.broadcast(("step", reqs))
        return self.engine.decode_step(reqs)

    def _prefill_jobs(self, jobs: list[Job]) -> list[SampledToken | BaseException]:
        reqs = [PrefillRequest(job.input_ids, job.pages, job.sampling) for job in jobs]
        if self.tp is not None:
            self.tp.broadcast(("prefill", reqs))
        return prefill_locally(self.engine, reqs)

    def _crash(self, job: Job, exc: BaseException) -> None:
        self.queues.release_pages(job.pages)
        self._fail(job, Failed(grpc.StatusCode.INTERNAL, f"room {job.room}: engine failed: {exc}"), ServerAbortReason.INTERNAL_ERROR)


def queue_stats(q: Any, active_requests: int, transport_rooms: int) -> dict[str, int]:
    """What a decode rank holds (GetStats, the live metrics), read from its queues."""
    return dict(
        active_requests=active_requests,
        slots_in_use=q.slots.num_slots - q.slots.num_free,
        slots_total=q.slots.num_slots,
        pages_in_use=q.pages.num_pages - q.pages.num_free - q.pages.num_quarantined,
        pages_quarantined=q.pages.num_quarantined,
        pages_total=q.pages.num_pages,
        transport_rooms=transport_rooms,
    )


def make_queues(buffers: MetadataBuffers, num_pages: int, config: SchedulerConfig) -> DecodeQueues:
    """The decode queues as every rank builds them (identical, for the TP replay)."""
    return DecodeQueues(
        buffers, num_pages, DpConfig(dp_size=_ANY_DP_SIZE, force_query=True, query_interval_s=config.query_interval_s), config.deadlines
    )


def sink_region(rows: torch.Tensor) -> MemoryRegion:
    """The sink metadata rows (see pdgrpc.serving.tp)."""
    return MemoryRegion(METADATA_SINK_REGION_ID, rows, RegionKind.METADATA, "metadata-sink")


def prefill_locally(engine: Engine, reqs: list[PrefillRequest]) -> list[SampledToken | BaseException]:
    """Fake transfers: compute each prompt's KV here (every TP rank, in the same order)."""
    out: list[SampledToken | BaseException] = []
    for req in reqs:
        try:
            tok = engine.prefill_chunk(req, 0, len(req.token_ids))
            assert tok is not None
            out.append(tok)
        except Exception as exc:
            out.append(exc)
    return out


def _top(tok: SampledToken) -> tuple[tuple[tuple[int, ...], tuple[float, ...]]]:
    return ((tuple(tok.top_ids), tuple(tok.top_logprobs)),)
