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
import concurrent.futures
import dataclasses
import logging
import time
from typing import Sequence, cast

import grpc

from pdgrpc.engine.base import Engine, SampledToken, SamplingParams
from pdgrpc.engine.base import PrefillRequest as EnginePrefill
from pdgrpc.errors import EngineError, PdgrpcError
from pdgrpc.kvpoll import KVPoll
from pdgrpc.metrics import PrefillMetrics, ServerAbortReason
from pdgrpc.prefill.errors import RequestFailed
from pdgrpc.prefill.mailbox import DuplicateHandshake, Mailbox, MailboxFull
from pdgrpc.serving import compat_hash_bytes, metadata_layout, request_event, row_from_token, sampling_from_proto
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
from pdgrpc.transport.base import BadDescriptor, Descriptor, RegionKind, Transport, WriteOp
from pdgrpc.transport.pages import METADATA_REGION_ID, kv_regions, metadata_op, metadata_region, page_ops, region_pairs
from pdgrpc.v1 import common_pb2, handshake_pb2, prefill_pb2

log = logging.getLogger("pdgrpc.prefill.worker")

__all__ = ["Destination", "PrefillWorker", "WorkerConfig"]

C = grpc.StatusCode


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    dp_rank: int = 0
    chunk_size: int = 512  # prompt tokens per prefill chunk
    handshake_timeout_s: float = 30.0  # Prefill RPC waiting for the decode's handshake
    transfer_timeout_s: float = 60.0  # metadata row written -> decode's acknowledgement
    page_wait_s: float = 30.0  # waiting for free KV pages when the pool is short
    abort_wait_s: float = 60.0  # AbortRoom waiting for the room's driver to stop
    early_handshakes: int = 4096  # handshakes kept before their Prefill RPC (count)
    early_handshake_ttl_s: float = 60.0  # and for how long (seconds)

    def __post_init__(self) -> None:
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")


@dataclasses.dataclass(frozen=True)
class Destination:
    """A validated handshake: where one room's pages and metadata row go."""

    room: int
    dst_pages: tuple[int, ...]
    dst_slot: int
    descriptor: bytes
    parsed: Descriptor


@dataclasses.dataclass(eq=False)
class _Active:
    room: int
    task: asyncio.Task  # type: ignore[type-arg]
    pages: list[int] = dataclasses.field(default_factory=list)
    compute: "asyncio.Future[object] | None" = None
    abort_reason: str | None = None
    closing: bool = False
    finished: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)


_SHUTDOWN = "prefill worker shutting down"  # abort_reason set by close()


class _Oversize(RequestFailed):
    """A prompt needing more pages than the whole pool: refused, not aborted."""


def _transfer_failed(reason: str | None) -> "AbortReason | ServerAbortReason":
    # The transports name a write outside the decode's grant "rejected" in the room's
    # failure reason (the receiver NACKs it); anything else is a transfer failure.
    return ServerAbortReason.REJECTED_WRITE if reason and "reject" in reason.lower() else AbortReason.TRANSFER_FAILED


def _hex(b: bytes) -> str:
    return "0x" + b.hex() if b else "(empty)"


class PrefillWorker:
    """Serves one dp rank. ``await start()`` registers the KV pool and the send rows with
    the transport; ``descriptor`` is then what bootstrap advertises."""

    def __init__(
        self, engine: Engine, transport: Transport, config: WorkerConfig = WorkerConfig(), metrics: PrefillMetrics | None = None
    ) -> None:
        self.engine = engine
        # Each request this worker ran is counted here once, in prefill(); the controller
        # counts only the requests that never reached a worker.
        self.metrics = metrics or PrefillMetrics(transport=transport.name)
        self.transport = transport
        self.config = config
        self.compat_hash = compat_hash_bytes(engine)
        self.page_size = engine.kv_layout.page_size
        self.send_rows = MetadataBuffers(engine.num_pages, metadata_layout())
        bufs = engine.kv_buffers()
        self._regions = [*kv_regions(bufs.k, bufs.v), metadata_region(self.send_rows.tensor)]
        self._meta_src = self._regions[-1]
        self.descriptor = b""
        self.generation = 0  # set from bootstrap's RegisterWorker answer
        self._mailbox: Mailbox[Destination | RequestFailed] = Mailbox(config.early_handshakes, config.early_handshake_ttl_s)
        self._active: dict[int, _Active] = {}
        self._pages_freed = asyncio.Event()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"prefill{config.dp_rank}-compute")
        self.completed = 0  # requests finished successfully (count)
        self.failed = 0

    async def start(self) -> bytes:
        self.descriptor = await self.transport.register(self._regions)
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
        await self.transport.close()
        self._executor.shutdown(wait=True)

    # ---- stats -----------------------------------------------------------------------

    @property
    def queue_length(self) -> int:
        return len(self._active)

    def stats(self) -> common_pb2.ResourceStats:
        """Read from the live allocator and transport, not from counters of our own."""
        return common_pb2.ResourceStats(
            active_requests=len(self._active),
            pages_in_use=self.engine.num_pages - self.engine.num_free_pages,
            pages_total=self.engine.num_pages,
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
        if req.decode_tp_size > 1 or req.decode_tp_rank != 0:
            raise RequestFailed(
                C.FAILED_PRECONDITION,
                f"room {room}: decode_tp_size={req.decode_tp_size} / decode_tp_rank={req.decode_tp_rank}: "
                "this prefill serves TP 1 decodes only",
            )
        if not req.dst_pages:
            raise RequestFailed(C.INVALID_ARGUMENT, f"room {room}: dst_pages is empty")
        try:
            d = Descriptor.from_bytes(req.transport_descriptor)
        except BadDescriptor as exc:
            raise RequestFailed(C.INVALID_ARGUMENT, f"room {room}: transport_descriptor: {exc}") from None
        regions = d.region_map()
        meta = regions.get(METADATA_REGION_ID)
        if meta is None or meta.kind is not RegionKind.METADATA:
            raise RequestFailed(C.INVALID_ARGUMENT, f"room {room}: transport_descriptor has no metadata region")
        if meta.item_bytes != self._meta_src.item_bytes:
            raise RequestFailed(
                C.FAILED_PRECONDITION,
                f"room {room}: metadata row size mismatch: decode rows are {meta.item_bytes} B, prefill rows are "
                f"{self._meta_src.item_bytes} B",
            )
        if req.dst_slot >= meta.num_items:
            raise RequestFailed(C.INVALID_ARGUMENT, f"room {room}: dst_slot {req.dst_slot} outside the decode's {meta.num_items} slots")
        try:
            pairs = region_pairs(self._regions, d.regions)
        except PdgrpcError as exc:
            raise RequestFailed(C.FAILED_PRECONDITION, f"room {room}: KV regions: {exc}") from None
        for src, dst in pairs:
            if src.item_bytes != dst.item_bytes:
                raise RequestFailed(
                    C.FAILED_PRECONDITION,
                    f"room {room}: KV page size mismatch in {src.name!r}: decode {dst.item_bytes} B, prefill {src.item_bytes} B",
                )
        kv_dst = [r for r in d.regions if r.kind is RegionKind.KV]
        limit = min((r.num_items for r in kv_dst), default=0)
        bad = next((p for p in req.dst_pages if p >= limit), None)
        if bad is not None:
            raise RequestFailed(C.INVALID_ARGUMENT, f"room {room}: dst_pages: page {bad} outside the decode's pool of {limit} pages")
        return Destination(room, tuple(req.dst_pages), req.dst_slot, bytes(req.transport_descriptor), d)

    def handshake(self, req: handshake_pb2.HandshakeRequest) -> handshake_pb2.HandshakeResponse:
        """Validate and deliver a handshake. A refused handshake fails this RPC *and*
        the room's Prefill RPC (waiting now or arriving later) with the same status."""
        room = req.bootstrap_room
        try:
            dest: Destination | RequestFailed = self._check_handshake(req)
        except RequestFailed as exc:
            dest = exc
        try:
            handed = self._mailbox.deliver(room, dest) if room else False
        except DuplicateHandshake as exc:
            raise RequestFailed(C.ALREADY_EXISTS, str(exc)) from None
        except MailboxFull as exc:
            raise RequestFailed(C.RESOURCE_EXHAUSTED, str(exc)) from None
        if isinstance(dest, RequestFailed):
            request_event(log, room, "handshake refused", reason=dest.message)
            raise dest
        request_event(log, room, "handshake", pages=len(dest.dst_pages), slot=dest.dst_slot, prefill_waiting=handed)
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
                self._mailbox.deliver(room, RequestFailed(C.ABORTED, f"room {room}: aborted by decode: {reason or 'no reason given'}"))
            except (DuplicateHandshake, MailboxFull):
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
            bad = next((i for i, t in enumerate(ids) if t >= vocab), None)
            if bad is not None:
                raise EngineError(f"input_ids[{bad}] = {ids[bad]} is not a token id in [0, {vocab})")
            self.engine.validate_request(ids, max(1, req.sampling.max_new_tokens))
        except EngineError as exc:
            raise RequestFailed(C.INVALID_ARGUMENT, f"room {req.bootstrap_room}: {exc}") from None
        return ids, sampling

    async def _alloc(self, n: int, room: int) -> list[int]:
        if n > self.engine.num_pages:
            raise _Oversize(C.INVALID_ARGUMENT, f"room {room}: prompt needs {n} pages, the pool has {self.engine.num_pages}")
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
                    f"({self.engine.num_free_pages} of {self.engine.num_pages} free)",
                    AbortReason.ALLOCATE_TIMEOUT,
                )
            if not waited:
                waited = True
                request_event(log, room, "waiting for pages", need=n, free=self.engine.num_free_pages)
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
        request_event(log, room, "admitted", request_id=req.request_id or "-", tokens=len(ids), dp_rank=self.config.dp_rank)
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
        """Every path ends here: no compute in flight, room released, pages freed."""
        entry.closing = True
        while entry.compute is not None and not entry.compute.done():
            try:
                await asyncio.shield(entry.compute)
            except asyncio.CancelledError:
                continue  # the thread still writes into our pages: keep waiting for it
            except Exception:
                break
        self.transport.release(entry.room)
        self._mailbox.discard(entry.room)
        self._mailbox.done(entry.room)
        # Nothing below awaits: a second cancellation cannot leave the room half-finished.
        if entry.pages:
            self.engine.free_pages(entry.pages)
            entry.pages = []
            self._pages_freed.set()  # wake requests waiting for pages
        self._active.pop(entry.room, None)
        entry.finished.set()

    async def _run(self, entry: _Active, ids: Sequence[int], sampling: SamplingParams) -> prefill_pb2.PrefillResponse:
        room, cfg, n = entry.room, self.config, len(ids)
        entry.pages = await self._alloc(self.engine.pages_needed(n), room)
        try:
            dest = await self._mailbox.wait(room, cfg.handshake_timeout_s)
        except asyncio.TimeoutError:
            raise RequestFailed(
                C.DEADLINE_EXCEEDED, f"room {room}: no decode handshake within {cfg.handshake_timeout_s} s",
                AbortReason.BOOTSTRAP_TIMEOUT,
            ) from None
        except DuplicateHandshake as exc:
            raise RequestFailed(C.ALREADY_EXISTS, str(exc), ServerAbortReason.DECODE_ERROR) from None
        if isinstance(dest, RequestFailed):
            # A refused handshake, or an AbortRoom that came before this Prefill: the
            # decode side ended it.
            raise RequestFailed(dest.code, dest.message, ServerAbortReason.DECODE_ERROR)
        now = time.monotonic()
        sender, _ = PrefillSender.create(
            room, tuple(entry.pages), n, self.page_size, now,
            # The driver enforces its own (tighter) timeouts; these only bound the machine.
            deadlines=SenderDeadlines(waiting_for_destination_s=cfg.handshake_timeout_s, transferring_s=cfg.transfer_timeout_s),
        )
        sender.handle(DestinationReceived(dest.dst_pages, dest.dst_slot), now)
        if sender.state is SenderState.FAILED:
            assert sender.failure is not None
            raise RequestFailed(C.INVALID_ARGUMENT, sender.failure.message, ServerAbortReason.DECODE_ERROR)
        try:
            peer = await self.transport.connect(dest.descriptor)
        except PdgrpcError as exc:
            raise RequestFailed(
                C.UNAVAILABLE, f"room {room}: cannot connect to the decode's transport: {exc}", ServerAbortReason.PEER_FAILURE
            ) from None
        pairs = region_pairs(self._regions, dest.parsed.regions)
        meta_dst = dest.parsed.region(METADATA_REGION_ID)
        assert meta_dst is not None  # checked at handshake time
        engine_req = EnginePrefill(tuple(ids), tuple(entry.pages), sampling)
        loop = asyncio.get_running_loop()
        sent_bytes = 0
        compute_s = 0.0
        first_write: float | None = None
        token: SampledToken | None = None
        for start in range(0, n, cfg.chunk_size):
            end = min(n, start + cfg.chunk_size)
            t = time.perf_counter()
            entry.compute = asyncio.wrap_future(self._executor.submit(self.engine.prefill_chunk, engine_req, start, end), loop=loop)
            token = cast("SampledToken | None", await asyncio.shield(entry.compute))
            compute_s += time.perf_counter() - t
            self._check_room(room)
            actions = sender.handle(ChunkDone(end, last=end == n), time.monotonic())
            while actions:
                action = actions.pop(0)
                if isinstance(action, WritePages):
                    ops = page_ops(pairs, action.src, action.dst)
                    first_write = first_write or time.perf_counter()
                    await self.transport.write(peer, room, ops)
                    sent_bytes += ops.nbytes  # one numpy sum, not a Python loop per op
                    # The transport lands the metadata row only after every earlier write of
                    # the room, so "queued" is enough for the machine to move on.
                    actions += sender.handle(PagesWritten(len(action.src)), time.monotonic())
                elif isinstance(action, WriteMetadata):
                    assert token is not None
                    local = entry.pages[0]
                    self.send_rows.write_row(local, row_from_token(token), room)
                    op: WriteOp = metadata_op(self._meta_src, local, meta_dst, action.slot)
                    first_write = first_write or time.perf_counter()
                    await self.transport.write(peer, room, [], metadata=op)
                    sent_bytes += op.length
            if start == 0 and end < n:
                request_event(log, room, "transferring", chunk_tokens=cfg.chunk_size, chunks=-(-n // cfg.chunk_size), level=logging.DEBUG)
        status = await self.transport.wait(room, cfg.transfer_timeout_s)
        if status.state is KVPoll.FAILED:
            raise RequestFailed(C.ABORTED, f"room {room}: transfer failed: {status.reason}", _transfer_failed(status.reason))
        if status.state is not KVPoll.SUCCESS:
            raise RequestFailed(
                C.DEADLINE_EXCEEDED, f"room {room}: decode did not acknowledge the metadata row within {cfg.transfer_timeout_s} s",
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

    def _check_room(self, room: int) -> None:
        """Stop early when the transport already failed the room (decode NACKed, peer died)."""
        if room in self.transport.rooms:
            st = self.transport.status(room)
            if st.state is KVPoll.FAILED:
                raise RequestFailed(C.ABORTED, f"room {room}: transfer failed: {st.reason}", _transfer_failed(st.reason))
