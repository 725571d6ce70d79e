"""A KV event log on an event loop: the prefix cache's sink, its subscribers, its wire form.

:class:`KvEventFeed` holds a :class:`~pdgrpc.state.kv_event_log.KvEventLog` owned by one
event loop. It is the cache's :class:`~pdgrpc.state.cache_events.CacheEvents` sink from
any thread (a call from another thread is handed to the loop, in order; what it reports
within :data:`BATCH_WINDOW_S` is one batch), and
:meth:`KvEventFeed.follow` is what one ``SubscribeKvEvents`` stream sends: the replay or
snapshot :meth:`~pdgrpc.state.kv_event_log.KvEventLog.subscribe` answers, then each new
batch; a subscriber that fell out of the ring gets a snapshot again, so it never sees a gap.

:func:`batch_to_proto` and :func:`batch_from_proto` convert to and from
``pdgrpc.v1.KvEventBatch``.

One client (:func:`~pdgrpc.rpc.security.peer_identity`) holds at most
:data:`MAX_STREAMS_PER_CLIENT` streams of a feed open: each costs the server a snapshot and
a stream, and a router opens one per instance it routes to. One more is refused
``RESOURCE_EXHAUSTED`` naming the limit.

A decode's stream opens with initial metadata :data:`CAPABILITIES_KEY`: what it does
beyond taking a prefill's KV, comma-separated (:data:`LOCAL_PREFILL`). A router flags a
request only for a decode that lists the flag; an older decode lists nothing, and its
requests keep going through a prefill.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import AsyncIterator, Callable, Sequence

import grpc

from pdgrpc.rpc.open_calls import OpenCalls
from pdgrpc.state.cache_events import StoredBlock
from pdgrpc.state.kv_event_log import (
    Cleared, EventBatch, KvEvent, KvEventLog, Removed, SnapshotChunk, Stored,
)
from pdgrpc.v1 import prefill_pb2

__all__ = [
    "BATCH_WINDOW_S", "CAPABILITIES_KEY", "LOCAL_PREFILL", "MAX_STREAMS_PER_CLIENT", "KvEventFeed", "batch_from_proto", "batch_to_proto",
    "capabilities", "serve_kv_events",
]

CAPABILITIES_KEY = "pdgrpc-decode-capabilities"
MAX_STREAMS_PER_CLIENT = 64  # open SubscribeKvEvents streams of one feed per client
# What a prefill's cache reports within this many seconds of its first report is one batch.
# A prompt is announced as its compute starts, when the compute and the prompt's other
# processes want both cores; its relay through the controller and the router waits until the
# compute has one and the other is idle. Under load, fewer and larger batches travel.
BATCH_WINDOW_S = 0.005
LOCAL_PREFILL = "local-prefill"  # DecodeRequest.local_prefill: the decode computes the prompt


def capabilities(metadata: Sequence[tuple[str, str | bytes]] | None) -> frozenset[str]:
    """The capabilities a stream's initial metadata lists (none when absent)."""
    out: set[str] = set()
    for key, value in metadata or ():
        if key == CAPABILITIES_KEY and isinstance(value, str):
            out.update(v.strip() for v in value.split(",") if v.strip())
    return frozenset(out)


class KvEventFeed:
    """See the module doc. Build it on the loop it serves."""

    def __init__(
        self, capacity: int = 4096, on_subscribers: Callable[[int], None] | None = None,
        max_streams_per_client: int = MAX_STREAMS_PER_CLIENT, window_s: float = BATCH_WINDOW_S,
    ) -> None:
        """``on_subscribers(n)``: called with the number of open :meth:`follow` streams
        whenever it changes. ``window_s``: see :data:`BATCH_WINDOW_S`; 0: what one turn of
        the loop reports."""
        self._on_subscribers = on_subscribers
        self._window_s = window_s
        self.streams = OpenCalls(max_streams_per_client, "SubscribeKvEvents", "pdgrpc.serving.kv_events.MAX_STREAMS_PER_CLIENT")
        self.subscribers = 0
        self._loop = asyncio.get_running_loop()
        self._thread = threading.get_ident()
        self._waiters: list[asyncio.Future[None]] = []
        self._closed = False
        self._pending: list[KvEvent] = []  # reported within the window, appended at its end
        self.log = KvEventLog(capacity, clock=time.time, on_append=self._wake)

    # ---- CacheEvents: from any thread --------------------------------------------------
    # What the cache reports within the window becomes one batch: a prompt's evictions and
    # its announcement travel as one message to each subscriber, and on to theirs, rather
    # than two.

    def stored(self, blocks: Sequence[StoredBlock]) -> None:
        if blocks:
            self._call(Stored(tuple(blocks)))

    def removed(self, block_hashes: Sequence[int]) -> None:
        if block_hashes:
            self._call(Removed(tuple(block_hashes)))

    def cleared(self) -> None:
        self._call(Cleared())

    def _call(self, event: KvEvent) -> None:
        if threading.get_ident() == self._thread:
            self._add(event)
        elif not self._loop.is_closed():  # a cache still changing after shutdown tells no one
            self._loop.call_soon_threadsafe(self._add, event)

    def _add(self, event: KvEvent) -> None:
        if not self._pending:
            if self._window_s:
                self._loop.call_later(self._window_s, self._flush)
            else:
                self._loop.call_soon(self._flush)
        self._pending.append(event)

    def _flush(self) -> None:
        events, self._pending = self._pending, []
        self.log.append(events)

    # ---- subscribers -------------------------------------------------------------------

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for f in waiters:
            if not f.done():
                f.set_result(None)

    async def close(self) -> None:
        """End every subscriber's stream: a server stopping must not wait its whole grace
        for streams that never end by themselves."""
        self._closed = True
        self._wake()

    async def wait(self, after: int, timeout: float | None = None) -> list[EventBatch]:
        """The batches after ``after`` (a snapshot when the ring lost some), waiting up to
        ``timeout`` seconds for one; ``[]`` when none came."""
        if self.log.last_sequence == after and not self._closed:
            f: asyncio.Future[None] = self._loop.create_future()
            self._waiters.append(f)
            try:
                await asyncio.wait_for(f, timeout)
            except asyncio.TimeoutError:
                return []
            finally:
                if f in self._waiters:
                    self._waiters.remove(f)
        return self.log.subscribe(after)

    async def follow(self, after: int, idle_s: float | None = None) -> AsyncIterator[list[EventBatch]]:
        """What one subscriber who applied ``after`` gets: the first answer (possibly
        ``[]``), then each group of new batches; ``[]`` after each ``idle_s`` without one;
        until :meth:`close`."""
        self._subscribed(1)
        try:
            first = self.log.subscribe(after)
            yield first
            cursor = first[-1].sequence_number if first else after
            while not self._closed:
                batches = await self.wait(cursor, idle_s)
                if self._closed:
                    return
                if batches:
                    cursor = batches[-1].sequence_number
                yield batches
        finally:
            self._subscribed(-1)

    def _subscribed(self, delta: int) -> None:
        self.subscribers += delta
        if self._on_subscribers is not None:
            self._on_subscribers(self.subscribers)


def _add_event(out: prefill_pb2.KvEventBatch, e: KvEvent) -> None:
    """Append ``e`` to ``out``, built in place: a block message constructed apart is
    copied again into its batch, and a prompt stores a block per page."""
    ev = out.events.add()
    if isinstance(e, Stored):
        stored = ev.stored
        for b in e.blocks:
            block = stored.blocks.add(block_hash=b.block_hash, token_ids=b.token_ids)
            if b.parent_hash is not None:
                block.parent_hash = b.parent_hash
        if not e.blocks:
            stored.SetInParent()
    elif isinstance(e, Removed):
        ev.removed.block_hashes.extend(e.block_hashes)
        ev.removed.SetInParent()
    else:
        ev.cleared.SetInParent()


def batch_to_proto(b: EventBatch) -> prefill_pb2.KvEventBatch:
    out = prefill_pb2.KvEventBatch(sequence_number=b.sequence_number, timestamp=b.timestamp)
    for e in b.events:
        _add_event(out, e)
    if b.snapshot is not None:
        out.snapshot_index, out.snapshot_count = b.snapshot.index, b.snapshot.count
    return out


def _event_from_proto(e: prefill_pb2.KvEvent) -> KvEvent | None:
    kind = e.WhichOneof("event")
    if kind == "stored":
        return Stored(tuple(
            StoredBlock(b.block_hash, b.parent_hash if b.HasField("parent_hash") else None, tuple(b.token_ids))
            for b in e.stored.blocks
        ))
    if kind == "removed":
        return Removed(tuple(e.removed.block_hashes))
    if kind == "cleared":
        return Cleared()
    return None  # a kind this version does not know


def batch_from_proto(b: prefill_pb2.KvEventBatch) -> EventBatch:
    events = tuple(e for e in map(_event_from_proto, b.events) if e is not None)
    chunk = SnapshotChunk(b.snapshot_index, b.snapshot_count) if b.snapshot_count else None
    return EventBatch(b.sequence_number, events, b.timestamp, chunk)


async def serve_kv_events(
    feed: KvEventFeed, request: prefill_pb2.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext,
) -> AsyncIterator[prefill_pb2.KvEventBatch]:
    """One ``pdgrpc.v1.PrefillService/SubscribeKvEvents`` stream over ``feed``, for a client
    under its limit of open streams (else ``RESOURCE_EXHAUSTED``)."""
    async with feed.streams.held(context):
        async for batches in feed.follow(request.start_sequence_number):
            for b in batches:
                yield batch_to_proto(b)
