"""One room's driver on a prefill rank: it carries out what the room's
:class:`~pdgrpc.state.prefill_sender.PrefillSender` decides.

Events in (a destination from the mailbox, a chunk the compute posted, a write queued, the
decode's acknowledgement, the timer at the sender's deadline), actions out (page writes,
the final write with the metadata row). Which pages go when, the held-back partial page,
the metadata row last, every phase's deadline: the sender. Connecting to the decode,
building the ops of a write, queueing it: this module.

The local send buffer for metadata rows has one row per KV page; a request uses the row
of its last page, which no other live request can hold (a cached prefix is shared, but
the page of a prompt's last token is always the request's own), so rows need no
allocator of their own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any, Awaitable, Callable, Sequence

from pdgrpc.engine.base import PrefillRequest as EnginePrefill
from pdgrpc.engine.base import SampledToken, SamplingParams
from pdgrpc.errors import PdgrpcError
from pdgrpc.kvpoll import KVPoll
from pdgrpc.metrics import ServerAbortReason
from pdgrpc.prefill.compute import ChunkPost, Compute, ComputeJob
from pdgrpc.prefill.errors import RequestFailed
from pdgrpc.prefill.handshake import Destination, Signed
from pdgrpc.prefill.mailbox import DuplicateHandshake, Mailbox
from pdgrpc.prefill.statuses import Refusal, ending
from pdgrpc.rpc import tracing
from pdgrpc.serving.logs import request_event
from pdgrpc.serving.metadata import row_from_token
from pdgrpc.serving.tp import METADATA_SINK_REGION_ID, heads_of, receivers_of, transfer_room
from pdgrpc.state.config import SenderDeadlines
from pdgrpc.state.metadata import MetadataBuffers
from pdgrpc.state.outcomes import AbortReason
from pdgrpc.state.prefill_sender import (
    ChunkDone, DestinationReceived, Fail, MetadataWritten, PagesWritten, PrefillSender, SenderAction, SenderFailReason,
    SenderState, WriteMetadata, WritePages,
)
from pdgrpc.state.room import Room
from pdgrpc.transport.base import MemoryRegion, Peer, RoomStatus, Transport, WriteOp, WriteOps
from pdgrpc.transport.pages import METADATA_REGION_ID, head_slice_ops, metadata_op, page_ops, region_pairs
from pdgrpc.v1 import prefill_pb2

__all__ = ["RoomDriver", "Sending"]

log = logging.getLogger("pdgrpc.prefill.worker")


def transfer_failed_reason(status: RoomStatus) -> "AbortReason | ServerAbortReason":
    """A room the decode's receiver refused a write for (its ``NACK`` carries a
    :class:`~pdgrpc.transport.receiver.Refusal`) counts as a rejected write, one whose
    decode is gone (process or connection died) as a peer failure; any other failure as
    a transfer failure."""
    if status.refusal is not None:
        return ServerAbortReason.REJECTED_WRITE
    return ServerAbortReason.PEER_FAILURE if status.peer_lost else AbortReason.TRANSFER_FAILED


@dataclasses.dataclass(frozen=True)
class Sending:
    """What every room of a rank sends with (fixed at the worker's start)."""

    transport: Transport
    compute: Compute
    mailbox: "Mailbox[Signed]"  # every item genuine for its room (PrefillWorker checks)
    send_rows: MetadataBuffers
    regions: Sequence[MemoryRegion]  # registered: KV regions, then the metadata rows
    page_size: int  # tokens
    min_write_pages: int  # pages worth a write of their own
    heads: tuple[int, int]  # this rank's KV heads [start, end)
    num_kv_heads: int
    head_bytes: int
    tp_rank: int
    tp_size: int
    deadlines: SenderDeadlines
    chunk_size: int


@dataclasses.dataclass(eq=False)
class _Out:
    """One destination decode rank of a room: its transfer key, peer and op builder."""

    dest: Destination
    key: int  # transport room key (transfer_room(room, p, d))
    peer: Peer
    ops: Callable[[Sequence[int], Sequence[int]], WriteOps]
    meta_dst: Any  # RegionInfo of the row's destination region (metadata or sink)
    page_of: dict[int, int]  # local page -> this destination's page


class RoomDriver:
    """One room (one Prefill RPC on this rank); :meth:`run` drives it to the decode's ack."""

    def __init__(self, s: Sending, room: Room, pages: Sequence[int], cached_tokens: int = 0) -> None:
        self.s = s
        self.room = room
        self.pages = tuple(pages)
        self.cached_tokens = cached_tokens  # a cached prefix already in the pages: compute starts here
        self.job: ComputeJob | None = None
        self.keys: list[int] = []  # transport keys used
        self.sender: PrefillSender | None = None
        self._outs: list[_Out] = []
        self._final: tuple[WriteMetadata, list[Callable[[], Awaitable[None]]], int] | None = None
        self._token: SampledToken | None = None
        self.sent_bytes = 0
        self.first_write: float | None = None

    async def run(self, ids: Sequence[int], sampling: SamplingParams, computing: Callable[[], None] | None = None,
                  first_token: Callable[[int], None] | None = None) -> prefill_pb2.PrefillResponse:
        """``computing``: called once the compute has the prompt, before anything else of
        the room's (bookkeeping that must not delay the compute); ``first_token``: called
        with the first output token as soon as the compute posts it."""
        s, room, n = self.s, self.room, len(ids)
        # Compute starts now, not once the handshake is in: the prompt's KV does not
        # depend on where it goes, and the handshake usually lands during chunk 1.
        if tracing.enabled:
            tracing.hop("worker.queue")
        self.job = job = s.compute.begin(room, EnginePrefill(tuple(ids), self.pages, sampling), self.cached_tokens)
        job.first_token = first_token  # sent as the token arrives, even before the handshake
        if computing is not None:
            computing()
        sender = PrefillSender.create(room, self.pages, n, s.page_size, time.monotonic(), deadlines=s.deadlines,
                                         min_write_pages=s.min_write_pages)
        self.sender = sender
        dests = await self._destinations(sender)
        if len({d.cached_pages for d in dests}) > 1:
            raise ending(
                Refusal.BAD_REQUEST,
                f"room {room}: cached_pages differs between the decode ranks' handshakes ({[d.cached_pages for d in dests]})",
                ServerAbortReason.DECODE_ERROR,
            )
        sender.handle(DestinationReceived(dests[0].dst_pages, dests[0].dst_slot, dests[0].cached_pages), time.monotonic())
        if sender.state is SenderState.FAILED:
            assert sender.failure is not None
            raise ending(Refusal.BAD_REQUEST, sender.failure.message, ServerAbortReason.DECODE_ERROR)
        for dest in dests:
            self._outs.append(await self._open(dest))
            self.keys.append(self._outs[-1].key)
        plan = sender.planned_final_write() if s.compute.plans_final_write else None
        if plan is not None:
            self._final = (plan, *self._prepare(plan))
        compute_s = 0.0
        logged_transferring = False
        while not sender.last_chunk_seen:
            post = await self._next_post(sender, job)
            if post.error is not None:
                if isinstance(post.error, RequestFailed):
                    raise post.error
                raise ending(Refusal.INTERNAL, f"room {room}: prefill failed: {post.error!r}")
            if post.end <= sender.tokens_done:
                continue
            compute_s += post.seconds
            if tracing.enabled and post.end == n:
                tracing.hop("compute", end=job.computed_ns or None)
            if not post.ready.done():  # a GPU still writing the chunk's pages: wait, never block
                await post.ready.wait()
            self._token = post.token
            self._check_transport(sender)
            await self._execute(sender.handle(ChunkDone(post.end, last=post.end == n), time.monotonic()))
            if self.first_write is not None and post.end < n and not logged_transferring:
                logged_transferring = True
                request_event(log, room, "transferring", chunk_tokens=s.chunk_size, chunks=-(-n // s.chunk_size), level=logging.DEBUG)
        if tracing.enabled:  # the last write is queued
            tracing.hop("write")
        await self._acknowledged(sender)
        if tracing.enabled:
            tracing.hop("transfer")
        assert self.first_write is not None
        return prefill_pb2.PrefillResponse(
            prompt_tokens=n, bytes_transferred=self.sent_bytes, transfer_seconds=time.perf_counter() - self.first_write,
            compute_seconds=compute_s, cached_tokens=self.cached_tokens,
        )

    # ---- events --------------------------------------------------------------------------

    def _timed_out(self, fail: Fail, detail: str = "") -> RequestFailed:
        d, room = self.s.deadlines, self.room
        if fail.reason is SenderFailReason.WAITING_FOR_DESTINATION_TIMEOUT:
            msg, why = f"no decode handshake within {d.waiting_for_destination_s} s{detail}", AbortReason.BOOTSTRAP_TIMEOUT
        elif fail.reason is SenderFailReason.WAITING_FOR_INPUT_TIMEOUT:
            msg, why = f"no prefill chunk computed within {d.waiting_for_input_s} s", AbortReason.WAITING_FOR_INPUT_TIMEOUT
        else:
            msg = f"decode{detail} did not acknowledge the metadata row within {d.transferring_s} s"
            why = AbortReason.TRANSFER_TIMEOUT
        return ending(Refusal.TIMED_OUT, f"room {room}: {msg}", why)

    async def _destinations(self, sender: PrefillSender) -> list[Destination]:
        """Every handshake this rank needs for the room (one per decode rank it writes to)."""
        got: dict[int, Destination] = {}
        need: range | None = None
        while need is None or len(got) < len(need):
            try:
                dest = (await self.s.mailbox.wait(self.room, max(0.0, sender.deadline - time.monotonic()))).item
            except asyncio.TimeoutError:
                fail = sender.tick(time.monotonic())
                if fail is None:
                    continue
                missing = "" if need is None else f" (have decode tp ranks {sorted(got)} of {list(need)})"
                raise self._timed_out(fail, missing) from None
            except DuplicateHandshake as exc:
                raise ending(Refusal.ROOM_IN_USE, str(exc), ServerAbortReason.DECODE_ERROR) from None
            if isinstance(dest, RequestFailed):
                # A refused handshake, or an AbortRoom that came before this Prefill: the
                # decode side ended it.
                raise RequestFailed(dest.code, dest.message, ServerAbortReason.DECODE_ERROR)
            if need is None:
                need = receivers_of(self.s.tp_rank, self.s.tp_size, dest.decode_tp_size)
            got[dest.decode_tp_rank] = dest
        return [got[d] for d in sorted(got)]

    async def _next_post(self, sender: PrefillSender, job: ComputeJob) -> ChunkPost:
        """The compute's next post, or the sender's deadline."""
        while True:
            try:
                return await asyncio.wait_for(job.posts.get(), max(0.0, sender.deadline - time.monotonic()))
            except asyncio.TimeoutError:
                fail = sender.tick(time.monotonic())
                if fail is not None:
                    raise self._timed_out(fail) from None

    def _check_transport(self, sender: PrefillSender) -> None:
        """Stop early when the transport already failed the room (decode NACKed, peer died)."""
        for o in self._outs:
            if o.key in self.s.transport.rooms:
                st = self.s.transport.status(o.key)
                if st.state is KVPoll.FAILED:
                    sender.handle(Fail(SenderFailReason.TRANSFER_FAILED, str(st.reason)), time.monotonic())
                    raise ending(Refusal.ABORTED, f"room {self.room}: transfer failed: {st.reason}", transfer_failed_reason(st))

    async def _acknowledged(self, sender: PrefillSender) -> None:
        """Wait for every destination's SUCCESS (the metadata row landed) by the deadline."""
        for o in self._outs:
            status = await self.s.transport.wait(o.key, max(0.0, sender.deadline - time.monotonic()))
            if status.state is KVPoll.FAILED:
                sender.handle(Fail(SenderFailReason.TRANSFER_FAILED, str(status.reason)), time.monotonic())
                raise ending(Refusal.ABORTED, f"room {self.room}: transfer failed{self._to(o)}: {status.reason}",
                                    transfer_failed_reason(status))
            if status.state is not KVPoll.SUCCESS:
                fail = Fail(SenderFailReason.TRANSFER_TIMEOUT, f"room {self.room}: no acknowledgement of the metadata row")
                sender.handle(fail, time.monotonic())
                raise self._timed_out(fail, self._to(o))
        sender.handle(MetadataWritten(), time.monotonic())

    # ---- actions -------------------------------------------------------------------------

    async def _execute(self, actions: list[SenderAction]) -> None:
        assert self.sender is not None
        while actions:
            action = actions.pop(0)
            if isinstance(action, WritePages):
                await self._write(action.src, action.dst)
                # The transport lands the metadata row only after every earlier write of the
                # room, so "queued" is enough for the sender to move on.
                actions += self.sender.handle(PagesWritten(len(action.src)), time.monotonic())
            elif isinstance(action, WriteMetadata):
                assert self._token is not None
                self.s.send_rows.write_row(self.pages[-1], row_from_token(self._token, self.cached_tokens), self.room)
                if self._final is not None and self._final[0] == action:
                    _, sends, nbytes = self._final  # planned during the compute: only the sends are left
                    self.first_write = self.first_write or time.perf_counter()
                    for send in sends:
                        await send()
                    self.sent_bytes += nbytes
                else:
                    await self._write(action.src, action.dst, metadata_slot=action.slot)

    def _meta_op(self, o: _Out) -> WriteOp:
        return metadata_op(self.s.regions[-1], self.pages[-1], o.meta_dst, o.dest.dst_slot)

    def _ops_to(self, o: _Out, src: Sequence[int], dst: Sequence[int]) -> WriteOps:
        """Pages ``src`` to destination ``o``: to ``dst`` on the first destination, to the
        pages its own handshake granted on the others."""
        return o.ops(src, dst if o is self._outs[0] else [o.page_of[p] for p in src])

    async def _write(self, src: Sequence[int], dst: Sequence[int], metadata_slot: int | None = None) -> None:
        """Queue pages ``src`` (and the metadata row) to every destination."""
        self.first_write = self.first_write or time.perf_counter()
        for o in self._outs:
            ops = self._ops_to(o, src, dst) if src else None
            meta = self._meta_op(o) if metadata_slot is not None else None
            await self.s.transport.write(o.peer, o.key, ops if ops is not None else [], metadata=meta)
            self.sent_bytes += (ops.nbytes if ops is not None else 0) + (meta.length if meta is not None else 0)

    def _prepare(self, plan: WriteMetadata) -> tuple[list[Callable[[], Awaitable[None]]], int]:
        """The final write's sends, planned now while the prompt computes: the checks and
        message planning, slow right after a compute with cold caches, leave the path to
        the first token."""
        sends, nbytes = [], 0
        for o in self._outs:
            ops, meta = self._ops_to(o, plan.src, plan.dst), self._meta_op(o)
            sends.append(self.s.transport.prepare_write(o.peer, o.key, ops, metadata=meta))
            nbytes += ops.nbytes + meta.length
        return sends, nbytes

    async def _open(self, dest: Destination) -> _Out:
        s, room, n_pages = self.s, self.room, len(self.pages)
        d, tp_d = dest.decode_tp_rank, dest.decode_tp_size
        if len(dest.dst_pages) < n_pages:
            raise ending(
                Refusal.BAD_REQUEST, f"room {room}: decode tp rank {d} gave {len(dest.dst_pages)} dst_pages, the prompt needs {n_pages}",
                ServerAbortReason.DECODE_ERROR,
            )
        if dest.credential:  # the handshake that carries it was accepted as genuine
            s.transport.set_credential(dest.parsed.instance_id, dest.credential)
        try:
            peer = await s.transport.connect(dest.descriptor)
        except PdgrpcError as exc:
            raise ending(
                Refusal.GONE, f"room {room}: cannot connect to the decode's transport (decode tp rank {d}): {exc}",
                ServerAbortReason.PEER_FAILURE,
            ) from None
        pairs = region_pairs(s.regions, dest.parsed.regions)
        dst_heads = heads_of(d, tp_d, s.num_kv_heads)
        if dst_heads == s.heads:
            def ops(src: Sequence[int], dst: Sequence[int]) -> WriteOps:
                return page_ops(pairs, src, dst)
        else:
            common = (max(s.heads[0], dst_heads[0]), min(s.heads[1], dst_heads[1]))

            def ops(src: Sequence[int], dst: Sequence[int]) -> WriteOps:
                return head_slice_ops(pairs, src, dst, src_heads=s.heads, dst_heads=dst_heads, heads=common, head_bytes=s.head_bytes)
        meta_dst = dest.parsed.region(METADATA_REGION_ID if dest.wants_metadata else METADATA_SINK_REGION_ID)
        assert meta_dst is not None  # checked at handshake time
        return _Out(dest, transfer_room(room, s.tp_rank, d), peer, ops, meta_dst, dict(zip(self.pages, dest.dst_pages[:n_pages])))

    def _to(self, o: _Out) -> str:
        if self.s.tp_size == 1 and o.dest.decode_tp_size == 1:
            return ""
        return f" (tp rank {self.s.tp_rank} -> decode tp rank {o.dest.decode_tp_rank})"
