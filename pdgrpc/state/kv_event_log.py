"""The prefix cache's event log: numbered batches of stored, removed and cleared blocks.

One :class:`KvEventLog` per publisher (a dp rank's cache, or a prefill instance's merged
stream). It is the cache's :class:`~pdgrpc.state.cache_events.CacheEvents` sink: each
call becomes one :class:`EventBatch` whose sequence number is the previous one's plus one,
kept in a ring of the last ``capacity`` batches, and the set of live blocks is kept beside
it. A subscriber that knows sequence ``n`` gets the batches after ``n`` while the ring still
holds them (:meth:`KvEventLog.replay`), else a snapshot (:meth:`KvEventLog.snapshot`):
chunks that clear first and then store every live block, parents first, numbered so that
live batches continue after the last chunk with no gap.

:class:`KvEventMerge` turns the dp ranks' streams into one stream per prefill instance: a
block several ranks hold is stored once and removed with its last holder, and a rank that
restarts loses only its own blocks.

Pure: no I/O, no clock but the one passed in; the drivers (the worker's and the
controller's ``SubscribeKvEvents``) wait for new batches and send them.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from typing import Callable, Iterable, Protocol, Sequence

__all__ = [
    "Block", "Cleared", "EventBatch", "KvEvent", "KvEventLog", "KvEventMerge", "Removed", "SnapshotChunk", "Stored",
    "stored_runs",
]

# How many blocks one snapshot chunk carries at most: a page of 64 token ids is ~0.3 KiB on
# the wire, so a chunk stays far below gRPC's 4 MiB message limit.
SNAPSHOT_CHUNK_BLOCKS = 2048


class Block(Protocol):
    """One full KV page of a prefix (:class:`pdgrpc.state.cache_events.StoredBlock`)."""

    @property
    def block_hash(self) -> int: ...

    @property
    def parent_hash(self) -> int | None: ...

    @property
    def token_ids(self) -> tuple[int, ...]: ...


@dataclasses.dataclass(frozen=True)
class Stored:
    blocks: tuple[Block, ...]  # parents before children


@dataclasses.dataclass(frozen=True)
class Removed:
    block_hashes: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Cleared:
    pass


KvEvent = Stored | Removed | Cleared


@dataclasses.dataclass(frozen=True)
class SnapshotChunk:
    index: int  # 0-based
    count: int  # chunks in the snapshot


@dataclasses.dataclass(frozen=True)
class EventBatch:
    sequence_number: int
    events: tuple[KvEvent, ...]
    timestamp: float = 0.0  # seconds since the epoch, from the log's clock
    snapshot: SnapshotChunk | None = None  # set on a snapshot's chunks


def _parents_first(blocks: Iterable[Block]) -> list[Block]:
    """``blocks`` ordered so that a block whose parent is among them comes after it."""
    by_hash = {b.block_hash: b for b in blocks}
    children: dict[int | None, list[Block]] = {}
    for b in by_hash.values():
        parent = b.parent_hash if b.parent_hash in by_hash and b.parent_hash != b.block_hash else None
        children.setdefault(parent, []).append(b)
    out: list[Block] = []
    stack = list(reversed(children.get(None, [])))
    while stack:
        b = stack.pop()
        out.append(b)
        stack.extend(reversed(children.get(b.block_hash, [])))
    return out  # a parent cycle (never made by a hash chain) leaves its blocks out


def stored_runs(blocks: Sequence[Block]) -> list[list[Block]]:
    """``blocks`` cut into chains: in each run every block's parent is the block before it.
    smg's ``KvBlocksStored`` carries one parent for a whole chain."""
    runs: list[list[Block]] = []
    for b in blocks:
        if runs and b.parent_hash == runs[-1][-1].block_hash:
            runs[-1].append(b)
        else:
            runs.append([b])
    return runs


class KvEventLog:
    """A publisher's numbered batches and live blocks (see the module doc)."""

    def __init__(self, capacity: int = 4096, clock: Callable[[], float] = lambda: 0.0,
                 on_append: Callable[[], None] = lambda: None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._ring: deque[EventBatch] = deque(maxlen=capacity)
        self._live: dict[int, Block] = {}
        self._clock = clock
        self._on_append = on_append  # wakes the drivers' subscribers
        self.last_sequence = 0  # of the newest batch; 0 before the first

    # ---- CacheEvents -------------------------------------------------------------------

    def stored(self, blocks: Sequence[Block]) -> None:
        for b in blocks:
            self._live[b.block_hash] = b
        if blocks:
            self._append((Stored(tuple(blocks)),))

    def removed(self, block_hashes: Sequence[int]) -> None:
        for h in block_hashes:
            self._live.pop(h, None)
        if block_hashes:
            self._append((Removed(tuple(block_hashes)),))

    def cleared(self) -> None:
        self._live.clear()
        self._append((Cleared(),))

    # ---- what others read --------------------------------------------------------------

    def append(self, events: Sequence[KvEvent]) -> None:
        """Record ``events`` as one batch (a merged stream's, :class:`KvEventMerge`)."""
        for e in events:
            if isinstance(e, Stored):
                self._live.update((b.block_hash, b) for b in e.blocks)
            elif isinstance(e, Removed):
                for h in e.block_hashes:
                    self._live.pop(h, None)
            else:
                self._live.clear()
        if events:
            self._append(tuple(events))

    def _append(self, events: tuple[KvEvent, ...]) -> None:
        self.last_sequence += 1
        self._ring.append(EventBatch(self.last_sequence, events, self._clock()))
        self._on_append()

    def replay(self, after: int) -> list[EventBatch] | None:
        """The batches numbered after ``after``, or ``None`` when the ring no longer holds
        the first of them or ``after`` is not a sequence of this log (it is ahead of it:
        the subscriber knew an earlier publisher)."""
        if after > self.last_sequence:
            return None
        if after == self.last_sequence:
            return []
        oldest = self._ring[0].sequence_number if self._ring else self.last_sequence + 1
        if after + 1 < oldest:
            return None
        # From the newest end: a subscriber that keeps up asks for the last few batches,
        # and copying the whole ring for them would cost every subscriber every wake-up.
        wanted = self.last_sequence - after
        return list(itertools.islice(reversed(self._ring), wanted))[::-1]

    def snapshot(self, chunk_blocks: int = SNAPSHOT_CHUNK_BLOCKS) -> list[EventBatch]:
        """The live state as chunks: chunk 0 begins with :class:`Cleared`, then every live
        block, parents first. The chunks carry consecutive sequence numbers ending at
        :attr:`last_sequence`, so the next live batch follows the last chunk; there are at
        most ``last_sequence`` of them (one, numbered 0, for a log that never changed)."""
        blocks = _parents_first(self._live.values())
        per = max(1, chunk_blocks)
        count = max(1, -(-len(blocks) // per))
        if count > max(1, self.last_sequence):  # too few numbers: fuller chunks
            count = max(1, self.last_sequence)
            per = -(-len(blocks) // count)
        now = self._clock()
        first = self.last_sequence - count + 1
        out: list[EventBatch] = []
        for i in range(count):
            part = blocks[i * per:(i + 1) * per]
            events: list[KvEvent] = [Cleared()] if i == 0 else []
            if part:
                events.append(Stored(tuple(part)))
            out.append(EventBatch(max(0, first + i), tuple(events), now, SnapshotChunk(i, count)))
        return out

    def subscribe(self, after: int, chunk_blocks: int = SNAPSHOT_CHUNK_BLOCKS) -> list[EventBatch]:
        """What a subscriber who applied ``after`` (0: nothing) gets first: the replay when
        the ring covers it, else the snapshot."""
        batches = self.replay(after)
        return self.snapshot(chunk_blocks) if batches is None else batches


class KvEventMerge:
    """The dp ranks' events merged into one stream, :attr:`log` (see the module doc)."""

    def __init__(self, log: KvEventLog) -> None:
        self.log = log
        self._holders: dict[int, set[int]] = {}  # block hash -> dp ranks holding it
        self._blocks: dict[int, set[int]] = {}  # dp rank -> block hashes it holds

    def apply(self, rank: int, events: Iterable[KvEvent]) -> None:
        """Rank ``rank``'s batch (or snapshot chunk): appends what changed for the instance
        to :attr:`log` as one batch, or nothing when nothing did."""
        out: list[KvEvent] = []
        for e in events:
            if isinstance(e, Stored):
                new = [b for b in e.blocks if self._hold(rank, b.block_hash)]
                if new:
                    out.append(Stored(tuple(new)))
            elif isinstance(e, Removed):
                gone = tuple(h for h in e.block_hashes if self._release(rank, h))
                if gone:
                    out.append(Removed(gone))
            else:  # the rank restarted or flushed: what no other rank holds is gone
                gone = self._release_all(rank)
                if gone:
                    out.append(Removed(gone))
        self.log.append(out)

    def _hold(self, rank: int, h: int) -> bool:
        ranks = self._holders.setdefault(h, set())
        first = not ranks
        if rank in ranks:
            return False
        ranks.add(rank)
        self._blocks.setdefault(rank, set()).add(h)
        return first

    def _release(self, rank: int, h: int) -> bool:
        ranks = self._holders.get(h)
        if ranks is None or rank not in ranks:
            return False
        ranks.discard(rank)
        self._blocks[rank].discard(h)
        if ranks:
            return False
        del self._holders[h]
        return True

    def _release_all(self, rank: int) -> tuple[int, ...]:
        return tuple(h for h in list(self._blocks.get(rank, ())) if self._release(rank, h))
