"""The decode scheduler: one asyncio task driving the pure decode machines.

Each iteration of the scheduler's loop, in this order::

    cancels of running requests      (a client that went away)
    queues.tick(now)                 pre-transfer deadlines (resolving dp rank, memory)
    queues.poll_dp_ranks(now)        -> batched, throttled QueryDpRanks (background tasks)
    queues.prealloc(now)             -> pages + slot; advertise the grant, THEN handshake
    _poll(now, handshakes)           local poll -> metadata gate -> MIN (TP=1: identity)
                                      -> Committed (first token from the slot row)
                                      -> Aborted  (status to the client, AbortRoom to prefill)
    local prefill chunks             at most --local-prefill-chunk prompt tokens (pdgrpc.decode.local)
    engine.decode_step(running)      in a worker thread; one token per running request

``_poll`` is the one place the decode polls its transfers; with TP 1 a transport room
that ends runs it at once too, between iterations. Each request's fate
(:class:`~pdgrpc.state.decode_fate.DecodeFate`) decides how it ends; the scheduler and
its parts feed it events and do what it says.

The scheduler is built from two parts, each given what it needs at construction: the
network calls to the prefill (bootstrap queries and failure watches, handshakes, AbortRoom:
:class:`~pdgrpc.decode.prefill_calls.PrefillCalls`) run as their own tasks and feed their
results back into the pure state, so the loop itself never waits on the network; the
generation loop (:class:`~pdgrpc.decode.generation.Generation`) runs the engine.
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
from typing import Any, Awaitable


from pdgrpc.decode.generation import Generation
from pdgrpc.decode.handshake import Handshaker
from pdgrpc.decode.job import Job, SchedulerConfig, abort_status
from pdgrpc.decode.local import NO_PREFILL, LocalPrefills
from pdgrpc.decode.prefill_calls import PrefillCalls
from pdgrpc.decode.prefills import PrefillDirectory, PrefillInfo
from pdgrpc.decode.rank import RankTransfers, make_buffers, make_queues
from pdgrpc.decode.reuse import DecodeReuse
from pdgrpc.decode.statuses import Refusal, ending
from pdgrpc.decode.tp import EVICTABLE, ROOM_BIND, ROOM_INFO, ReplicatedQueues, TpGroup, TpGroupBroken
from pdgrpc.engine.base import Engine, SampledToken, SamplingParams
from pdgrpc.engine.layout import DELTA_PROTOCOL_VERSION, PROTOCOL_VERSIONS
from pdgrpc.errors import PdgrpcError, RequestFailed
from pdgrpc.kvpoll import KVPoll
from pdgrpc.metrics import DecodeMetrics
from pdgrpc.rpc import tracing
from pdgrpc.rpc.errors import RpcError
from pdgrpc.serving.kv_events import KvEventFeed
from pdgrpc.serving.logs import request_event
from pdgrpc.serving.metadata import compat_hash_bytes
from pdgrpc.serving.tp import check_tp_sizes
from pdgrpc.state import AbortReason, Aborted, Committed, DecodeQueues, DecodeState, NewRequest, Outcome, SendHandshake, resolve_locally
from pdgrpc.state.decode_fate import Cancel, Commit, ComputeHere, TransportFailed
from pdgrpc.state.room import Room
from pdgrpc.transport.base import Transport

log = logging.getLogger("pdgrpc.decode")

DEADLINE_SLACK_S = 0.001  # the idle loop wakes this long after a request's deadline
TP_IDLE_SYNC_S = 1.0  # with TP, an idle rank 0 syncs the other ranks this often

__all__ = ["DecodeScheduler"]


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
        # Outcomes are counted where they are decided (Generation, the dp-rank query);
        # the live gauges come from stats() at scrape time, never from counters here.
        self.metrics = metrics or DecodeMetrics(transport=transport.name)
        self.transport = transport
        self.config = config
        buffers = make_buffers(num_slots)
        # TP > 1: every queue call that changes state is logged for the other ranks.
        self._replicated = (
            ReplicatedQueues(buffers, engine.num_pages, config.deadlines, config.query_interval_s) if tp is not None else None
        )
        self.queues: DecodeQueues = self._replicated or make_queues(buffers, engine.num_pages, config, engine.tokenizer.vocab_size)
        self.buffers = buffers
        self.transfers = RankTransfers(transport, engine, self.queues, 0, self.tp_size)
        self.directory = directory or PrefillDirectory(timeout=config.rpc_timeout_s, query_interval_s=config.query_interval_s)
        self.compat_hash = compat_hash_bytes(engine)
        # A prefill's hash -> the protocol version it speaks, for every version this decode
        # serves: an older prefill gets every page, not a refusal.
        self._versions = {compat_hash_bytes(engine, v): v for v in PROTOCOL_VERSIONS}
        self.descriptor = b""
        # Its endpoints are set by start(), once the transport registered the pools.
        self.handshaker = Handshaker(
            self.directory, transport.name, config.rpc_timeout_s, config.deadlines.abort_lease_s,
            transport.writer_gone, self.queues.is_quarantined, self.bind_writer, config.deadlines.claim_s,
        )
        self.fatal: asyncio.Future[str] | None = None  # (start) set when a TP rank is lost
        self._jobs: dict[int, Job] = {}  # every admitted, unfinished request
        self._reserved: set[int] = set()  # rooms being admitted (awaiting prefill info)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._poll_pending = False  # a transport room ended; _transfer_ended is scheduled
        self._wake = asyncio.Event()
        self._synced: list[asyncio.Future[None]] = []  # bindings waiting for the next TP sync
        self._loop_task: asyncio.Task[None] | None = None
        self._closing = False
        self.calls = PrefillCalls(
            self, self.queues, self.transfers, self.directory, self.handshaker, config, self.metrics, engine.pages_needed
        )
        # The prefix cache, only when the prefill sends KV (a fake transfer computes the
        # prompt here, into every page). It lives on rank 0 and takes and frees pages
        # only through the queues' replayed calls, so with TP every rank holds the same
        # pages, each its own heads of them. Built by start(), on the loop its event feed serves.
        self.reuse: DecodeReuse | None = None
        self.kv_events: KvEventFeed | None = None
        self._evictable_noted = 0  # TP: what the followers were last told (tp.EVICTABLE)
        if config.prefix_cache and not transport.moves_bytes:
            log.warning("decode prefix cache off: the %s transport moves no KV (the decode computes every prompt)", transport.name)
        self.local = LocalPrefills(self.queues, config.local_prefill_chunk, config.deadlines.allocate_s)
        self.generation = Generation(
            engine, tp, config, self.metrics, self._release_pages, self._ended, self.rank_lost, self.local
        )
        self.page_bytes = sum(t[0].numel() * t.element_size() for t in (*engine.kv_buffers().k, *engine.kv_buffers().v))

    # -- life cycle ---------------------------------------------------------------------
    async def start(self) -> None:
        self.fatal = asyncio.get_running_loop().create_future()
        if self.config.prefix_cache and self.transport.moves_bytes:
            # Reports leave at once: a chat's next turn, sent as its last one ends, is
            # computed here only if the router already heard that this decode holds it.
            self.kv_events = KvEventFeed(on_subscribers=self.metrics.on_kv_event_streams, window_s=0)
            self.reuse = DecodeReuse(self.queues, self.engine.kv_layout.page_size, self.kv_events)
        self.descriptor = await self.transfers.register()
        ranks = [(self.descriptor, self.transport.auth_key)]
        if self.tp is not None:  # every rank's descriptor and key, for the handshakes sent on its behalf
            ranks = await asyncio.to_thread(self.tp.all_gather, ranks[0])
        self.handshaker.set_endpoints(ranks)
        self.transport.rooms.add_listener(self._on_transport_terminal)
        self.generation.start_thread()
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
            self.generation.fail(job, ending(Refusal.SHUTTING_DOWN, msg))
            if job.handshake_task is not None:
                job.handshake_task.cancel()
            if job.slot is not None:  # a prefill may be writing for it: best effort
                aborts.append(asyncio.ensure_future(self.calls.abort_room(job, msg)))
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
        self.generation.shutdown()
        self.directory.close()
        if self.kv_events is not None:
            await self.kv_events.close()
        await self.transport.close()

    # -- what the prefill calls need (CallsHost) ------------------------------------------------
    @property
    def closing(self) -> bool:
        return self._closing

    def job(self, room: int) -> Job | None:
        return self._jobs.get(room)

    def end_with(self, job: Job, failure: RequestFailed) -> None:
        """End ``job`` with ``failure`` (its status and abort reason) once its cancel takes
        effect (:meth:`Generation.fail` then sends it)."""
        self._cancel(job, Cancel(failure), failure.message)

    def wake(self) -> None:
        self._wake.set()

    def _release_pages(self, job: Job, complete: bool) -> None:
        """``job``'s pages go back: with the prefix cache, its held prefix is unlocked and,
        when ``complete`` (its prompt's KV landed), its full pages -- prompt and generated
        tokens -- are cached; the rest go to the queues."""
        lease, job.lease = job.lease, None
        if lease is None or self.reuse is None:
            self.queues.release_pages(job.pages)
            return
        own = job.pages[lease.cached_pages :]
        kv_ids = job.kv_ids if complete else None
        split = self.engine.pages_needed(len(kv_ids)) - lease.cached_pages if kv_ids is not None else 0
        self.reuse.release(lease, own[:split], kv_ids)
        if own[split:]:
            self.queues.release_pages(own[split:])

    def _unlock(self, job: Job) -> None:
        """Unlock ``job``'s cached prefix (its own pages are the queues' to free or quarantine)."""
        lease, job.lease = job.lease, None
        if lease is not None and self.reuse is not None:
            self.reuse.release(lease, (), None)

    def _ended(self, job: Job) -> None:
        self.calls.stop_watch(job)
        self._jobs.pop(job.room, None)

    def spawn(self, coro: Awaitable[Any], name: str) -> "asyncio.Task[Any]":
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
        room: Room,
        request_id: str,
        input_ids: tuple[int, ...],
        sampling: SamplingParams,
        max_new_tokens: int,
        prefill_address: str,
        routed_dp_rank: int | None,
        room_secret: bytes = b"",
    ) -> Job:
        """Admit a request (fields already validated by the servicer) or raise RequestFailed."""
        n_pages = self._admissible(room, input_ids, max_new_tokens)
        self._reserved.add(room)
        try:
            prefill = await self._prefill_info(prefill_address)
        finally:
            self._reserved.discard(room)
        if self._closing:
            raise ending(Refusal.SHUTTING_DOWN, "decode server is shutting down")
        theirs = bytes(prefill.info.compatibility_hash)
        version = self._versions.get(theirs)
        if version is None:
            raise ending(
                Refusal.INCOMPATIBLE,
                f"compatibility hash mismatch: prefill {prefill_address} has {theirs.hex() or '(empty)'}, "
                f"this decode has {self.compat_hash.hex()} serving {self.engine.model_id} "
                "(model, page size, KV dtype or layout differ; the prefill logs its model at start-up)",
            )
        prefill_tp = max(1, int(prefill.info.tp_size))
        try:
            check_tp_sizes(prefill_tp, self.tp_size)
        except PdgrpcError as exc:
            raise ending(Refusal.INCOMPATIBLE, f"prefill {prefill_address}: {exc}") from None
        try:
            rank = resolve_locally(room, routed_dp_rank, prefill.dp)
        except PdgrpcError as exc:
            raise ending(Refusal.BAD_REQUEST, f"routed_dp_rank: {exc}") from None
        now = time.monotonic()
        job = Job(
            room, request_id, input_ids, sampling, max_new_tokens, prefill, n_pages, asyncio.Queue(), now, dp_rank=rank,
            room_secret=room_secret,
        )
        if self.reuse is not None:
            # Locked until the request ends; at least one page stays its own (the queues
            # allocate one or more). A prefill older than delta transfer writes every page,
            # so it is told of none; the request's pages still join the cache at its end.
            job.lease = self.reuse.hold(input_ids, n_pages - 1 if version >= DELTA_PROTOCOL_VERSION else 0)
        if self._replicated is not None:  # the other ranks grant the same pages: those the prefill writes
            self._replicated.note(ROOM_INFO, room, self.engine.pages_needed(len(input_ids)) - job.cached_pages, prefill_tp)
        self.queues.add(NewRequest(room, prefill_address, n_pages - job.cached_pages, rank, not self.transport.moves_bytes, prefill.dp), now)
        self.transfers.track(room, prefill_tp)
        self._jobs[room] = job
        how = "routed" if routed_dp_rank is not None else ("local rule" if rank is not None else "query bootstrap")
        request_event(
            log, room, "admitted", request_id=request_id, prompt_tokens=len(input_ids), max_new_tokens=max_new_tokens,
            prefill=prefill_address, dp_rank=rank if rank is not None else "?", dp_rank_from=how, pages=n_pages,
            cached_pages=job.cached_pages,
        )
        self._wake.set()
        return job

    def _admissible(self, room: Room, input_ids: tuple[int, ...], max_new_tokens: int) -> int:
        """The pages a new request needs, or RequestFailed when it cannot be admitted."""
        if self._closing:
            raise ending(Refusal.SHUTTING_DOWN, "decode server is shutting down")
        if room in self._jobs or room in self._reserved or self.queues.slot_of(room) is not None:
            raise ending(Refusal.ROOM_IN_USE, f"bootstrap_room {room} is already in use on this decode")
        n_pages = self.pages_for(input_ids, max_new_tokens)
        if n_pages > self.engine.num_pages:
            raise ending(
                Refusal.BAD_REQUEST,
                f"max_new_tokens: prompt ({len(input_ids)}) + max_new_tokens ({max_new_tokens}) needs {n_pages} KV pages, "
                f"the decode pool has {self.engine.num_pages}",
            )
        return n_pages

    def pages_for(self, input_ids: tuple[int, ...], max_new_tokens: int) -> int:
        """The KV pages a request holds from its admission: every page it can ever need."""
        return max(self.engine.pages_needed(len(input_ids)), self.engine.pages_needed(len(input_ids) + max_new_tokens - 1))

    def submit_local(
        self, room: Room, request_id: str, input_ids: tuple[int, ...], sampling: SamplingParams, max_new_tokens: int
    ) -> Job:
        """Admit a local prefill (:mod:`pdgrpc.decode.local`): this decode computes the
        prompt from the end of its cached prefix (with TP, every rank: its pages come from
        a replayed queue call, its chunks are broadcast). Raises RequestFailed."""
        n_pages = self._admissible(room, input_ids, max_new_tokens)
        now = time.monotonic()
        job = Job(room, request_id, input_ids, sampling, max_new_tokens, NO_PREFILL, n_pages, asyncio.Queue(), now)
        job.fate.handle(ComputeHere())
        if self.reuse is not None:
            # The last prompt token is always computed: its logits give the first token.
            most = min(n_pages - 1, (len(input_ids) - 1) // self.engine.kv_layout.page_size)
            job.lease = self.reuse.hold(input_ids, most)
            job.pages = job.lease.pages
        self.local.add(job, n_pages - job.cached_pages, now)
        self._jobs[room] = job
        request_event(
            log, room, "admitted", request_id=request_id, prompt_tokens=len(input_ids), max_new_tokens=max_new_tokens,
            prefill="local", pages=n_pages, cached_pages=job.cached_pages,
        )
        self._wake.set()
        return job

    async def _prefill_info(self, address: str) -> PrefillInfo:
        try:
            return await self.directory.parallel_info(address, wait_for=self.config.deadlines.resolve_dp_rank_s)
        except RpcError as exc:
            # One answer whatever the cause: a caller naming addresses learns nothing about
            # what listens there (closed, another protocol, another service); the log says.
            log.warning("prefill_bootstrap_address %s: GetParallelInfo failed: %s %s", address, exc.code.name, exc.details)
            raise ending(
                Refusal.PREFILL_GONE,
                f"prefill_bootstrap_address {address}: no prefill bootstrap with registered workers answered there "
                "(the decode's log has the cause)",
            ) from None

    def cancel(self, room: int, message: str) -> None:
        """Abort ``room`` (the client went away). Takes effect at once before the
        handshake, at the next poll during the transfer, before the next step when running."""
        job = self._jobs.get(room)
        if job is not None:
            self._cancel(job, Cancel(), message)

    def _cancel(self, job: Job, event: Cancel, message: str) -> None:
        if job.fate.ended:
            return
        job.fate.handle(event)
        request_event(log, job.room, "cancel requested", why=message)
        if job.fate.in_queues:
            aborted = self.queues.cancel(job.room, time.monotonic(), message)
            if aborted is not None:
                self._on_aborted(aborted)
        self._wake.set()

    def end_stream(self, room: int, failure: RequestFailed) -> bool:
        """End ``room``'s Decode stream with ``failure``'s status after the tokens already
        queued (the stream's end then cancels the request, as a client that went away
        does). False when no unfinished request has that room."""
        job = self._jobs.get(room)
        if job is None or job.fate.ended:
            return False
        job.out.put_nowait(failure)
        return True

    # -- stats ------------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        return self.transfers.stats(len(self._jobs), self.reuse.evictable if self.reuse is not None else 0)

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
            # asyncio.timeout, not wait_for: wait_for wraps the wait in a task of its own,
            # which costs two more loop passes between a KV landing and its first token.
            try:
                async with asyncio.timeout(self._idle_timeout(time.monotonic())):
                    await self._wake.wait()
            except TimeoutError:
                pass

    def _idle_timeout(self, now: float) -> float | None:
        """How long the loop may sleep with nothing to compute (None: until woken). Every
        event a request waits for wakes it -- a new request, a cancel, a handshake's
        answer, a transfer that ends, a dp rank resolved -- so it sleeps until the
        earliest deadline of a request in the queues; on a small host every wake-up takes
        CPU from the compute. What has no event of its own (dp-rank queries, quarantined
        rooms, requests and local prefills waiting for pages or a slot, and with TP every
        transfer) polls every ``idle_poll_s``."""
        q = self.queues
        if self.tp is not None:
            # The other ranks' transfers wake nothing here (only the collective poll sees
            # them), and their collectives time out unless rank 0 syncs them now and then.
            return self.config.idle_poll_s if (q.num_requests or q.num_quarantined or self.local.pending) else TP_IDLE_SYNC_S
        if q.num_quarantined or self.local.pending:
            return self.config.idle_poll_s
        first: float | None = None
        for room in self._jobs:
            # Memory comes back without an event of its own: a quarantine ends inside the
            # poll, after this iteration's prealloc, and a cached prefix unlocks.
            if q.state_of(room) in (DecodeState.RESOLVING_DP_RANK, DecodeState.WAITING_FOR_MEMORY):
                return self.config.idle_poll_s
            deadline = q.deadline_of(room)
            if deadline is not None and (first is None or deadline < first):
                first = deadline
        if first is None:
            return None
        # A transfer's progress short of its end wakes nothing, so a poll idle_poll_s before
        # the deadline first moves the request to its transfer's state (whose own deadline
        # then counts); the next wakes just past the deadline, when the request is overdue.
        left = first - now
        return left - self.config.idle_poll_s if left > self.config.idle_poll_s else max(0.0, left) + DEADLINE_SLACK_S

    async def _iteration(self) -> bool:
        """One pass over the machines; True when it computed (more work is likely)."""
        q = self.queues
        now = time.monotonic()
        self.generation.drop_cancelled()
        for aborted in q.tick(now):
            self._on_aborted(aborted)
        for query in q.poll_dp_ranks(now):
            self.spawn(self.calls.query_dp_ranks(query), f"query-dp-ranks {query.prefill_address}")
        if self.reuse is not None:  # cached pages no request holds make room for those waiting
            waiting = sum(j.num_pages - j.cached_pages for j in self._jobs.values() if j.slot is None and j.fate.in_queues)
            self.reuse.reclaim(waiting + self.local.pages_wanted)
        for job, failure in self.local.allocate(now):
            self._unlock(job)
            self.generation.fail(job, failure)
        self._poll(now, q.prealloc(now))
        if self.generation.busy:
            await self.generation.compute()
            return True
        return False

    def _poll(self, now: float, handshakes: list[SendHandshake]) -> None:
        """The one place the decode polls its transfers: each loop iteration (with the
        handshakes prealloc just made) and, on one rank, whenever a transport room ends.
        The grants of new handshakes are advertised before the poll; with TP > 1 their
        handshakes go out after it, once every rank has replayed prealloc and advertised
        its own grants, so a prefill rank that writes at once finds them."""
        self.transfers.check_writers()
        if self.tp is None:
            for hs in handshakes:
                self.calls.start_handshake(hs, now)
            outcomes = self.queues.poll_transfers(now, local_poll=self._local_poll)
        else:
            advertised = [(hs, self.calls.advertise(hs, now)) for hs in handshakes]
            outcomes = self._tp_poll(now)
            for hs, prompt_pages in advertised:
                if prompt_pages is not None:
                    self.calls.send_handshake(hs, prompt_pages)
        self._act_on(outcomes, now)

    def _tp_poll(self, now: float) -> list[Outcome]:
        """Broadcast the queue calls since the last poll, then poll collectively: every
        rank gates on its own rows before the MIN all-reduce (pdgrpc.state.transfer_poll).
        Blocks the loop for the two collectives (well under a millisecond when the other
        ranks wait for it, which they do): nothing may touch the queues in between."""
        assert self.tp is not None and self._replicated is not None
        t = self.queues.prepare_poll(now, self._local_poll)
        if self.reuse is not None and self.reuse.evictable != self._evictable_noted:
            self._evictable_noted = self.reuse.evictable
            self._replicated.note(EVICTABLE, self._evictable_noted)
        synced, self._synced = self._synced, []
        try:
            self.tp.broadcast(("sync", (self._replicated.take_log(), now)))
            reduced = self.tp.all_reduce_min(t)  # every rank applied the log before it joins
        except TpGroupBroken as exc:
            self.rank_lost(str(exc))
            return []
        finally:
            for fut in synced:
                if not fut.done():
                    fut.set_result(None)
        return list(self.queues.finish_poll(reduced, now))

    async def bind_writer(self, room: int, rank: int, prefill_tp_rank: int, writer: str) -> None:
        """Admit the prefill worker ``writer`` into ``room`` on decode rank ``rank``, before
        its handshake goes out: on this rank at once, on another through the next TP sync
        (returns once every rank applied it)."""
        if rank == 0:
            self.transfers.bind_writer(room, prefill_tp_rank, writer)
            return
        assert self._replicated is not None
        self._replicated.note(ROOM_BIND, room, rank, prefill_tp_rank, writer)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._synced.append(done)
        self._wake.set()
        await done

    def rank_lost(self, why: str) -> None:
        """Another TP rank is gone (its collective failed, or its process exited): this
        instance cannot go on. Sets :attr:`fatal`; no-op once closing."""
        if self._closing or self.fatal is None or self.fatal.done():
            return
        log.error("%s; this decode instance cannot continue", why)
        self.fatal.set_result(why)
        self._closing = True
        self._wake.set()

    def _local_poll(self, room: int) -> tuple[KVPoll, AbortReason]:
        """This rank's view of ``room`` for the transfer poll (and why, when FAILED).
        The request's fate decides what it votes (:meth:`DecodeFate.vote`)."""
        state, text, why = self.transfers.status(room)
        job = self._jobs.get(room)
        if job is None:
            return state, why
        if state is KVPoll.FAILED:
            job.fate.handle(TransportFailed(text))
        return job.fate.vote(state), why

    # -- transport reports --------------------------------------------------------------------
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
        # One rank (no collective to keep in step) polls right away, so a landed room
        # commits and its first token goes out without waiting for a whole iteration. Safe
        # while an iteration awaits its compute step: the poll touches only slots in
        # transfer or quarantine, and a job committed here runs from the next step. TP: the
        # collective poll runs in the loop, on every rank together.
        if self.tp is None:
            self._poll(time.monotonic(), [])
        self._wake.set()

    def _act_on(self, outcomes: list[Outcome], now: float) -> None:
        for outcome in outcomes:
            if isinstance(outcome, Committed):
                self._on_committed(outcome, now)
            else:
                self._on_aborted(outcome)

    # -- outcomes ------------------------------------------------------------------------------
    def _on_committed(self, c: Committed, now: float) -> None:
        job = self._jobs[c.room]
        started = self.transfers.transfer_started(c.room)
        self._release_transport(c.room)
        transfer_s = now - job.handshake_sent_at
        if job.trace is not None:  # from the first KV byte
            job.trace.hop("decode.commit", None if started is None else tracing.ns_of(started))
        # The data plane's share: the first KV byte's arrival to the commit.
        data_plane_s = 0.0 if started is None else max(0.0, now - started)
        if c.row is None:  # fake transport: nothing was written; compute the prompt's KV here
            self.metrics.on_transfer(0, transfer_s)
            request_event(log, c.room, "committed (fake transfer: prefilling locally)", transfer_s=f"{transfer_s:.4f}")
            job.fate.handle(Commit())
            self.generation.prefill_here(job)
            self.calls.stop_watch(job)
            return
        row = c.row
        # The row holds top_k (20) entries; the request asked for sampling.top_logprobs of them.
        k = job.sampling.top_logprobs
        first = SampledToken(row.output_id, row.output_token_logprob_value, tuple(row.top_logprobs_indices[:k]), tuple(row.top_logprobs_values[:k]))
        # Every rank received the same share: the request's KV is tp_size times this rank's.
        # The pages the decode held already were not sent.
        sent_pages = self.engine.pages_needed(len(job.input_ids)) - job.cached_pages
        nbytes = sent_pages * self.page_bytes * self.tp_size + self.buffers.layout.row_bytes
        self.metrics.on_transfer(nbytes, transfer_s)
        if job.cached_pages:
            self.metrics.on_reused(job.cached_pages * self.engine.kv_layout.page_size)
        job.fate.handle(Commit())
        self.generation.start(job, first, nbytes, transfer_s, data_plane_s, row.cached_tokens)
        # Once the first token is queued: the cancelled watch's gRPC call tears down on
        # the loop's next turn, after the stream's wake-up.
        self.calls.stop_watch(job)
        self.calls.landed(transfer_s)
        # After the stream's wake-up: the first token goes out before this line is written.
        request_event(
            log, c.room, "committed", slot=c.slot, first_token=row.output_id, bytes=nbytes,
            transfer_s=f"{transfer_s:.4f}", data_plane_s=f"{data_plane_s:.5f}", defer=True,
        )

    def _on_aborted(self, a: Aborted) -> None:
        job = self._jobs.get(a.room)
        if job is None:
            self._release_transport(a.room, a.message)
            return
        status = abort_status(job.fate, a)
        self._release_transport(a.room, status.message)
        request_event(
            log, a.room, "aborted", level=logging.WARNING, state=a.state, reason=a.reason.name,
            status=status.code.name, message=status.message, quarantined=a.awaiting_ack,
        )
        self.generation.fail(job, status)
        self._unlock(job)  # no prefill writes into a cached page: the grant never held them
        if a.awaiting_ack:
            self.spawn(self.calls.abort_room(job, status.message), f"abort-room {a.room}")

    def _release_transport(self, room: int, abort_message: str | None = None) -> None:
        self.transfers.release(room, abort_message)
