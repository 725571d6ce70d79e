"""The KV event log: replay, gaps, snapshot order, the merge across dp ranks, restarts."""

from __future__ import annotations

import random

import pytest

from pdgrpc.state.cache_events import CacheEvents, StoredBlock
from pdgrpc.state.kv_event_log import (
    Cleared, EventBatch, KvEvent, KvEventLog, KvEventMerge, Removed, Stored, stored_runs,
)


def chain(*hashes: int, parent: int | None = None, page: int = 4) -> list[StoredBlock]:
    out = []
    for h in hashes:
        out.append(StoredBlock(h, parent, tuple(range(h * page, h * page + page))))
        parent = h
    return out


def apply(state: dict[int, StoredBlock], batches: list[EventBatch]) -> dict[int, StoredBlock]:
    """What a subscriber holds after applying ``batches`` in order."""
    for b in batches:
        for e in b.events:
            if isinstance(e, Stored):
                state.update((x.block_hash, x) for x in e.blocks)  # type: ignore[misc]
            elif isinstance(e, Removed):
                for h in e.block_hashes:
                    state.pop(h, None)
            else:
                state.clear()
    return state


def live(log: KvEventLog) -> set[int]:
    """The blocks a subscriber starting now holds once caught up."""
    return set(apply({}, log.subscribe(0)))


def test_the_log_is_a_cache_events_sink() -> None:
    sink: CacheEvents = KvEventLog()  # mypy checks the structural match
    sink.stored(chain(1))
    assert isinstance(sink, KvEventLog) and sink.last_sequence == 1


def test_each_change_is_one_batch_numbered_from_one() -> None:
    log = KvEventLog()
    log.stored(chain(1, 2))
    log.removed([2])
    log.cleared()
    log.stored([])  # nothing changed: no batch
    log.removed([])
    batches = log.replay(0)
    assert batches is not None
    assert [b.sequence_number for b in batches] == [1, 2, 3]
    assert [type(b.events[0]) for b in batches] == [Stored, Removed, Cleared]
    assert live(log) == set()


def test_replay_returns_the_batches_after_the_cursor() -> None:
    log = KvEventLog(capacity=8)
    for h in range(1, 6):
        log.stored(chain(h))
    batches = log.replay(2)
    assert batches is not None and [b.sequence_number for b in batches] == [3, 4, 5]
    assert log.replay(5) == []


def test_a_cursor_the_ring_no_longer_covers_gets_a_snapshot() -> None:
    log = KvEventLog(capacity=3)
    for h in range(1, 7):
        log.stored(chain(h))
    assert log.replay(2) is None  # batches 3.. are needed; the ring holds 4..6
    assert log.replay(3) is not None
    first = log.subscribe(2)
    assert all(b.snapshot is not None for b in first)
    assert set(apply({}, first)) == {1, 2, 3, 4, 5, 6}
    # the subscriber continues after the snapshot's last number with no gap
    assert first[-1].sequence_number == log.last_sequence
    log.stored(chain(7))
    nxt = log.replay(first[-1].sequence_number)
    assert nxt is not None and [b.sequence_number for b in nxt] == [7]


def test_a_cursor_ahead_of_the_log_is_a_restarted_publisher_and_gets_a_snapshot() -> None:
    log = KvEventLog()
    log.stored(chain(1))
    assert log.replay(50) is None
    snap = log.subscribe(50)
    assert isinstance(snap[0].events[0], Cleared) and snap[0].snapshot is not None


def test_snapshot_clears_first_then_stores_parents_first_in_numbered_chunks() -> None:
    log = KvEventLog(capacity=2)
    rng = random.Random(7)
    # trees of blocks stored in an order where a re-stored parent comes after its child
    log.stored(chain(10, 11, 12))
    log.stored(chain(13, parent=11))
    log.removed([10])
    log.stored(chain(10))  # parent 10 is now newer than its children 11..13
    for h in range(20, 40):
        log.stored(chain(h, parent=rng.choice([None, 10, 12])))
    chunks = log.snapshot(chunk_blocks=5)
    assert [c.snapshot.index for c in chunks if c.snapshot] == list(range(len(chunks)))
    assert all(c.snapshot is not None and c.snapshot.count == len(chunks) for c in chunks)
    nums = [c.sequence_number for c in chunks]
    assert nums == list(range(log.last_sequence - len(chunks) + 1, log.last_sequence + 1))
    assert isinstance(chunks[0].events[0], Cleared)
    live = {10, 11, 12, 13, *range(20, 40)}
    seen: list[int] = []
    for c in chunks:
        for e in c.events:
            if isinstance(e, Stored):
                assert len(e.blocks) <= 5
                for b in e.blocks:
                    assert b.parent_hash is None or b.parent_hash in seen  # parents first
                    seen.append(b.block_hash)
    assert sorted(seen) == sorted(live)


def test_snapshot_of_an_untouched_log_is_one_cleared_chunk() -> None:
    snap = KvEventLog().snapshot()
    assert len(snap) == 1 and snap[0].sequence_number == 0 and snap[0].events == (Cleared(),)


def test_snapshot_never_numbers_below_one_once_something_happened() -> None:
    log = KvEventLog()
    log.stored(chain(*range(1, 30)))  # one batch, many blocks
    snap = log.snapshot(chunk_blocks=4)
    assert [c.sequence_number for c in snap] == [1]
    assert set(apply({}, snap)) == set(range(1, 30))


def test_a_subscriber_stays_in_step_through_random_changes() -> None:
    """Replay where the ring covers, a snapshot where not: the subscriber's state is the
    log's at every point, its sequence numbers never skip."""
    rng = random.Random(1)
    log = KvEventLog(capacity=5)
    live: set[int] = set()
    sub: dict[int, StoredBlock] = {}
    cursor = 0
    for step in range(400):
        op = rng.random()
        if op < 0.5:
            h = rng.randrange(1, 60)
            log.stored(chain(h, parent=rng.choice([None, *live]) if live else None))
            live.add(h)
        elif op < 0.9 and live:
            gone = rng.sample(sorted(live), k=min(len(live), rng.randrange(1, 3)))
            log.removed(gone)
            live -= set(gone)
        elif op >= 0.98:
            log.cleared()
            live.clear()
        if rng.random() < 0.3:  # the subscriber catches up now and then
            batches = log.subscribe(cursor, chunk_blocks=3)
            if batches and batches[0].snapshot is None:
                assert batches[0].sequence_number == cursor + 1
            apply(sub, batches)
            cursor = batches[-1].sequence_number if batches else cursor
            assert set(sub) == live, step


def test_stored_runs_cut_a_list_into_chains() -> None:
    blocks = chain(1, 2, 3) + chain(4, parent=2) + chain(5, 6)
    assert [[b.block_hash for b in r] for r in stored_runs(blocks)] == [[1, 2, 3], [4], [5, 6]]


def events_of(log: KvEventLog, after: int = 0) -> list[KvEvent]:
    return [e for b in log.replay(after) or [] for e in b.events]


def test_merge_stores_a_shared_block_once_and_removes_it_with_its_last_holder() -> None:
    merge = KvEventMerge(KvEventLog())
    merge.apply(0, [Stored(tuple(chain(1, 2)))])
    merge.apply(1, [Stored(tuple(chain(1, 2, 3)))])
    assert [[b.block_hash for b in e.blocks] for e in events_of(merge.log) if isinstance(e, Stored)] == [[1, 2], [3]]
    n = merge.log.last_sequence
    merge.apply(0, [Removed((2,))])
    assert merge.log.last_sequence == n  # rank 1 still holds 2: nothing for the instance
    merge.apply(1, [Removed((3, 2))])
    assert events_of(merge.log, n) == [Removed((3, 2))]
    assert live(merge.log) == {1}


def test_merge_clears_only_the_restarted_ranks_blocks() -> None:
    merge = KvEventMerge(KvEventLog())
    merge.apply(0, [Stored(tuple(chain(1, 2)))])
    merge.apply(1, [Stored(tuple(chain(1, 5)))])
    n = merge.log.last_sequence
    merge.apply(0, [Cleared()])  # its worker died
    evs = events_of(merge.log, n)
    assert evs == [Removed((2,))]  # 1 stays: rank 1 holds it
    assert live(merge.log) == {1, 5}
    # the new worker's first batch: cleared, then its own stores
    merge.apply(0, [Cleared(), Stored(tuple(chain(1, 7)))])
    assert [type(e) for e in events_of(merge.log, n + 1)] == [Stored]
    assert live(merge.log) == {1, 5, 7}


def test_merge_applies_a_ranks_snapshot_as_a_resync() -> None:
    rank = KvEventLog(capacity=1)
    merge = KvEventMerge(KvEventLog())
    rank.stored(chain(1, 2, 3))
    merge.apply(0, [e for b in rank.subscribe(0) for e in b.events])
    rank.removed([3])
    rank.stored(chain(4, parent=2))
    rank.stored(chain(5))
    for b in rank.subscribe(1):  # the ring lost 2..: a snapshot
        merge.apply(0, b.events)
    assert set(apply({}, merge.log.replay(0) or [])) == {1, 2, 4, 5}


def test_merged_stream_equals_the_union_of_the_ranks() -> None:
    rng = random.Random(3)
    ranks = [KvEventLog() for _ in range(3)]
    merge = KvEventMerge(KvEventLog(capacity=100000))
    cursors = [0, 0, 0]
    for _ in range(500):
        r = rng.randrange(3)
        held = sorted(live(ranks[r]))
        op = rng.random()
        if op < 0.55:
            ranks[r].stored(chain(rng.randrange(1, 30)))
        elif op < 0.95 and held:
            ranks[r].removed(rng.sample(held, k=1))
        else:
            ranks[r].cleared()
        for i, log in enumerate(ranks):
            for b in log.subscribe(cursors[i]):
                merge.apply(i, b.events)
                cursors[i] = b.sequence_number
        assert live(merge.log) == set().union(*map(live, ranks))


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="capacity"):
        KvEventLog(capacity=0)
