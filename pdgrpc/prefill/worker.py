"""One prefill DP worker: the engine, a transport sender, and the per-request driver.

The driver is a thin asyncio layer over :class:`~pdgrpc.state.prefill_sender.PrefillSender`
(the pure machine decides which pages may be written after each chunk and when the
metadata row goes); this module only moves things: compute, transport writes, waits.

One request (one ``Prefill`` RPC)::

    validate prompt  -> INVALID_ARGUMENT naming the problem
    allocate pages   (waits, bounded, while the pool is short)
    wait handshake   -> DEADLINE_EXCEEDED (none in time) / FAILED_PRECONDITION (refused)
    connect(decode descriptor)
    for each chunk:  compute in the compute thread  |  the loop meanwhile sends the
                     pages the previous chunk completed, serves handshakes, ...
                     then queue the pages this chunk completed
    last chunk:      metadata row (first token, logprobs, bootstrap_room last)
    wait SUCCESS     -> ABORTED (transfer failed) / DEADLINE_EXCEEDED (no ack in time)
    finally:         wait for the compute thread, release the room, free the pages

Compute runs on one dedicated thread (the engine is not thread-safe; requests' chunks
interleave there first come, first served), so the event loop keeps driving the
transport and answering handshakes while a chunk computes. Pages are never freed while
the compute thread may still write into them, whatever ended the request.

The local send buffer for metadata rows has one row per KV page; a request uses the row
of its first page, which no other live request can hold (pages are exclusively owned),
so rows need no allocator of their own.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from typing import Any, Awaitable, Callable, Sequence

import grpc

from pdgrpc.engine.base import Engine, SampledToken, SamplingParams
from pdgrpc.engine.base import PrefillRequest as EnginePrefill
from pdgrpc.errors import EngineError, PdgrpcError
from pdgrpc.kvpoll import KVPoll
from pdgrpc.metrics import PrefillMetrics, ServerAbortReason
from pdgrpc.prefill.compute_process import ComputeProcess, ComputeProcessLost
from pdgrpc.prefill.errors import RequestFailed
from pdgrpc.prefill.mailbox import DuplicateHandshake, GroupMismatch, Mailbox, MailboxFull
from pdgrpc.serving import compat_hash_bytes, metadata_layout, request_event, row_from_token, sampling_from_proto
from pdgrpc.serving.threads import compute_executor, lower_thread_priority
from pdgrpc.serving.tp import METADATA_SINK_REGION_ID, check_tp_sizes, heads_of, receivers_of, senders_of, transfer_room
from pdgrpc.state.config import SenderDeadlines
from pdgrpc.state.outcomes import AbortReason
from pdgrpc.state.metadata import MetadataBuffers
from pdgrpc.state.prefill_sender import (
    ChunkDone,
    DestinationReceived,
    MetadataWritten,
    PagesWritten,
    PrefillSender,
    SenderState,
    WriteMetadata,
    WritePages,
)
from pdgrpc.transport.base import BadDescriptor, Descriptor, Peer, RegionKind, Transport, WriteOp, WriteOps
from pdgrpc.transport.pages import METADATA_REGION_ID, kv_regions, metadata_op, metadata_region, page_ops, region_pairs
from pdgrpc.v1 import common_pb2, handshake_pb2, prefill_pb2

log = logging.getLogger("pdgrpc.prefill.worker")

__all__ = ["Destination", "PrefillWorker", "WorkerConfig"]

C = grpc.StatusCode


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    dp_rank: int = 0
    tp_rank: int = 0
    tp_size: int = 1
    tp_room_wait_s: float = 5.0  # TP follower: a chunk command waiting for its room's Prefill RPC
    lost_rooms: int = 4096  # TP follower: rooms remembered as computed without us (count)
    chunk_size: int = 512  # prompt tokens per prefill chunk
    # Completed pages are held back until at least this many KV bytes are pending (or the
    # prompt is done): every write has a fixed cost (messages, peer wake-ups) that costs
    # more than the overlap with compute wins for small pieces.
    min_write_bytes: int = 1 << 20
    handshake_timeout_s: float = 30.0  # Prefill RPC waiting for the decode's handshake
    transfer_timeout_s: float = 60.0  # metadata row written -> decode's acknowledgement
    page_wait_s: float = 30.0  # waiting for free KV pages when the pool is short
    abort_wait_s: float = 60.0  # AbortRoom waiting for the room's driver to stop
    drain_timeout_s: float = 5.0  # a failed room's queued sends, before its pages are freed
    early_handshakes: int = 4096  # handshakes kept before their Prefill RPC (count)
    early_handshake_ttl_s: float = 60.0  # and for how long (seconds)
    compute_nice: int = 0  # added to the compute thread's nice value (pdgrpc.serving.threads)

    def __post_init__(self) -> None:
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if self.min_write_bytes < 0:
            raise ValueError(f"min_write_bytes must be >= 0, got {self.min_write_bytes}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must be in [0, tp_size={self.tp_size}), got {self.tp_rank}")


@dataclasses.dataclass(frozen=True)
class Destination:
    """A validated handshake: where one room's pages and metadata row go."""

    room: int
    dst_pages: tuple[int, ...]
    dst_slot: int
    descriptor: bytes
    parsed: Descriptor
    decode_tp_rank: int = 0
    decode_tp_size: int = 1
    wants_metadata: bool = True


@dataclasses.dataclass(eq=False)
class _Out:
    """One destination decode rank of a room: its transfer key, peer and op builder."""

    dest: Destination
    key: int  # transport room key (transfer_room(room, p, d))
    peer: Peer
    ops: Callable[[Sequence[int], Sequence[int]], WriteOps]
    meta_dst: Any  # RegionInfo of the row's destination region (metadata or sink)
    page_of: dict[int, int]  # local page -> this destination's page


@dataclasses.dataclass(eq=False)
class _Followed:
    """A TP follower's room as its compute thread sees it (guarded by the worker's lock)."""

    room: int
    pages: tuple[int, ...]
    loop: asyncio.AbstractEventLoop
    queue: "asyncio.Queue[tuple[int, SampledToken | None, float, BaseException | None]]"
    inflight: "concurrent.futures.Future[None] | None" = None
    total: int = 0  # prompt tokens
    computed: int = 0  # tokens computed so far (compute thread)


@dataclasses.dataclass(eq=False)
class _Active:
    room: int
    task: asyncio.Task  # type: ignore[type-arg]
    pages: list[int] = dataclasses.field(default_factory=list)
    compute: "asyncio.Future[object] | None" = None
    keys: list[int] = dataclasses.field(default_factory=list)  # transport keys used
    followed: _Followed | None = None  # TP follower only
    computed_all: bool = False  # TP leader: every chunk was issued and computed
    job: int = 0  # the compute process's job id (--compute-in process)
    abort_reason: str | None = None
    closing: bool = False
    finished: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)


_SHUTDOWN = "prefill worker shutting down"  # abort_reason set by close()


@dataclasses.dataclass(frozen=True)
class _FinalWrite:
    """A prompt's last write (pages ``src`` -> ``dst`` and the metadata row), planned
    ahead: one send per destination."""

    src: list[int]
    dst: list[int]
    sends: list[Callable[[], Awaitable[None]]]
    nbytes: int  # KV and metadata bytes the sends queue

    def covers(self, src: list[int], dst: list[int]) -> bool:
        return src == self.src and dst == self.dst


class _Oversize(RequestFailed):
    """A prompt needing more pages than the whole pool: refused, not aborted."""


def _transfer_failed(reason: str | None) -> "AbortReason | ServerAbortReason":
    # The transports name a write outside the decode's grant "rejected" in the room's
    # failure reason (the receiver NACKs it); anything else is a transfer failure.
    return ServerAbortReason.REJECTED_WRITE if reason and "reject" in reason.lower() else AbortReason.TRANSFER_FAILED


def _hex(b: bytes) -> str:
    return "0x" + b.hex() if b else "(empty)"


class PrefillWorker:
    """Serves one (dp rank, tp rank). ``await start()`` registers the KV pool and the send
    rows with the transport; ``descriptor`` is then what bootstrap advertises.

    Tensor parallelism (``config.tp_size > 1``): ``engine`` holds this rank's KV heads and
    its ``all_reduce`` runs over the dp group's ``torch.distributed`` world (rank =
    tp rank). Every rank must run the same ``prefill_chunk`` calls in the same order, so
    tp rank 0 (the *leader*) decides: before each chunk its compute thread broadcasts a
    command ``("chunk", room, ids, sampling, start, end)`` and then computes it. A
    *follower* (tp rank > 0) runs :meth:`_follow` on its own thread: receive a command,
    compute it into its pages of that room (or into reserved scratch pages when it does
    not hold the room: its Prefill RPC did not arrive within ``tp_room_wait_s``, or the
    room already ended here -- the room then fails on this rank), and notify the room's
    driver. ``("end", room)`` tells followers that the leader gave up a room,
    ``("stop",)`` ends their loop at shutdown. Collectives on a rank run only on its
    compute thread.
    """

    def __init__(
        self, engine: Engine, transport: Transport, config: WorkerConfig = WorkerConfig(), metrics: PrefillMetrics | None = None,
        compute: "ComputeProcess | None" = None,
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
        self.head_bytes = layout.head_bytes
        self.num_kv_heads = layout.num_kv_heads
        self.heads = (layout.head_start, layout.head_end)
        self.tp_rank, self.tp_size = config.tp_rank, config.tp_size
        if self.tp_size > 1 and heads_of(self.tp_rank, self.tp_size, self.num_kv_heads) != self.heads:
            raise ValueError(f"engine holds KV heads {self.heads}, tp rank {self.tp_rank} of {self.tp_size} should hold "
                             f"{heads_of(self.tp_rank, self.tp_size, self.num_kv_heads)}")
        self.send_rows = MetadataBuffers(engine.num_pages, metadata_layout())
        bufs = engine.kv_buffers()
        self._regions = [*kv_regions(bufs.k, bufs.v), metadata_region(self.send_rows.tensor)]
        self._meta_src = self._regions[-1]
        self._page_nbytes = sum(t[0].numel() * t.element_size() for t in (*bufs.k, *bufs.v))  # one page, every layer
        self.descriptor = b""
        self.generation = 0  # set from bootstrap's RegisterWorker answer
        self._mailbox: Mailbox[Destination | RequestFailed] = Mailbox(config.early_handshakes, config.early_handshake_ttl_s)
        self._active: dict[int, _Active] = {}
        self._pages_freed = asyncio.Event()
        # The compute runs in ``compute`` (a process of its own over the shared KV pool,
        # see pdgrpc.prefill.compute_process) when given, else on a thread of this process.
        self._cproc = compute
        self._executor = compute_executor(f"prefill{config.dp_rank}.{config.tp_rank}-compute", config.compute_nice)
        self.completed = 0  # requests finished successfully (count)
        self.failed = 0
        # TP: every rank reserves scratch pages for one whole prompt (a follower computes
        # rooms it does not hold there); the same capacity on every rank of the group.
        self._scratch: tuple[int, ...] = ()
        if self.tp_size > 1:
            scratch = engine.alloc_pages(engine.pages_needed(engine.max_prompt_tokens))
            if scratch is None:
                raise ValueError(f"the KV pool of {engine.num_pages} pages cannot hold the TP scratch pages for "
                                 f"{engine.max_prompt_tokens} tokens")
            self._scratch = tuple(scratch)
        self._lock = threading.Condition()
        self._followed: dict[int, _Followed] = {}  # follower: rooms its compute thread may write
        self._lost: collections.OrderedDict[int, str] = collections.OrderedDict()  # follower: rooms failed here
        self._follower: threading.Thread | None = None
        self._broken: str | None = None  # the TP group failed (a collective raised)
        self._stopped = False

    @property
    def broken_reason(self) -> str:
        """Why :attr:`broken` is set (the TP group or the compute process failed)."""
        return self._broken or "the TP group is broken"

    def _compute_lost(self, why: str) -> None:
        # A worker without its compute can only fail requests: exit (non-zero) instead,
        # so the controller sees the dp rank is gone.
        self._broken = why
        self.broken.set()

    @property
    def leader(self) -> bool:
        return self.tp_rank == 0

    @property
    def capacity(self) -> int:
        """KV pages requests may use (the pool less the TP scratch pages)."""
        return self.engine.num_pages - len(self._scratch)

    async def start(self) -> bytes:
        self._loop = asyncio.get_running_loop()
        # Set (on the loop) when the TP group broke: worker_main then exits non-zero so the
        # controller sees the dp rank is gone, instead of a worker that only refuses work.
        self.broken = asyncio.Event()
        self.descriptor = await self.transport.register(self._regions)
        if self._cproc is not None:
            self._cproc.on_lost = self._compute_lost
        else:
            self._executor.submit(lambda: None)  # the compute thread starts (and is reniced) now
        if self.tp_size > 1 and not self.leader:
            self._follower = threading.Thread(
                target=self._follow, name=f"prefill{self.config.dp_rank}.{self.tp_rank}-follow", daemon=True
            )
            self._follower.start()
        return self.descriptor

    async def close(self) -> None:
        for entry in list(self._active.values()):
            entry.abort_reason = _SHUTDOWN
            if not entry.closing:
                entry.task.cancel()
        for entry in list(self._active.values()):
            try:
                await asyncio.wait_for(entry.finished.wait(), self.config.abort_wait_s)
            except asyncio.TimeoutError:
                log.error("room=%d driver did not stop within %.0f s at shutdown", entry.room, self.config.abort_wait_s)
        if self.tp_size > 1 and self.leader and self._broken is None:
            fut = self._executor.submit(self._broadcast, ("stop",))
            try:
                await asyncio.wait_for(asyncio.wrap_future(fut), 10.0)
            except Exception as exc:
                log.error("tp%d: telling the followers to stop failed: %r", self.tp_rank, exc)
                self._stopped = True
                await self.transport.close()
                self._executor.shutdown(wait=False)  # the thread may be stuck in a collective
                return
        self._stopped = True
        if self._follower is not None:
            await asyncio.to_thread(self._follower.join, 15.0)
            if self._follower.is_alive():
                log.error("tp%d: the follower thread did not stop (no stop command from tp rank 0)", self.tp_rank)
        await self.transport.close()
        self._executor.shutdown(wait=True)
        if self._cproc is not None:
            await self._cproc.aclose()

    # ---- stats -----------------------------------------------------------------------

    @property
    def queue_length(self) -> int:
        return len(self._active)

    def stats(self) -> common_pb2.ResourceStats:
        """Read from the live allocator and transport, not from counters of our own."""
        scratch = len(self._scratch)
        return common_pb2.ResourceStats(
            active_requests=len(self._active),
            pages_in_use=self.engine.num_pages - self.engine.num_free_pages - scratch,
            pages_total=self.engine.num_pages - scratch,
            transport_rooms=len(self.transport.rooms),
        )

    # ---- handshake --------------------------------------------------------------------

    def _check_handshake(self, req: handshake_pb2.HandshakeRequest) -> Destination:
        room = req.bootstrap_room
        if room == 0:
            raise RequestFailed(C.INVALID_ARGUMENT, "bootstrap_room must not be 0")
        if req.transport != self.transport.name:
            raise RequestFailed(
                C.FAILED_PRECONDITION,
                f"room {room}: transport mismatch: decode uses {req.transport!r}, this prefill worker uses {self.transport.name!r}",
            )
        if req.compatibility_hash != self.compat_hash:
            raise RequestFailed(
                C.FAILED_PRECONDITION,
                f"room {room}: compatibility_hash mismatch: decode has {_hex(req.compatibility_hash)}, "
                f"prefill has {_hex(self.compat_hash)} (model, page size, KV dtype/layout or protocol differ)",
            )
        tp_d = req.decode_tp_size or 1  # 0: an old client, TP 1
        d = req.decode_tp_rank
        ours = f"this prefill worker is tp_rank {self.tp_rank} of tp_size {self.tp_size}"
        try:
            check_tp_sizes(self.tp_size, tp_d)
            if d >= tp_d:
                raise PdgrpcError("decode_tp_rank must be < decode_tp_size")
            ok = self.tp_rank in senders_of(d, tp_d, self.tp_size)
            why = "it does not write to that decode rank"
        except PdgrpcError as exc:
            ok, why = False, str(exc)
        if not ok:
            raise RequestFailed(
                C.FAILED_PRECONDITION,
                f"room {room}: decode_tp_rank={d} / decode_tp_size={req.decode_tp_size}: {ours}; {why}",
            )
        if not req.dst_pages:
            raise RequestFailed(C.INVALID_ARGUMENT, f"room {room}: dst_pages is empty")
        try:
            parsed = Descriptor.from_bytes(req.transport_descriptor)
        except BadDescriptor as exc:
            raise RequestFailed(C.INVALID_ARGUMENT, f"room {room}: transport_descriptor: {exc}") from None
        regions = parsed.region_map()
        meta_id = METADATA_REGION_ID if req.wants_metadata else METADATA_SINK_REGION_ID
        meta = regions.get(meta_id)
        if meta is None or meta.kind is not RegionKind.METADATA:
            what = "metadata region" if req.wants_metadata else "metadata sink region (wants_metadata is false)"
            raise RequestFailed(C.INVALID_ARGUMENT, f"room {room}: transport_descriptor has no {what}")
        if meta.item_bytes != self._meta_src.item_bytes:
            raise RequestFailed(
                C.FAILED_PRECONDITION,
                f"room {room}: metadata row size mismatch: decode rows are {meta.item_bytes} B, prefill rows are "
                f"{self._meta_src.item_bytes} B",
            )
        if req.dst_slot >= meta.num_items:
            raise RequestFailed(C.INVALID_ARGUMENT, f"room {room}: dst_slot {req.dst_slot} outside the decode's {meta.num_items} slots")
        try:
            pairs = region_pairs(self._regions, parsed.regions)
        except PdgrpcError as exc:
            raise RequestFailed(C.FAILED_PRECONDITION, f"room {room}: KV regions: {exc}") from None
        want = (self.num_kv_heads // tp_d) * self.head_bytes
        for src, dst in pairs:
            if dst.item_bytes != want:
                raise RequestFailed(
                    C.FAILED_PRECONDITION,
                    f"room {room}: KV page size mismatch in {src.name!r}: decode {dst.item_bytes} B, expected {want} B "
                    f"({self.num_kv_heads // tp_d} heads of decode tp rank {d} of {tp_d}; prefill pages are {src.item_bytes} B)",
                )
        kv_dst = [r for r in parsed.regions if r.kind is RegionKind.KV]
        limit = min((r.num_items for r in kv_dst), default=0)
        bad = next((p for p in req.dst_pages if p >= limit), None)
        if bad is not None:
            raise RequestFailed(C.INVALID_ARGUMENT, f"room {room}: dst_pages: page {bad} outside the decode's pool of {limit} pages")
        return Destination(
            room, tuple(req.dst_pages), req.dst_slot, bytes(req.transport_descriptor), parsed,
            decode_tp_rank=d, decode_tp_size=tp_d, wants_metadata=req.wants_metadata,
        )

    def handshake(self, req: handshake_pb2.HandshakeRequest) -> handshake_pb2.HandshakeResponse:
        """Validate and deliver a handshake. A refused handshake fails this RPC *and*
        the room's Prefill RPC (waiting now or arriving later) with the same status."""
        room = req.bootstrap_room
        try:
            dest: Destination | RequestFailed = self._check_handshake(req)
        except RequestFailed as exc:
            dest = exc
        tp_d = req.decode_tp_size or 1
        try:
            handed = self._mailbox.deliver(room, dest, key=req.decode_tp_rank, group=tp_d) if room else False
        except DuplicateHandshake as exc:
            raise RequestFailed(C.ALREADY_EXISTS, f"{exc} (decode_tp_rank {req.decode_tp_rank})") from None
        except GroupMismatch as exc:
            raise RequestFailed(
                C.FAILED_PRECONDITION,
                f"room {room}: decode_tp_size={tp_d} (decode_tp_rank {req.decode_tp_rank}), but an earlier handshake "
                f"for this room said decode_tp_size={exc.first}",
            ) from None
        except MailboxFull as exc:
            raise RequestFailed(C.RESOURCE_EXHAUSTED, str(exc)) from None
        if isinstance(dest, RequestFailed):
            request_event(log, room, "handshake refused", reason=dest.message)
            raise dest
        request_event(
            log, room, "handshake", pages=len(dest.dst_pages), slot=dest.dst_slot, prefill_waiting=handed,
            decode_tp=f"{dest.decode_tp_rank}/{dest.decode_tp_size}",
        )
        return handshake_pb2.HandshakeResponse(generation=self.generation)

    async def abort_room(self, room: int, reason: str) -> bool:
        """Stop the room; return once nothing of ours for it can still be written."""
        was_active = self._mailbox.discard(room)
        entry = self._active.get(room)
        if entry is not None:
            was_active = True
            entry.abort_reason = reason or "no reason given"
            if not entry.closing:
                entry.task.cancel()
            try:
                await asyncio.wait_for(entry.finished.wait(), self.config.abort_wait_s)
            except asyncio.TimeoutError:
                raise RequestFailed(C.DEADLINE_EXCEEDED, f"room {room}: driver did not stop within {self.config.abort_wait_s} s") from None
        else:
            # The Prefill RPC has not arrived (or already ended): leave a bounded tombstone
            # so one that arrives later fails at once instead of waiting for a handshake.
            try:
                self._mailbox.deliver(
                    room, RequestFailed(C.ABORTED, f"room {room}: aborted by decode: {reason or 'no reason given'}"), key="abort"
                )
            except (DuplicateHandshake, MailboxFull, GroupMismatch):
                pass
        request_event(log, room, "abort", reason=reason, was_active=was_active)
        return was_active

    # ---- prefill -----------------------------------------------------------------------

    def _validate(self, req: prefill_pb2.PrefillRequest) -> tuple[tuple[int, ...], SamplingParams]:
        if req.bootstrap_room == 0:
            raise RequestFailed(C.INVALID_ARGUMENT, "bootstrap_room must not be 0")
        ids = tuple(req.input_ids)
        vocab = self.engine.tokenizer.vocab_size
        try:
            sampling = sampling_from_proto(req.sampling)
            # max() first: a Python loop over every id costs ~0.1 ms right on the request's path.
            bad = next((i for i, t in enumerate(ids) if t >= vocab), None) if ids and max(ids) >= vocab else None
            if bad is not None:
                raise EngineError(f"input_ids[{bad}] = {ids[bad]} is not a token id in [0, {vocab})")
            self.engine.validate_request(ids, max(1, req.sampling.max_new_tokens))
        except EngineError as exc:
            raise RequestFailed(C.INVALID_ARGUMENT, f"room {req.bootstrap_room}: {exc}") from None
        return ids, sampling

    async def _alloc(self, n: int, room: int) -> list[int]:
        if n > self.capacity:
            raise _Oversize(C.INVALID_ARGUMENT, f"room {room}: prompt needs {n} pages, the pool has {self.capacity}")
        deadline = time.monotonic() + self.config.page_wait_s
        waited = False
        while True:
            pages = self.engine.alloc_pages(n)
            if pages is not None:
                return pages
            left = deadline - time.monotonic()
            if left <= 0:
                raise RequestFailed(
                    C.RESOURCE_EXHAUSTED,
                    f"room {room}: {n} KV pages not free within {self.config.page_wait_s} s "
                    f"({self.engine.num_free_pages - len(self._scratch)} of {self.capacity} free)",
                    AbortReason.ALLOCATE_TIMEOUT,
                )
            if not waited:
                waited = True
                request_event(log, room, "waiting for pages", need=n, free=self.engine.num_free_pages - len(self._scratch))
            # No await between the failed alloc and clear(): a free cannot slip in between.
            self._pages_freed.clear()
            try:
                await asyncio.wait_for(self._pages_freed.wait(), left)
            except asyncio.TimeoutError:
                pass

    async def prefill(self, req: prefill_pb2.PrefillRequest) -> prefill_pb2.PrefillResponse:
        room = req.bootstrap_room
        try:
            ids, sampling = self._validate(req)
            if room in self._active:
                raise RequestFailed(C.ALREADY_EXISTS, f"room {room}: a Prefill for this room is already running")
        except RequestFailed as exc:
            self.metrics.on_refused()
            request_event(log, room, "rejected", code=exc.code.name, reason=exc.message)
            raise
        task = asyncio.current_task()
        assert task is not None
        entry = _Active(room, task)
        self._active[room] = entry
        # Deferred: written once _run has handed the first chunk to the compute thread.
        request_event(
            log, room, "admitted", request_id=req.request_id or "-", tokens=len(ids), dp_rank=self.config.dp_rank,
            defer=True, **({"tp_rank": self.tp_rank} if self.tp_size > 1 else {}),
        )
        try:
            resp = await self._run(entry, ids, sampling)
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
            if entry.abort_reason is None:
                self.metrics.on_abort(AbortReason.CANCELLED)
                request_event(log, room, "cancelled by the caller")
                raise
            # abort_reason is set by AbortRoom (decode gave up) or by close() (shutdown).
            self.metrics.on_abort(ServerAbortReason.SHUTDOWN if entry.abort_reason == _SHUTDOWN else ServerAbortReason.DECODE_ERROR)
            task.uncancel()
            request_event(log, room, "aborted", reason=entry.abort_reason)
            raise RequestFailed(C.ABORTED, f"room {room}: aborted by decode: {entry.abort_reason}") from None
        except _Oversize as exc:
            # Larger than the whole pool: it took nothing and never could, so it is refused.
            self.failed += 1
            self.metrics.on_refused()
            request_event(log, room, "failed", code=exc.code.name, reason=exc.message)
            raise
        except RequestFailed as exc:
            self.failed += 1
            self.metrics.on_abort(exc.reason)
            request_event(log, room, "failed", code=exc.code.name, reason=exc.message)
            raise
        except Exception as exc:  # a bug or an engine failure: fail the request, keep serving
            self.failed += 1
            self.metrics.on_abort(ServerAbortReason.INTERNAL_ERROR)
            log.exception("room=%d failed unexpectedly", room)
            raise RequestFailed(C.INTERNAL, f"room {room}: prefill failed: {exc!r}") from None
        finally:
            await self._finish(entry)

    async def _finish(self, entry: _Active) -> None:
        """Every path ends here: no compute in flight, rooms released, pages freed."""
        entry.closing = True
        if self._cproc is not None and entry.job and entry.compute is not None and not entry.compute.done():
            self._cproc.cancel(entry.job)  # it stops after the chunk in progress
        while entry.compute is not None and not entry.compute.done():
            try:
                await asyncio.shield(entry.compute)
            except asyncio.CancelledError:
                continue  # the thread still writes into our pages: keep waiting for it
            except Exception:
                break
        if entry.followed is not None:
            # Follower: from here on its compute thread computes this room into scratch;
            # wait for a chunk it may be computing into our pages right now.
            with self._lock:
                self._followed.pop(entry.room, None)
                # Later chunks of the room (if the leader still sends any) go to scratch at once.
                self._lose(entry.room, "the room ended on this rank")
                inflight = entry.followed.inflight
            while inflight is not None and not inflight.done():
                try:
                    await asyncio.shield(asyncio.wrap_future(inflight))
                except asyncio.CancelledError:
                    continue
                except Exception:
                    break
        elif self.leader and self.tp_size > 1 and not entry.computed_all and self._broken is None and not self._stopped:
            # Leader: the followers may wait for chunks of this room that will never come.
            # Only the leader: a follower whose room was lost before it registered
            # (entry.followed is None) must not broadcast -- its _follow thread is inside
            # a broadcast already, and two concurrent receivers desynchronise the group.
            try:
                self._executor.submit(self._broadcast, ("end", entry.room))
            except RuntimeError:  # executor shut down
                pass
        # A failed or aborted room: wait (bounded) until none of its queued bytes can still
        # land at the decode, so the ack that AbortRoom sends means what it says.
        for key in {entry.room, *entry.keys}:
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
        for key in {entry.room, *entry.keys}:
            self.transport.release(key)
        self._mailbox.discard(entry.room)
        self._mailbox.done(entry.room)
        # Nothing below awaits: a second cancellation cannot leave the room half-finished.
        if entry.pages:
            self.engine.free_pages(entry.pages)
            entry.pages = []
            self._pages_freed.set()  # wake requests waiting for pages
        self._active.pop(entry.room, None)
        entry.finished.set()

    # ---- TP lock-step ---------------------------------------------------------------------

    def _broadcast(self, cmd: tuple) -> None:  # type: ignore[type-arg]
        """Leader, compute thread only: send ``cmd`` to the followers."""
        import torch.distributed as dist

        try:
            dist.broadcast_object_list([cmd], src=0)
        except Exception as exc:
            self._broken = f"TP group broken: broadcast failed: {exc!r}"
            log.error("tp%d: %s", self.tp_rank, self._broken)
            self._loop.call_soon_threadsafe(self.broken.set)
            raise

    def _lead_chunk(self, room: int, req: EnginePrefill, start: int, end: int) -> tuple[SampledToken | None, float]:
        """Leader, compute thread: command the followers, then compute the chunk."""
        if self._broken is not None:
            raise RequestFailed(C.UNAVAILABLE, f"room {room}: {self._broken}", ServerAbortReason.PEER_FAILURE)
        t = time.perf_counter()
        if self.tp_size > 1:
            self._broadcast(("chunk", room, req.token_ids, req.sampling, start, end))
        return self.engine.prefill_chunk(req, start, end), time.perf_counter() - t

    def _lose(self, room: int, why: str) -> None:
        """Follower, under the lock: ``room`` is computed without us."""
        self._lost[room] = why
        self._lost.move_to_end(room)
        while len(self._lost) > self.config.lost_rooms:
            self._lost.popitem(last=False)

    def _follow(self) -> None:
        """Follower's compute thread: run the leader's commands until ``("stop",)``."""
        import torch.distributed as dist

        cfg = self.config
        lower_thread_priority(cfg.compute_nice)  # as the leader's: the group computes in lock step
        while True:
            box: list[Any] = [None]
            try:
                dist.broadcast_object_list(box, src=0)
            except Exception as exc:
                if self._stopped:
                    return
                self._broken = f"TP group broken: receiving from tp rank 0 failed: {exc!r}"
                log.error("tp%d: %s", self.tp_rank, self._broken)
                self._loop.call_soon_threadsafe(self.broken.set)
                self._fail_followed(self._broken)
                return
            cmd = box[0]
            if cmd[0] == "stop":
                log.info("tp%d: stop command from tp rank 0", self.tp_rank)
                return
            if cmd[0] == "end":
                room = cmd[1]
                with self._lock:
                    fr = self._followed.get(room)
                    if fr is None:
                        self._lose(room, "tp rank 0 ended the room")
                if fr is not None:
                    fr.loop.call_soon_threadsafe(
                        fr.queue.put_nowait,
                        (0, None, 0.0, RequestFailed(C.ABORTED, f"room {room}: tp rank 0 ended the room before it was computed",
                                                     ServerAbortReason.PEER_FAILURE)),
                    )
                continue
            _, room, ids, sampling, start, end = cmd
            deadline = time.monotonic() + cfg.tp_room_wait_s
            with self._lock:
                while start == 0 and room not in self._followed and room not in self._lost and not self._stopped:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._lock.wait(left)
                fr = self._followed.get(room) if room not in self._lost else None
                if fr is None and room not in self._lost:
                    self._lose(room, f"tp rank 0 computed it before this rank's Prefill RPC arrived (waited {cfg.tp_room_wait_s} s)"
                               if start == 0 else "the room ended on this rank")
                fut: concurrent.futures.Future[None] | None = None
                if fr is not None:
                    fut = fr.inflight = concurrent.futures.Future()
            pages = fr.pages if fr is not None else self._scratch
            t = time.perf_counter()
            err: BaseException | None = None
            tok: SampledToken | None = None
            try:
                tok = self.engine.prefill_chunk(EnginePrefill(tuple(ids), pages, sampling), start, end)
            except Exception as exc:  # validation fails the same way on every rank
                err = exc
                log.error("tp%d: room=%d chunk [%d, %d) failed: %r", self.tp_rank, room, start, end, exc)
            finally:
                if fut is not None:
                    fut.set_result(None)
            if fr is not None:
                fr.loop.call_soon_threadsafe(fr.queue.put_nowait, (end, tok, time.perf_counter() - t, err))

    def _fail_followed(self, reason: str) -> None:
        with self._lock:
            rooms = list(self._followed.values())
        for fr in rooms:
            fr.loop.call_soon_threadsafe(
                fr.queue.put_nowait, (0, None, 0.0, RequestFailed(C.UNAVAILABLE, f"room {fr.room}: {reason}", ServerAbortReason.PEER_FAILURE))
            )

    def _register_followed(self, entry: _Active, n: int) -> None:
        """Follower: let the compute thread write ``entry``'s room into its pages."""
        room = entry.room
        if self._broken is not None:
            raise RequestFailed(C.UNAVAILABLE, f"room {room}: {self._broken}", ServerAbortReason.PEER_FAILURE)
        with self._lock:
            why = self._lost.get(room)
            if why is None:
                entry.followed = _Followed(room, tuple(entry.pages), asyncio.get_running_loop(), asyncio.Queue(), total=n)
                self._followed[room] = entry.followed
                self._lock.notify_all()
        if why is not None:
            raise RequestFailed(C.ABORTED, f"room {room}: tp rank {self.tp_rank}: {why}", ServerAbortReason.PEER_FAILURE)

    # ---- one request ------------------------------------------------------------------------

    async def _destinations(self, room: int) -> list[Destination]:
        """Every handshake this rank needs for ``room`` (one per decode rank it writes to)."""
        cfg = self.config
        deadline = time.monotonic() + cfg.handshake_timeout_s
        got: dict[int, Destination] = {}
        need: range | None = None
        while need is None or len(got) < len(need):
            try:
                dest = await self._mailbox.wait(room, max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                missing = "" if need is None else f" (have decode tp ranks {sorted(got)} of {list(need)})"
                raise RequestFailed(
                    C.DEADLINE_EXCEEDED, f"room {room}: no decode handshake within {cfg.handshake_timeout_s} s{missing}",
                    AbortReason.BOOTSTRAP_TIMEOUT,
                ) from None
            except DuplicateHandshake as exc:
                raise RequestFailed(C.ALREADY_EXISTS, str(exc), ServerAbortReason.DECODE_ERROR) from None
            if isinstance(dest, RequestFailed):
                # A refused handshake, or an AbortRoom that came before this Prefill: the
                # decode side ended it.
                raise RequestFailed(dest.code, dest.message, ServerAbortReason.DECODE_ERROR)
            if need is None:
                need = receivers_of(self.tp_rank, self.tp_size, dest.decode_tp_size)
            got[dest.decode_tp_rank] = dest
        return [got[d] for d in sorted(got)]

    async def _open(self, room: int, dest: Destination, n_pages: int, pages: Sequence[int]) -> _Out:
        d, tp_d = dest.decode_tp_rank, dest.decode_tp_size
        if len(dest.dst_pages) < n_pages:
            raise RequestFailed(
                C.INVALID_ARGUMENT, f"room {room}: decode tp rank {d} gave {len(dest.dst_pages)} dst_pages, the prompt needs {n_pages}",
                ServerAbortReason.DECODE_ERROR,
            )
        try:
            peer = await self.transport.connect(dest.descriptor)
        except PdgrpcError as exc:
            raise RequestFailed(
                C.UNAVAILABLE, f"room {room}: cannot connect to the decode's transport (decode tp rank {d}): {exc}",
                ServerAbortReason.PEER_FAILURE,
            ) from None
        pairs = region_pairs(self._regions, dest.parsed.regions)
        dst_heads = heads_of(d, tp_d, self.num_kv_heads)
        if dst_heads == self.heads:
            def ops(src: Sequence[int], dst: Sequence[int]) -> WriteOps:
                return page_ops(pairs, src, dst)
        else:
            from pdgrpc.transport.pages import head_slice_ops

            common = (max(self.heads[0], dst_heads[0]), min(self.heads[1], dst_heads[1]))

            def ops(src: Sequence[int], dst: Sequence[int]) -> WriteOps:
                return head_slice_ops(pairs, src, dst, src_heads=self.heads, dst_heads=dst_heads, heads=common,
                                      head_bytes=self.head_bytes)
        meta_dst = dest.parsed.region(METADATA_REGION_ID if dest.wants_metadata else METADATA_SINK_REGION_ID)
        assert meta_dst is not None  # checked at handshake time
        return _Out(dest, transfer_room(room, self.tp_rank, d), peer, ops, meta_dst,
                    dict(zip(pages, dest.dst_pages[:n_pages])))

    async def _run(self, entry: _Active, ids: Sequence[int], sampling: SamplingParams) -> prefill_pb2.PrefillResponse:
        room, cfg, n = entry.room, self.config, len(ids)
        n_pages = self.engine.pages_needed(n)
        entry.pages = await self._alloc(n_pages, room)
        follower = self.tp_size > 1 and not self.leader
        engine_req = EnginePrefill(tuple(ids), tuple(entry.pages), sampling)
        if follower:
            self._register_followed(entry, n)
            assert entry.followed is not None
            chunks = entry.followed.queue
        else:
            # Compute starts now, not once the handshake is in: the prompt's KV does not
            # depend on where it goes, and the handshake usually lands during chunk 1.
            chunks = self._start_compute(entry, engine_req, n)
        dests = await self._destinations(room)
        now = time.monotonic()
        sender, _ = PrefillSender.create(
            room, tuple(entry.pages), n, self.page_size, now,
            # The driver enforces its own (tighter) timeouts; these only bound the machine.
            deadlines=SenderDeadlines(waiting_for_destination_s=cfg.handshake_timeout_s, transferring_s=cfg.transfer_timeout_s),
        )
        sender.handle(DestinationReceived(dests[0].dst_pages, dests[0].dst_slot), now)
        if sender.state is SenderState.FAILED:
            assert sender.failure is not None
            raise RequestFailed(C.INVALID_ARGUMENT, sender.failure.message, ServerAbortReason.DECODE_ERROR)
        outs: list[_Out] = []
        for dest in dests:
            outs.append(await self._open(room, dest, n_pages, entry.pages))
            entry.keys.append(outs[-1].key)
        sent_bytes = 0
        compute_s = 0.0
        first_write: float | None = None
        token: SampledToken | None = None
        done = 0
        logged_transferring = False
        held_src: list[int] = []  # completed pages not written yet (min_write_bytes)
        held_dst: list[int] = []
        final = self._prepare_final_write(entry, outs, n_pages, dests[0].dst_pages)
        while done < n:
            end, token, secs, err = await chunks.get()
            if err is not None:
                if isinstance(err, RequestFailed):
                    raise err
                raise RequestFailed(C.INTERNAL, f"room {room}: prefill failed: {err!r}")
            if end <= done:
                continue
            compute_s += secs
            done = end
            for o in outs:
                self._check_room(room, o.key)
            actions = sender.handle(ChunkDone(end, last=end == n), time.monotonic())
            while actions:
                action = actions.pop(0)
                if isinstance(action, WritePages):
                    held_src += action.src
                    held_dst += action.dst
                    if len(held_src) * self._page_nbytes >= cfg.min_write_bytes:
                        first_write = first_write or time.perf_counter()
                        sent_bytes += await self._write_pages(outs, held_src, held_dst)
                        held_src, held_dst = [], []
                    # The transport lands the metadata row only after every earlier write of
                    # the room (held pages are written before it), so "queued" is enough for
                    # the machine to move on.
                    actions += sender.handle(PagesWritten(len(action.src)), time.monotonic())
                elif isinstance(action, WriteMetadata):
                    assert token is not None
                    if final is not None and final.covers(held_src, held_dst):
                        # Planned during the compute: only the sends are left.
                        self.send_rows.write_row(entry.pages[0], row_from_token(token), room)
                        first_write = first_write or time.perf_counter()
                        for send in final.sends:
                            await send()
                        sent_bytes += final.nbytes
                        held_src, held_dst = [], []
                        continue
                    if held_src:
                        first_write = first_write or time.perf_counter()
                        sent_bytes += await self._write_pages(outs, held_src, held_dst)
                        held_src, held_dst = [], []
                    local = entry.pages[0]
                    self.send_rows.write_row(local, row_from_token(token), room)
                    first_write = first_write or time.perf_counter()
                    for o in outs:
                        op: WriteOp = metadata_op(self._meta_src, local, o.meta_dst, o.dest.dst_slot)
                        await self.transport.write(o.peer, o.key, [], metadata=op)
                        sent_bytes += op.length
            if first_write is not None and end < n and not logged_transferring:
                logged_transferring = True
                request_event(log, room, "transferring", chunk_tokens=cfg.chunk_size, chunks=-(-n // cfg.chunk_size), level=logging.DEBUG)
        deadline = time.monotonic() + cfg.transfer_timeout_s
        for o in outs:
            status = await self.transport.wait(o.key, max(0.0, deadline - time.monotonic()))
            if status.state is KVPoll.FAILED:
                raise RequestFailed(C.ABORTED, f"room {room}: transfer failed{self._to(o)}: {status.reason}", _transfer_failed(status.reason))
            if status.state is not KVPoll.SUCCESS:
                raise RequestFailed(
                    C.DEADLINE_EXCEEDED,
                    f"room {room}: decode{self._to(o)} did not acknowledge the metadata row within {cfg.transfer_timeout_s} s",
                    AbortReason.TRANSFER_TIMEOUT,
                )
        sender.handle(MetadataWritten(), time.monotonic())
        assert first_write is not None
        return prefill_pb2.PrefillResponse(
            dp_rank=cfg.dp_rank,
            prompt_tokens=n,
            bytes_transferred=sent_bytes,
            transfer_seconds=time.perf_counter() - first_write,
            compute_seconds=compute_s,
        )

    def _prepare_final_write(self, entry: _Active, outs: list[_Out], n_pages: int, dst_pages: Sequence[int]) -> "_FinalWrite | None":
        """The prompt's one write (all its pages, then the metadata row), planned now,
        while the compute process computes: when the whole prompt's KV is below
        ``min_write_bytes`` nothing is written before the last chunk, and the checks and
        message planning (~0.3 ms of numpy right after a compute, caches cold) are then
        off the path to the first token. Not with the compute on a thread of this
        process, whose Python it would stop instead (measured: no gain)."""
        if self._cproc is None or n_pages * self._page_nbytes >= self.config.min_write_bytes:
            return None
        src, dst = list(entry.pages[:n_pages]), list(dst_pages[:n_pages])
        sends, nbytes = [], 0
        for o in outs:
            ops = self._ops_to(o, outs, src, dst)
            meta = metadata_op(self._meta_src, entry.pages[0], o.meta_dst, o.dest.dst_slot)
            sends.append(self.transport.prepare_write(o.peer, o.key, ops, metadata=meta))
            nbytes += ops.nbytes + meta.length
        return _FinalWrite(src, dst, sends, nbytes)

    @staticmethod
    def _ops_to(o: _Out, outs: list[_Out], src: list[int], dst: list[int]) -> WriteOps:
        """The ops writing pages ``src`` to destination ``o``: to ``dst`` on the first
        destination, to the pages its own handshake granted on the others."""
        return o.ops(src, dst if o is outs[0] else [o.page_of[p] for p in src])

    async def _write_pages(self, outs: list[_Out], src: list[int], dst: list[int]) -> int:
        """Write pages ``src`` (to ``dst`` on the first destination) to every destination;
        the bytes queued."""
        sent = 0
        for o in outs:
            ops = self._ops_to(o, outs, src, dst)
            await self.transport.write(o.peer, o.key, ops)
            sent += ops.nbytes  # one numpy sum, not a Python loop per op
        return sent

    def _start_compute(self, entry: _Active, req: EnginePrefill, n: int) -> "asyncio.Queue[tuple[int, SampledToken | None, float, BaseException | None]]":
        """Compute the prompt chunk by chunk on the compute thread, posting
        ``(end, token, seconds, error)`` to the loop. Each chunk queues the next one itself
        (behind other requests' chunks: first come, first served), so the loop's writes of
        chunk k overlap the compute of chunk k+1 instead of sitting between them.
        ``entry.compute`` resolves once the thread will not touch the pages again.

        A chunk is posted only when the loop has something to do with it: the pages it
        completed since the last post reach ``min_write_bytes`` (the loop writes them), it
        is the last chunk, or it failed; ``seconds`` is the compute time since the last
        post. Every post wakes the loop, and the loop's Python then competes with the
        compute for the GIL and the cores: posting all eight 64-token chunks of a
        512-token prompt whose 0.5 MiB of KV is written at the end anyway cost ~1 ms of
        TTFT on the 2-core CI host (1p1d over rdma, measured side by side)."""
        loop = asyncio.get_running_loop()
        out: asyncio.Queue[tuple[int, SampledToken | None, float, BaseException | None]] = asyncio.Queue()
        stopped: asyncio.Future[object] = loop.create_future()
        entry.compute = stopped
        chunk = self.config.chunk_size

        def post(item: tuple[int, SampledToken | None, float, BaseException | None]) -> None:
            loop.call_soon_threadsafe(out.put_nowait, item)

        def stop() -> None:
            loop.call_soon_threadsafe(lambda: None if stopped.done() else stopped.set_result(None))

        min_pages = -(-self.config.min_write_bytes // self._page_nbytes)  # pages worth a write
        if self._cproc is not None:
            def post_from_child(end: int, token: SampledToken | None, secs: float, err: BaseException | None) -> None:
                if err is None and end == n:
                    entry.computed_all = True
                if isinstance(err, ComputeProcessLost):
                    err = RequestFailed(C.UNAVAILABLE, f"room {entry.room}: {err}", ServerAbortReason.INTERNAL_ERROR)
                out.put_nowait((n if end < 0 else end, token, secs, err))

            def child_stopped() -> None:
                if not stopped.done():
                    stopped.set_result(None)

            try:
                entry.job = self._cproc.submit(req, chunk, min_pages, self.page_size, post_from_child, child_stopped)
            except ComputeProcessLost as exc:
                stopped.set_result(None)
                raise RequestFailed(C.UNAVAILABLE, f"room {entry.room}: {exc}") from None
            return out
        posted_pages, unposted_s = 0, 0.0  # complete pages at the last post, compute seconds since it

        def step(start: int) -> None:
            nonlocal posted_pages, unposted_s
            if entry.closing:  # the request ended (abort, failure, shutdown): stop here
                return stop()
            end = min(n, start + chunk)
            try:
                token, secs = self._lead_chunk(entry.room, req, start, end)
            except BaseException as exc:
                post((end, None, unposted_s, exc))
                return stop()
            unposted_s += secs
            if end == n:
                entry.computed_all = True
            complete = end // self.page_size
            if end == n or complete - posted_pages >= min_pages:
                post((end, token, unposted_s, None))
                posted_pages, unposted_s = complete, 0.0
            if end == n:
                return stop()
            try:
                self._executor.submit(step, end)
            except RuntimeError:  # the executor is shutting down
                stop()

        try:
            self._executor.submit(step, 0)
        except RuntimeError:
            stopped.set_result(None)
            raise RequestFailed(C.UNAVAILABLE, f"room {entry.room}: {_SHUTDOWN}") from None
        return out

    def _succeeded(self, key: int) -> bool:
        try:
            return self.transport.status(key).state is KVPoll.SUCCESS
        except PdgrpcError:  # never written (unknown to the transport): nothing to drain
            return True

    def _to(self, o: _Out) -> str:
        if self.tp_size == 1 and o.dest.decode_tp_size == 1:
            return ""
        return f" (tp rank {self.tp_rank} -> decode tp rank {o.dest.decode_tp_rank})"

    def _check_room(self, room: int, key: int) -> None:
        """Stop early when the transport already failed the room (decode NACKed, peer died)."""
        if key in self.transport.rooms:
            st = self.transport.status(key)
            if st.state is KVPoll.FAILED:
                raise RequestFailed(C.ABORTED, f"room {room}: transfer failed: {st.reason}", _transfer_failed(st.reason))
