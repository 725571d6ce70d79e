"""One prefill DP worker: the engine, its compute, a transport sender, and its rooms.

One request (one ``Prefill`` RPC)::

    validate prompt  -> INVALID_ARGUMENT naming the problem
    allocate pages   (waits, bounded, while the pool is short); with the prefix cache,
                     first waits (bounded) for a running request that computes more of
                     the prompt than is cached, then locks the prompt's longest cached
                     prefix and allocates the rest; the compute starts where it ends
    drive the room   (pdgrpc.prefill.room over the room's PrefillSender: compute starts,
                      handshake -> destination, chunks -> page writes, last chunk ->
                      the final write with the metadata row, the decode's ack; every
                      phase bounded by the sender's deadline)
    finally:         stop the room's compute, drain and release its transfers, free the pages
                     (with the prefix cache: a fully computed prompt's full pages become
                     reusable, whatever became of its transfer; the locks are dropped)

Compute (pdgrpc.prefill.compute) runs off the event loop -- a thread, a child process or
a TP group -- so the loop keeps driving the transport and answering handshakes while a
chunk computes. Pages are never freed while the compute may still write into them,
whatever ended the request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import time
from typing import Callable

from pdgrpc.engine.base import Engine, SamplingParams
from pdgrpc.prefill.statuses import Refusal, ending, status
from pdgrpc.state.cache_events import CacheEvents
from pdgrpc.state.prefix_cache import Lease, PrefixCache
from pdgrpc.state.prefix_leaders import PrefixLeaders, leader_wait_s
from pdgrpc.errors import EngineError, PdgrpcError
from pdgrpc.kvpoll import KVPoll
from pdgrpc.metrics import PrefillMetrics, ServerAbortReason
from pdgrpc.prefill.compute import Compute
from pdgrpc.prefill.compute_process import ComputeProcess, ProcessCompute
from pdgrpc.prefill.compute_thread import SHUTDOWN, ThreadCompute
from pdgrpc.prefill.compute_tp import TpFollowerCompute, TpLeaderCompute
from pdgrpc.prefill.errors import RequestFailed
from pdgrpc.prefill.handshake import Destination, LocalEnd, Signed, check_handshake
from pdgrpc.prefill.mailbox import DuplicateHandshake, GroupMismatch, Mailbox, MailboxFull
from pdgrpc.prefill.room import RoomDriver, Sending
from pdgrpc.prefill.worker_config import WorkerConfig
from pdgrpc.rpc.limits import MAX_ABORT_REASON_CHARS
from pdgrpc.serving.convert import sampling_from_proto
from pdgrpc.serving.logs import request_event
from pdgrpc.serving.metadata import compat_hash_bytes, metadata_layout
from pdgrpc.serving.room_proof import abort_message, handshake_message, verify
from pdgrpc.serving.tp import heads_of
from pdgrpc.state.metadata import MetadataBuffers
from pdgrpc.state.outcomes import AbortReason
from pdgrpc.state.prefill_room import Abort, Close, Failed, PrefillRoom
from pdgrpc.state.prefill_sender import write_pages_for
from pdgrpc.state.room import Room
from pdgrpc.transport.base import Transport
from pdgrpc.transport.pages import kv_regions, metadata_region
from pdgrpc.v1 import common_pb2, handshake_pb2, prefill_pb2

log = logging.getLogger("pdgrpc.prefill.worker")

__all__ = ["Destination", "PrefillWorker", "WorkerConfig"]



@dataclasses.dataclass(eq=False)
class _Active:
    room: Room
    task: asyncio.Task  # type: ignore[type-arg]
    pages: list[int] = dataclasses.field(default_factory=list)
    lease: Lease | None = None  # the pages, when the prefix cache handed them out
    driver: RoomDriver | None = None
    secret: bytes = b""  # PrefillRequest.room_secret: Handshake/AbortRoom must prove it
    finished: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    # How it ends: aborted or not, and its failure. Drivers feed it events.
    fate: PrefillRoom[RequestFailed] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.fate = PrefillRoom(self.room)

    def stop(self, abort: Abort) -> None:
        """Abort the room; its driver is cancelled while it still runs."""
        self.fate.handle(abort)
        if self.fate.stoppable:
            self.task.cancel()


class _Oversize(RequestFailed):
    """A prompt needing more pages than the whole pool: refused, not aborted."""


class PrefillWorker:
    """Serves one (dp rank, tp rank). ``await start()`` registers the KV pool and the send
    rows with the transport; ``descriptor`` is then what bootstrap advertises.

    The compute: ``compute`` (a started :class:`ComputeProcess`) when given, else a thread
    of this process; with ``config.tp_size > 1`` a TP group member over the dp group's
    ``torch.distributed`` world (``engine`` holds this rank's KV heads).

    The prefix cache (``config.prefix_cache``) takes its pages from ``engine`` and reports
    what it stores and evicts to ``cache_events``. In a TP group every rank keeps its own,
    and the group agrees on each room's cached prefix before computing it
    (:meth:`~pdgrpc.prefill.compute.Compute.agree`); tp rank 0 alone admits rooms, the
    others take a room's pages once it started it
    (:meth:`~pdgrpc.prefill.compute.Compute.started`). Without TP a prompt first waits for
    the running request that computes more of it than is cached
    (:class:`~pdgrpc.state.prefix_leaders.PrefixLeaders`), so a prefix is computed once,
    and a prompt's pages are published as its compute starts
    (:meth:`~pdgrpc.state.prefix_cache.PrefixCache.announce`), so routers send the prompts
    sharing them here. A TP group does neither: its ranks would have to agree on each
    wait too."""

    def __init__(
        self, engine: Engine, transport: Transport, config: WorkerConfig = WorkerConfig(), metrics: PrefillMetrics | None = None,
        compute: "ComputeProcess | None" = None, cache_events: CacheEvents | None = None,
    ) -> None:
        self.engine = engine
        # Each request this worker ran is counted here once, in prefill(); the controller
        # counts only the requests that never reached a worker.
        self.metrics = metrics or PrefillMetrics(transport=transport.name)
        self.transport = transport
        self.config = config
        self.compat_hash = compat_hash_bytes(engine)
        layout = engine.kv_layout
        self.page_size = layout.page_size
        self.heads = (layout.head_start, layout.head_end)
        self.tp_rank, self.tp_size = config.tp_rank, config.tp_size
        if self.tp_size > 1 and heads_of(self.tp_rank, self.tp_size, layout.num_kv_heads) != self.heads:
            raise ValueError(f"engine holds KV heads {self.heads}, tp rank {self.tp_rank} of {self.tp_size} should hold "
                             f"{heads_of(self.tp_rank, self.tp_size, layout.num_kv_heads)}")
        self.send_rows = MetadataBuffers(engine.num_pages, metadata_layout())
        bufs = engine.kv_buffers()
        self._regions = [*kv_regions(bufs.k, bufs.v), metadata_region(self.send_rows.tensor)]
        page_nbytes = sum(t[0].numel() * t.element_size() for t in (*bufs.k, *bufs.v))  # one page, every layer
        min_pages = write_pages_for(config.min_write_bytes, page_nbytes)
        self.compute = self._make_compute(compute, min_pages)
        self.prefix_cache = PrefixCache(engine, self.page_size, cache_events) if config.prefix_cache else None
        self._leaders: PrefixLeaders[int] | None = (
            PrefixLeaders(self.page_size) if self.prefix_cache is not None and self.tp_size == 1 else None
        )
        self.local = LocalEnd(transport.name, self.compat_hash, self.tp_rank, self.tp_size, layout.num_kv_heads,
                              layout.head_bytes, self._regions, self._regions[-1].item_bytes,
                              engine.pages_needed(engine.max_prompt_tokens), engine.model_id)
        self.descriptor = b""
        self.generation = 0  # set from bootstrap's RegisterWorker answer
        self._mailbox: Mailbox[Signed] = Mailbox(
            config.early_handshakes, config.early_handshake_ttl_s, per_peer=config.early_handshakes_per_peer,
            capacity_bytes=config.early_handshake_bytes, per_peer_bytes=config.early_handshake_bytes_per_peer,
        )
        self._sending = Sending(
            transport, self.compute, self._mailbox, self.send_rows, self._regions, self.page_size, min_pages, self.heads,
            layout.num_kv_heads, layout.head_bytes, self.tp_rank, self.tp_size, config.deadlines, config.chunk_size,
        )
        self._active: dict[int, _Active] = {}
        self._pages_freed = asyncio.Event()
        self.completed = 0  # requests finished successfully (count)
        self.failed = 0

    def _make_compute(self, cproc: "ComputeProcess | None", min_pages: int) -> Compute:
        cfg = self.config
        name = f"prefill{cfg.dp_rank}.{cfg.tp_rank}-compute"
        if cproc is not None:
            return ProcessCompute(cproc, cfg.chunk_size, min_pages, self.page_size)
        if self.tp_size == 1:
            return ThreadCompute(self.engine, name, cfg.compute_nice, cfg.chunk_size, min_pages)
        if self.leader:
            return TpLeaderCompute(self.engine, name, cfg.compute_nice, cfg.chunk_size, min_pages, self.tp_rank)
        return TpFollowerCompute(self.engine, name, cfg.compute_nice, self.tp_rank, cfg.tp_room_wait_s, cfg.lost_rooms)

    @property
    def broken_reason(self) -> str:
        """Why :attr:`broken` is set (the TP group or the compute process failed)."""
        return self.compute.broken or "the TP group is broken"

    @property
    def leader(self) -> bool:
        return self.tp_rank == 0

    @property
    def capacity(self) -> int:
        """KV pages requests may use (the pool less the compute's reserved pages)."""
        return self.engine.num_pages - len(self.compute.reserved_pages)

    async def start(self) -> bytes:
        loop = asyncio.get_running_loop()
        # Set (on the loop) when the compute broke: worker_main then exits non-zero so the
        # controller sees the dp rank is gone, instead of a worker that only refuses work.
        self.broken = asyncio.Event()

        def on_broken(why: str) -> None:  # on any thread
            loop.call_soon_threadsafe(self.broken.set)

        self.compute.on_broken = on_broken
        self.descriptor = await self.transport.register(self._regions)
        await self.compute.start()
        return self.descriptor

    async def close(self) -> None:
        for entry in list(self._active.values()):
            entry.stop(Abort(SHUTDOWN, shutdown=True))
        for entry in list(self._active.values()):
            try:
                await asyncio.wait_for(entry.finished.wait(), self.config.abort_wait_s)
            except asyncio.TimeoutError:
                log.error("room=%d driver did not stop within %.0f s at shutdown", entry.room, self.config.abort_wait_s)
        await self.compute.close()
        await self.transport.close()

    # ---- stats -----------------------------------------------------------------------

    @property
    def queue_length(self) -> int:
        return len(self._active)

    def stats(self) -> common_pb2.ResourceStats:
        """Read from the live allocator and transport, not from counters of our own."""
        reserved = len(self.compute.reserved_pages)
        return common_pb2.ResourceStats(
            active_requests=len(self._active),
            pages_in_use=self.engine.num_pages - self._num_free - reserved,
            pages_total=self.engine.num_pages - reserved,
            transport_rooms=len(self.transport.rooms),
        )

    def live_stats(self) -> dict[str, int]:
        """:meth:`stats` and the prefix cache's pages and evictions, for the live metrics."""
        stats = self.stats()
        out = {f.name: getattr(stats, f.name) for f in stats.DESCRIPTOR.fields}
        if self.prefix_cache is not None:
            out.update(prefix_cache_pages=self.prefix_cache.num_cached_pages, prefix_cache_evictions=self.prefix_cache.evictions)
        return out

    @property
    def _num_free(self) -> int:
        """Pages an allocation may take (evictable cached pages included)."""
        return self.prefix_cache.num_free_pages if self.prefix_cache is not None else self.engine.num_free_pages

    # ---- handshake --------------------------------------------------------------------

    def handshake(self, req: handshake_pb2.HandshakeRequest, peer: str = "") -> handshake_pb2.HandshakeResponse:
        """Validate and deliver a handshake (``peer``: the caller, for the mailbox's
        per-peer cap). A refused handshake fails this RPC, and the room's Prefill RPC when
        one already claims the room; it is never stored, so it cannot take the room's
        handshake from the real decode nor fill the mailbox."""
        room = req.bootstrap_room
        message, proof = handshake_message(req), bytes(req.room_proof)
        entry = self._active.get(room)
        if entry is not None and entry.secret and not verify(entry.secret, message, proof):
            # Refused before it touches the room: the real decode's handshake still gets in.
            request_event(log, room, "handshake refused", level=logging.WARNING, reason="room_proof does not verify")
            raise ending(
                Refusal.NOT_PROVEN,
                f"room {room}: room_proof does not verify under the room's secret (not the decode the router chose)",
            )
        try:
            dest = check_handshake(req, self.local)
        except RequestFailed as exc:
            request_event(log, room, "handshake refused", reason=exc.message)
            self._mailbox.refuse(room, Signed(exc, message, proof))
            raise
        tp_d = req.decode_tp_size or 1
        # Before its Prefill RPC a room's secret is unknown: a signed handshake is kept
        # unchecked (its key includes the proof and what it signs, and it fixes no
        # decode_tp_size), so a forged one -- also a copy of the real one with a field
        # swapped -- can neither collide with the real one nor refuse it; the Prefill RPC
        # sifts them.
        checked = entry is not None or not proof
        try:
            handed = self._mailbox.deliver(
                # The key holds the message's digest: a sifted forgery's key outlives it.
                room, Signed(dest, message, proof), key=(req.decode_tp_rank, proof, hashlib.sha256(message).digest()),
                group=tp_d if checked else None,
                peer=peer, nbytes=len(message) + len(dest.descriptor) + len(proof),
            )
        except DuplicateHandshake as exc:
            raise ending(Refusal.ROOM_IN_USE, f"{exc} (decode_tp_rank {req.decode_tp_rank})") from None
        except GroupMismatch as exc:
            raise ending(
                Refusal.INCOMPATIBLE,
                f"room {room}: decode_tp_size={tp_d} (decode_tp_rank {req.decode_tp_rank}), but an earlier handshake "
                f"for this room said decode_tp_size={exc.first}",
            ) from None
        except MailboxFull as exc:
            raise ending(Refusal.OVERLOADED, str(exc)) from None
        request_event(
            log, room, "handshake", pages=len(dest.dst_pages), slot=dest.dst_slot, prefill_waiting=handed,
            decode_tp=f"{dest.decode_tp_rank}/{dest.decode_tp_size}",
        )
        return handshake_pb2.HandshakeResponse(generation=self.generation)

    async def handshake_claimed(self, req: handshake_pb2.HandshakeRequest, peer: str = "") -> handshake_pb2.HandshakeResponse:
        """:meth:`handshake`, answered once a Prefill RPC claims the room or
        ``req.claim_wait_ms`` passed (at most the early-handshake TTL), saying which."""
        resp = self.handshake(req, peer)
        if req.claim_wait_ms:
            wait_s = min(req.claim_wait_ms / 1000, self.config.early_handshake_ttl_s)
            claimed = await self._mailbox.claimed(req.bootstrap_room, wait_s)
            resp.claim = handshake_pb2.ROOM_CLAIM_CLAIMED if claimed else handshake_pb2.ROOM_CLAIM_UNCLAIMED
            if not claimed:
                request_event(log, req.bootstrap_room, "handshake unclaimed", waited_s=f"{wait_s:g}")
        return resp

    async def abort_room(self, room: int, reason: str, proof: bytes = b"", peer: str = "") -> bool:
        """Stop the room; return once nothing of ours for it can still be written. A room
        whose Prefill carries a secret is stopped only with a ``proof`` of it. ``peer``:
        the caller, for the mailbox's per-peer cap on the tombstone."""
        if len(reason) > MAX_ABORT_REASON_CHARS:  # logged, and kept in the room's tombstone
            raise ending(
                Refusal.BAD_REQUEST, f"AbortRoom: reason: {len(reason)} characters, over the limit of {MAX_ABORT_REASON_CHARS}"
            )
        entry = self._active.get(room)
        if entry is not None and entry.secret and not verify(entry.secret, abort_message(room), proof):
            request_event(log, room, "abort refused", level=logging.WARNING, reason="room_proof does not verify")
            raise ending(
                Refusal.NOT_PROVEN, f"room {room}: room_proof does not verify under the room's secret (AbortRoom refused)"
            )
        was_active = False
        if entry is not None:
            was_active = True
            entry.stop(Abort(reason or "no reason given"))
            try:
                await asyncio.wait_for(entry.finished.wait(), self.config.abort_wait_s)
            except asyncio.TimeoutError:
                raise ending(Refusal.TIMED_OUT, f"room {room}: driver did not stop within {self.config.abort_wait_s} s") from None
        else:
            # The Prefill RPC has not arrived (or already ended): leave a bounded tombstone
            # so one that arrives later fails at once instead of waiting for a handshake.
            # Its proof cannot be checked yet: early handshakes stay, and the Prefill RPC
            # takes the tombstone first only if it is genuine.
            failure = ending(Refusal.ABORTED, f"room {room}: aborted by decode: {reason or 'no reason given'}")
            try:
                self._mailbox.deliver(
                    room, Signed(failure, abort_message(room), proof, abort=True), key=("abort", proof), peer=peer,
                    nbytes=len(failure.message) + len(proof),
                )
            except (DuplicateHandshake, MailboxFull, GroupMismatch):
                pass
        request_event(log, room, "abort", reason=reason, was_active=was_active)
        return was_active

    def watching(self, room: int) -> bool:
        """Whether ``room``'s Prefill runs here or a handshake waits for it (the
        deprecated ``WatchRoom``'s PENDING)."""
        return room in self._active or self._mailbox.holds(room)

    # ---- prefill -----------------------------------------------------------------------

    def _validate(self, req: prefill_pb2.PrefillRequest) -> tuple[tuple[int, ...], SamplingParams]:
        ids = tuple(req.input_ids)
        try:
            sampling = sampling_from_proto(req.sampling)
            self.engine.validate_request(ids, max(1, req.sampling.max_new_tokens), "input_ids")
        except EngineError as exc:
            raise ending(Refusal.BAD_REQUEST, f"room {req.bootstrap_room}: {exc}") from None
        return ids, sampling

    async def _alloc(self, entry: _Active, ids: tuple[int, ...]) -> None:
        """Pages for the prompt into ``entry`` (its cached prefix locked, with the cache);
        in a TP group, once tp rank 0 started the room."""
        n, room = self.engine.pages_needed(len(ids)), entry.room
        if n > self.capacity:
            raise _Oversize(status(Refusal.BAD_REQUEST), f"room {room}: prompt needs {n} pages, the pool has {self.capacity}")
        if self.tp_size > 1:
            await self._started(entry)
        start = time.monotonic()
        deadline = start + self.config.page_wait_s
        await self._after_leaders(entry, ids, start + leader_wait_s(self.config.page_wait_s))
        waited = False
        while True:
            if self.prefix_cache is not None:
                # TP: spare pages, so a rank holding more of the prefix than the group
                # agrees on computes the rest without waiting for pages.
                entry.lease = self.prefix_cache.acquire(ids, n, spare=self.tp_size > 1)
                if entry.lease is not None:
                    entry.pages = list(entry.lease.pages)
                    return
            else:
                pages = self.engine.alloc_pages(n)
                if pages is not None:
                    entry.pages = pages
                    return
            left = deadline - time.monotonic()
            if left <= 0:
                raise ending(
                    Refusal.OVERLOADED,
                    f"room {room}: {n} KV pages not free within {self.config.page_wait_s} s "
                    f"({self._num_free - len(self.compute.reserved_pages)} of {self.capacity} free)",
                    AbortReason.ALLOCATE_TIMEOUT,
                )
            if not waited:
                waited = True
                request_event(log, room, "waiting for pages", need=n, free=self._num_free - len(self.compute.reserved_pages))
            # No await between the failed alloc and clear(): a free cannot slip in between.
            self._pages_freed.clear()
            try:
                await asyncio.wait_for(self._pages_freed.wait(), left)
            except asyncio.TimeoutError:
                pass

    async def _after_leaders(self, entry: _Active, ids: tuple[int, ...], until: float) -> None:
        """Wait, until the monotonic time ``until`` at most, for the running requests that
        compute more of ``ids`` than the cache holds (each ends by inserting its pages or
        by failing), so that this prompt finds them cached."""
        if self._leaders is None or self.prefix_cache is None:
            return
        leader = self._leaders.leader(ids)  # no hashing of the prompt while none shares it
        while leader is not None:
            leader = self._leaders.leader(ids, self.prefix_cache.match(ids) * self.page_size)
            running = self._active.get(leader) if leader is not None else None
            left = until - time.monotonic()
            if running is None or left <= 0:
                return
            request_event(log, entry.room, "waiting for the leader", leader=running.room)
            try:
                await asyncio.wait_for(running.finished.wait(), left)
            except asyncio.TimeoutError:
                return

    async def prefill(
        self, req: prefill_pb2.PrefillRequest, first_token: Callable[[int], None] | None = None
    ) -> prefill_pb2.PrefillResponse:
        """Run ``req`` to the decode's acknowledgement; ``first_token``: called with the
        first output token once it is sampled, before its KV is written."""
        room = Room(req.bootstrap_room)  # its servicer (or the controller's) checked it
        try:
            ids, sampling = self._validate(req)
            if room in self._active:
                raise ending(Refusal.ROOM_IN_USE, f"room {room}: a Prefill for this room is already running")
        except RequestFailed as exc:
            self.metrics.on_refused()
            request_event(log, room, "rejected", code=exc.code.name, reason=exc.message)
            if exc.code != status(Refusal.ROOM_IN_USE):  # a duplicate must not fail the running room
                self._mailbox.discard(room)  # early handshakes for it will never be taken
            raise
        task = asyncio.current_task()
        assert task is not None
        entry = _Active(room, task, secret=bytes(req.room_secret))
        self._active[room] = entry
        # Handshakes and aborts that came before this RPC: keep only those proving the
        # secret (all of them when there is none), a genuine abort first.
        forged = self._mailbox.sift(room, lambda s: s.genuine(entry.secret), first=lambda s: s.abort)
        if forged:
            request_event(log, room, "dropped early messages whose room_proof does not verify", level=logging.WARNING, count=forged)
        self._mailbox.claim(room)  # with _active, no await between: a refused handshake reaches it
        # Deferred: written once _run has handed the first chunk to the compute thread.
        request_event(
            log, room, "admitted", request_id=req.request_id or "-", tokens=len(ids), dp_rank=self.config.dp_rank,
            defer=True, **({"tp_rank": self.tp_rank} if self.tp_size > 1 else {}),
        )
        try:
            resp = await self._run(entry, ids, sampling, first_token)
            self.completed += 1
            self.metrics.on_finished()
            self.metrics.on_transfer(resp.bytes_transferred, resp.transfer_seconds)
            request_event(
                log, room, "done", bytes=resp.bytes_transferred,
                compute_ms=f"{resp.compute_seconds * 1e3:.1f}", transfer_ms=f"{resp.transfer_seconds * 1e3:.1f}",
            )
            return resp
        except asyncio.CancelledError:
            self.failed += 1
            abort = entry.fate.abort
            if abort is None:
                self.metrics.on_abort(AbortReason.CANCELLED)
                request_event(log, room, "cancelled by the caller")
                entry.fate.handle(Failed(ending(Refusal.CANCELLED, f"room {room}: the prefill was cancelled by its caller")))
                raise
            # AbortRoom (decode gave up) or close() (shutdown) stopped it.
            self.metrics.on_abort(ServerAbortReason.SHUTDOWN if abort.shutdown else ServerAbortReason.DECODE_ERROR)
            task.uncancel()
            request_event(log, room, "aborted", reason=abort.reason)
            entry.fate.handle(Failed(ending(Refusal.ABORTED, f"room {room}: aborted: {abort.reason}")))
            raise ending(Refusal.ABORTED, f"room {room}: aborted by decode: {abort.reason}") from None
        except _Oversize as exc:
            # Larger than the whole pool: it took nothing and never could, so it is refused.
            self.failed += 1
            self.metrics.on_refused()
            request_event(log, room, "failed", code=exc.code.name, reason=exc.message)
            entry.fate.handle(Failed(RequestFailed(exc.code, exc.message)))
            raise
        except RequestFailed as exc:
            self.failed += 1
            self.metrics.on_abort(exc.reason)
            request_event(log, room, "failed", code=exc.code.name, reason=exc.message)
            entry.fate.handle(Failed(RequestFailed(exc.code, exc.message)))
            raise
        except Exception as exc:  # a bug or an engine failure: fail the request, keep serving
            self.failed += 1
            self.metrics.on_abort(ServerAbortReason.INTERNAL_ERROR)
            log.exception("room=%d failed unexpectedly", room)
            entry.fate.handle(Failed(ending(Refusal.INTERNAL, f"room {room}: prefill failed: {exc!r}")))
            raise ending(Refusal.INTERNAL, f"room {room}: prefill failed: {exc!r}") from None
        finally:
            await self._finish(entry)

    async def _run(
        self, entry: _Active, ids: tuple[int, ...], sampling: SamplingParams, first_token: Callable[[int], None] | None
    ) -> prefill_pb2.PrefillResponse:
        await self._alloc(entry, ids)
        if self.tp_size > 1:
            await self._agree(entry)
        cached = entry.lease.cached_tokens if entry.lease is not None else 0
        self.metrics.on_prompt(len(ids), cached)
        entry.driver = RoomDriver(self._sending, entry.room, entry.pages, cached)
        resp = await entry.driver.run(ids, sampling, lambda: self._computing(entry, ids), first_token)
        resp.dp_rank = self.config.dp_rank
        return resp

    def _computing(self, entry: _Active, ids: tuple[int, ...]) -> None:
        """``entry``'s compute has its prompt: from now on prompts sharing its pages wait
        for it here, and routers reading the cache's events send them here. Runs with no
        await since its pages were taken, so no prompt slips in between."""
        if self._leaders is not None and entry.lease is not None and self.prefix_cache is not None:
            self._leaders.running(entry.room, ids)
            self.prefix_cache.announce(entry.lease)

    async def _started(self, entry: _Active) -> None:
        """TP: wait for tp rank 0 to start the room (it waits for pages, then its turn)."""
        bound = self.config.page_wait_s + self.config.compute_timeout_s
        try:
            async with asyncio.timeout(bound):  # no task of its own, as wait_for would make
                await self.compute.started(entry.room)
        except TimeoutError:
            raise ending(
                Refusal.TIMED_OUT, f"room {entry.room}: tp rank 0 did not start the room within {bound} s",
                AbortReason.WAITING_FOR_INPUT_TIMEOUT,
            ) from None

    async def _agree(self, entry: _Active) -> None:
        """TP: keep only the cached pages every rank of the group holds."""
        cached = entry.lease.cached_pages if entry.lease is not None else 0
        try:
            keep = await asyncio.wait_for(self.compute.agree(entry.room, cached), self.config.compute_timeout_s)
        except asyncio.TimeoutError:
            raise ending(
                Refusal.TIMED_OUT, f"room {entry.room}: the TP group did not start the room within {self.config.compute_timeout_s} s",
                AbortReason.WAITING_FOR_INPUT_TIMEOUT,
            ) from None
        if entry.lease is not None and self.prefix_cache is not None:
            entry.lease = self.prefix_cache.settle(entry.lease, keep)
            entry.pages = list(entry.lease.pages)

    async def _finish(self, entry: _Active) -> None:
        """Every path ends here: no compute in flight, rooms released, pages freed."""
        entry.fate.handle(Close())
        driver = entry.driver
        await self.compute.finish(entry.room, driver.job if driver is not None else None)
        keys = {entry.room, *(driver.keys if driver is not None else ())}
        # A failed or aborted room: wait (bounded) until none of its queued bytes can still
        # land at the decode, so the ack that AbortRoom sends means what it says.
        for key in keys:
            if not self._succeeded(key):
                while True:
                    try:
                        if not await asyncio.shield(self.transport.drain(key, self.config.drain_timeout_s)):
                            log.warning("room=%d: sends to the decode still in flight after %.1f s", entry.room, self.config.drain_timeout_s)
                        break
                    except asyncio.CancelledError:
                        continue  # the drain is bounded; a second cancel must not skip it
                    except PdgrpcError:
                        break
        for key in keys:
            self.transport.release(key)
        self._mailbox.discard(entry.room)
        self._mailbox.done(entry.room)
        # Nothing below awaits: a second cancellation cannot leave the room half-finished.
        if self._leaders is not None:  # with the release below: its followers find its pages cached
            self._leaders.ended(entry.room)
        if entry.lease is not None and self.prefix_cache is not None:
            # The compute has stopped: a prompt computed to its end holds complete KV,
            # whatever became of its transfer; a partial one is never reused.
            self.prefix_cache.release(entry.lease, insert=driver is not None and driver.job is not None and driver.job.computed_all)
            entry.lease, entry.pages = None, []
            self._pages_freed.set()
        elif entry.pages:
            self.engine.free_pages(entry.pages)
            entry.pages = []
            self._pages_freed.set()  # wake requests waiting for pages
        self._active.pop(entry.room, None)
        entry.finished.set()

    def _succeeded(self, key: int) -> bool:
        try:
            return self.transport.status(key).state is KVPoll.SUCCESS
        except PdgrpcError:  # never written (unknown to the transport): nothing to drain
            return True
