"""What every TP rank of a decode instance does for the transfers, the same way.

Rank 0 (:class:`~pdgrpc.decode.scheduler.DecodeScheduler`) and the other ranks
(:class:`~pdgrpc.decode.follower_server.Follower`) each hold a :class:`RankTransfers`: this
rank's metadata rows (and the sink rows, see :mod:`pdgrpc.serving.tp`), its decode
queues, and its transport rooms per request (one per prefill rank that writes to it).
Each rank advertises its own grants, polls its own transport and releases its own rooms
through it, so the rule for each lives here once.
"""

from __future__ import annotations

from typing import Iterable

import torch

from pdgrpc.decode.job import SchedulerConfig
from pdgrpc.engine.base import Engine, PrefillRequest, SampledToken
from pdgrpc.kvpoll import KVPoll
from pdgrpc.serving.metadata import metadata_layout
from pdgrpc.serving.tp import METADATA_SINK_REGION_ID, senders_of, transfer_room
from pdgrpc.state import AbortReason, DecodeQueues, MetadataBuffers
from pdgrpc.transport.base import MemoryRegion, RegionKind, RoomGrant, Transport, UnknownRoom
from pdgrpc.transport.pages import kv_regions, metadata_region

__all__ = ["RankTransfers", "make_buffers", "make_queues", "prefill_locally"]

UNTRACKED = "the transport no longer tracks the room"


def make_buffers(num_slots: int) -> MetadataBuffers:
    return MetadataBuffers(num_slots, metadata_layout())


def make_queues(buffers: MetadataBuffers, num_pages: int, config: SchedulerConfig, vocab_size: int | None = None) -> DecodeQueues:
    """The decode queues as every rank builds them (identical, for the TP replay).
    ``vocab_size``: landed metadata rows are checked against it before commit."""
    return DecodeQueues(buffers, num_pages, config.deadlines, config.query_interval_s, vocab_size=vocab_size)


class RankTransfers:
    """One decode rank's rows, queues and transport rooms (see the module doc)."""

    def __init__(self, transport: Transport, engine: Engine, queues: DecodeQueues, rank: int = 0, tp_size: int = 1) -> None:
        self.transport = transport
        self.engine = engine
        self.queues = queues
        self.buffers = queues.buffers
        self.rank, self.tp_size = rank, tp_size
        # Rows written by the prefill ranks that are not this rank's designated metadata
        # writer (TP sizes differ): the same slot, never read (pdgrpc.serving.tp).
        self.sink = torch.zeros_like(self.buffers.tensor)
        self._keys: dict[int, list[int]] = {}  # transport rooms per room, until released
        # Quarantined rooms -> the transport instance ids of the prefill workers that may
        # still write into them on this rank (until the transport confirms them gone).
        self._writers: dict[int, tuple[str, ...]] = {}

    async def register(self) -> bytes:
        """Register the KV pool, the metadata rows and the sink rows; this rank's descriptor."""
        kv = self.engine.kv_buffers()
        sink = MemoryRegion(METADATA_SINK_REGION_ID, self.sink, RegionKind.METADATA, "metadata-sink")
        return await self.transport.register([*kv_regions(kv.k, kv.v), metadata_region(self.buffers.tensor), sink])

    def track(self, room: int, prefill_tp: int) -> None:
        """``room``'s transport rooms on this rank: one per prefill rank it waits for."""
        if prefill_tp == 1 and self.tp_size == 1:
            self._keys[room] = [room]
        else:
            self._keys[room] = [transfer_room(room, p, self.rank) for p in senders_of(self.rank, self.tp_size, prefill_tp)]

    def keys(self, room: int) -> list[int]:
        return self._keys.get(room) or [room]

    def advertise(self, room: int, prompt_pages: tuple[int, ...], slot: int) -> None:
        """Grant ``room``'s writers the prompt's pages and the slot (before the handshake:
        a prefill that writes at once finds the grant). The rooms are bound: only the
        writers named in :meth:`bind_writer` may write into them. Raises what the
        transport raises."""
        for key in self.keys(room):
            self.transport.advertise(RoomGrant.of(key, prompt_pages, slot, bound=True))

    def bind_writer(self, room: int, prefill_tp_rank: int, writer_id: str) -> None:
        """Admit the prefill worker ``writer_id`` (of prefill tp rank ``prefill_tp_rank``)
        into ``room``'s transport room on this rank, before its handshake goes out (a room
        no longer tracked here is left alone)."""
        keys = self._keys.get(room)
        if keys is None:
            return
        key = room if keys == [room] else transfer_room(room, prefill_tp_rank, self.rank)
        if key in keys:
            self.transport.bind_writer(key, writer_id)

    def status(self, room: int) -> tuple[KVPoll, str | None, AbortReason]:
        """This rank's transport state of ``room`` (its least advanced transport room) and,
        when FAILED, the transport's reason and the abort reason it means
        (``PEER_FAILURE`` when the transport failed it because its peer is gone)."""
        try:
            st = min((self.transport.status(k) for k in self.keys(room)), key=lambda s: s.state)
        except UnknownRoom:
            return KVPoll.FAILED, UNTRACKED, AbortReason.TRANSFER_FAILED
        if st.state is KVPoll.FAILED:
            why = AbortReason.PEER_FAILURE if st.peer_lost else AbortReason.TRANSFER_FAILED
            return KVPoll.FAILED, st.reason or "no reason given", why
        return st.state, None, AbortReason.TRANSFER_FAILED

    def transfer_started(self, room: int) -> float | None:
        """``time.monotonic()`` when the first KV byte for ``room`` arrived on this rank
        (the earliest of its transport rooms), or None."""
        times = [t for t in (self.transport.transfer_started(k) for k in self.keys(room)) if t is not None]
        return min(times) if times else None

    def release(self, room: int, abort_message: str | None = None) -> None:
        """Release ``room``'s transport rooms; an aborted room's message goes into the
        refusal of any write that comes for it later, so the prefill reports the cause."""
        for key in self._keys.pop(room, ()):
            if abort_message is None:
                self.transport.release(key)
            else:
                self.transport.release_because(key, abort_message)

    def watch_writers(self, room: int, writers: Iterable[str]) -> None:
        """``room`` is quarantined and ``writers`` (transport instance ids) are who could
        still write into it on this rank; :meth:`check_writers` follows them. A writer
        whose id is unknown ("") can never be confirmed gone: the room then waits for
        the ack or the lease."""
        ids = tuple(writers)
        if ids and all(ids):
            self._writers[room] = ids

    def check_writers(self) -> None:
        """Tell the queues each quarantined room whose writers this rank's transport
        confirmed gone (``Transport.writer_gone``: process gone, connections drained).
        Every rank calls it before its poll; the pages are reused once every rank agrees
        (:meth:`~pdgrpc.state.DecodeQueues.on_writers_gone`)."""
        for room, ids in list(self._writers.items()):
            if not self.queues.is_quarantined(room):
                del self._writers[room]  # released meanwhile (acked, lease)
            elif all(self.transport.writer_gone(w) for w in ids):
                self.queues.on_writers_gone(room)
                del self._writers[room]

    def stats(self, active_requests: int, evictable: int = 0) -> dict[str, int]:
        """What this rank holds (GetStats, the live metrics), read from its queues;
        ``evictable`` cached pages no request holds count as free."""
        q = self.queues
        return dict(
            active_requests=active_requests,
            slots_in_use=q.slots.num_slots - q.slots.num_free,
            slots_total=q.slots.num_slots,
            pages_in_use=q.pages.num_pages - q.pages.num_free - q.pages.num_quarantined - evictable,
            pages_quarantined=q.pages.num_quarantined,
            pages_total=q.pages.num_pages,
            transport_rooms=len(self.transport.rooms),
            transport_foreign_writes=self.transport.foreign_writes,
        )


def prefill_chunks(engine: Engine, plan: list[tuple[PrefillRequest, int, int]]) -> list[SampledToken | BaseException | None]:
    """Local prefills: compute each ``(request, start, end)`` chunk of one step (every TP
    rank, in the same order); a request's last chunk gives its first token."""
    out: list[SampledToken | BaseException | None] = []
    for req, start, end in plan:
        try:
            out.append(engine.prefill_chunk(req, start, end))
        except Exception as exc:
            out.append(exc)
    return out


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
