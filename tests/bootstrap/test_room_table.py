"""RoomTable, the pure room → dp-rank table: semantics, cap, TTL, and a reference model."""

from __future__ import annotations

import collections
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdgrpc.bootstrap.errors import InvalidBootstrapRequest, RoomConflict, RoomQuotaFull, RoomTableFull
from pdgrpc.bootstrap.table import W, RoomTable


def check_invariants(t: RoomTable) -> None:
    """The table is consistent (size, lookups, overflow counts, cap, ring, quotas), and its
    stats agree."""
    t.check()
    assert t.stats.size == len(t) <= t.max_rooms


def q(t: RoomTable, rooms: list[int], now: float) -> dict[int, int]:
    out: dict[int, int] = {}
    for i in range(0, len(rooms), t.max_batch):
        found, ranks, _ = t.query(rooms[i : i + t.max_batch], now)
        out.update(zip(found, ranks))
    return out


@pytest.mark.parametrize("n", [3, 100])  # the per-room path and the numpy path
def test_register_then_query_batch(n: int) -> None:
    t = RoomTable(ttl=10, max_rooms=1000, max_batch=500)
    rooms = list(range(1, n + 1))
    res = t.register(rooms, [r % 4 for r in rooms], now=0)
    assert (res.added, res.unchanged, res.evicted) == (n, 0, 0)
    found, ranks, missing = t.query(rooms + [10**9, 2**64 - 1], now=1)
    assert found == rooms and ranks == [r % 4 for r in rooms]
    assert missing == [10**9, 2**64 - 1]
    check_invariants(t)


@pytest.mark.parametrize("n", [2, 50, 100])  # the per-room paths and the numpy paths
def test_room_zero_is_refused_and_changes_nothing(n: int) -> None:
    t = RoomTable(max_rooms=100, max_batch=100)
    rooms = list(range(1, n)) + [0]
    with pytest.raises(InvalidBootstrapRequest, match="0 means not written"):
        t.register(rooms, [0] * n, now=0)
    assert len(t) == 0
    t.register(rooms[:-1], [0] * (n - 1), now=0)
    with pytest.raises(InvalidBootstrapRequest, match="0 means not written"):
        t.query(rooms, now=0)
    assert t.held(0) == n - 1  # no room of the refused query counts as queried


@pytest.mark.parametrize("n", [1, 40])
def test_batch_over_the_limit_is_refused(n: int) -> None:
    t = RoomTable(max_rooms=100, max_batch=n)
    with pytest.raises(InvalidBootstrapRequest, match=f"limit of {n}"):
        t.register(list(range(1, n + 2)), [0] * (n + 1), now=0)
    with pytest.raises(InvalidBootstrapRequest, match=f"limit of {n}"):
        t.query(list(range(1, n + 2)), now=0)
    assert len(t) == 0


@pytest.mark.parametrize("n", [2, 50])
def test_rank_range_checked_only_once_dp_size_is_known(n: int) -> None:
    t = RoomTable(max_rooms=100, max_batch=64)
    rooms = list(range(1, n + 1))
    with pytest.raises(InvalidBootstrapRequest, match=r"dp_rank 7 is outside \[0, dp_size=4\)"):
        t.register(rooms, [1] * (n - 1) + [7], now=0, dp_size=4)
    assert len(t) == 0
    t.register(rooms, [1] * (n - 1) + [7], now=0)  # topology unknown: accepted
    assert q(t, rooms, 0)[rooms[-1]] == 7


@pytest.mark.parametrize("n", [3, 60])
def test_same_rank_is_idempotent_other_rank_conflicts_all_or_none(n: int) -> None:
    t = RoomTable(ttl=10, max_rooms=1000, max_batch=100)
    t.register([5], [2], now=0)
    res = t.register([5], [2], now=1)
    assert (res.added, res.unchanged) == (0, 1)
    batch = list(range(100, 100 + n)) + [5]
    with pytest.raises(RoomConflict) as e:
        t.register(batch, [1] * n + [3], now=1)
    assert "bootstrap_room 5" in str(e.value) and "dp_rank 2" in str(e.value) and "dp_rank 3" in str(e.value)
    assert (e.value.room, e.value.registered_rank, e.value.requested_rank) == (5, 2, 3)
    assert q(t, batch, 1) == {5: 2}  # nothing of the bad batch landed
    check_invariants(t)


@pytest.mark.parametrize("n", [3, 60])
def test_conflict_inside_one_batch(n: int) -> None:
    t = RoomTable(max_rooms=1000, max_batch=100)
    rooms = list(range(1, n)) + [1]
    with pytest.raises(RoomConflict, match="bootstrap_room 1"):
        t.register(rooms, [0] * (n - 1) + [1], now=0)
    assert len(t) == 0
    res = t.register(rooms, [0] * n, now=0)  # a repeat with the same rank is fine
    assert (res.added, res.unchanged) == (n - 1, 1)


def test_ttl_expiry_is_exact_for_readers_and_swept_incrementally() -> None:
    t = RoomTable(ttl=10.0, max_rooms=100_000, max_batch=65536)
    rooms = list(range(1, 50_001))
    t.register(rooms[:25_000], [1] * 25_000, now=0.0)
    t.register(rooms[25_000:], [2] * 25_000, now=5.0)
    assert len(q(t, rooms, 9.999)) == 50_000
    assert len(q(t, rooms, 10.0)) == 25_000  # the first half expired, not yet swept
    assert len(t) == 50_000
    steps = []
    while (n := t.expire(10.0, budget=4096)) == 4096:
        steps.append(n)
    assert len(steps) == 6 and len(t) == 25_000 and t.stats.expired == 25_000
    assert t.expire(14.9, budget=4096) == 0
    # re-registering renews: the renewed room outlives its batch
    t.register([rooms[-1]], [2], now=14.95)
    t.expire(15.0, budget=100_000)
    assert len(t) == 1 and q(t, [rooms[-1]], 24.9) == {rooms[-1]: 2}
    assert q(t, [rooms[-1]], 24.95) == {}
    t.expire(25.0)
    assert len(t) == 0 and t.stats.expired == 50_000
    check_invariants(t)


def test_an_expired_room_may_be_registered_again_with_another_rank() -> None:
    t = RoomTable(ttl=1.0, max_rooms=10, max_batch=10)
    t.register([9], [1], now=0)
    with pytest.raises(RoomConflict):
        t.register([9], [2], now=0.5)
    assert t.register([9], [2], now=1.0).added == 1
    assert q(t, [9], 1.0) == {9: 2}


@pytest.mark.parametrize("batch", [1, 50])
def test_at_the_cap_the_oldest_unqueried_rooms_make_space_and_queried_ones_stay(batch: int) -> None:
    """A registrant flooding a full table evicts the oldest rooms no decode has asked for;
    a room a decode has queried stays, and new registrations keep succeeding."""
    t = RoomTable(ttl=100, max_rooms=100, max_batch=50)
    rooms = list(range(1, 301))
    for i in range(0, 100, batch):
        t.register(rooms[i : i + batch], [0] * batch, now=i / 100)
    queried = rooms[:100:2]
    assert len(q(t, queried, 1.0)) == 50
    for i in range(100, 300, batch):
        assert t.register(rooms[i : i + batch], [0] * batch, now=2.0).added == batch
    assert t.stats.evicted == t.stats.evicted_full == 200 and len(t) == 100
    assert sorted(q(t, rooms, 3.0)) == queried + rooms[250:]  # the queried ones and the newest
    check_invariants(t)


def test_a_table_of_queried_rooms_refuses_new_ones_and_keeps_all() -> None:
    t = RoomTable(ttl=100, max_rooms=4, max_batch=4)
    t.register([1, 2, 3, 4], [0, 0, 0, 0], now=0)
    assert len(q(t, [1, 2, 3, 4], 0)) == 4
    with pytest.raises(RoomTableFull, match="4 live rooms of max_rooms=4; refusing 1 new room"):
        t.register([1, 5], [0, 0], now=1)  # 1 renewed, 5 new: all or none
    assert sorted(q(t, [1, 2, 3, 4, 5], 1)) == [1, 2, 3, 4] and t.stats.evicted == 0
    assert t.register([1, 2], [0, 0], now=1).unchanged == 2
    check_invariants(t)


@pytest.mark.parametrize("batch", [1, 20])
def test_a_registrant_over_its_quota_is_refused_and_the_others_are_not(batch: int) -> None:
    t = RoomTable(ttl=100, max_rooms=100, max_batch=20)
    flood = iter(range(1000, 2000))
    for _ in range(40 // batch):
        t.register([next(flood) for _ in range(batch)], [0] * batch, now=0, registrant=1, quota=40)
    with pytest.raises(RoomQuotaFull, match=f"holds 40 rooms no decode has queried of its quota of 40; refusing {batch}"):
        t.register([next(flood) for _ in range(batch)], [0] * batch, now=0, registrant=1, quota=40)
    assert t.register([1, 2], [0, 0], now=0, registrant=0, quota=40).added == 2  # another registrant
    assert len(q(t, list(range(1000, 1000 + batch)), 1)) == batch  # a decode takes some of the flood's rooms
    assert t.register([next(flood) for _ in range(batch)], [0] * batch, now=1, registrant=1, quota=40).added == batch
    assert t.stats.evicted == 0 and len(t) == 42 + batch
    check_invariants(t)


@pytest.mark.parametrize("n", [3, 100])  # the per-room path and the numpy path
def test_a_registrants_own_lookups_leave_its_rooms_in_its_quota_and_evictable(n: int) -> None:
    t = RoomTable(ttl=100, max_rooms=2 * n, max_batch=n)
    mine = list(range(1000, 1000 + n))
    t.register(mine, [0] * n, now=0, registrant=1, quota=n)
    assert len(t.query(mine, 1, querier=1)[0]) == n  # found, but not a decode's lookup
    assert t.held(1) == n
    with pytest.raises(RoomQuotaFull):
        t.register([5000], [0], now=1, registrant=1, quota=n)
    others = list(range(1, n + 1))
    t.register(others, [1] * n, now=2, registrant=0, quota=n)
    assert len(t.query(others, 2, querier=1)[0]) == n  # another registrant's rooms: queried
    assert t.held(0) == 0
    # The table is full: new rooms evict registrant 1's self-queried ones, never the queried.
    t.register(list(range(7000, 7000 + n)), [0] * n, now=3, registrant=2, quota=n)
    assert t.stats.evicted_full == n and q(t, mine, 3) == {} and len(q(t, others, 3)) == n
    check_invariants(t)


def test_a_full_table_never_evicts_a_room_the_same_batch_renews() -> None:
    t = RoomTable(ttl=100, max_rooms=4, max_batch=4)
    t.register([1, 2, 3, 4], [0, 0, 0, 0], now=0)
    res = t.register([1, 5], [0, 0], now=1)  # room 1 is the oldest, but this call renews it
    assert (res.added, res.unchanged) == (1, 1) and t.stats.evicted_full == 1
    assert sorted(q(t, [1, 2, 3, 4, 5], 1)) == [1, 3, 4, 5]
    check_invariants(t)


def test_at_the_cap_expired_rooms_make_space() -> None:
    t = RoomTable(ttl=1, max_rooms=3, max_batch=3)
    t.register([1, 2, 3], [0, 0, 0], now=0)
    res = t.register([4, 5], [0, 0], now=5)
    assert res.evicted == 0 and res.added == 2 and t.stats.expired == 3


def test_renewals_cannot_grow_memory() -> None:
    t = RoomTable(ttl=1000, max_rooms=8, max_batch=8)
    rooms = list(range(1, 9))
    for i in range(200):  # each call re-registers every room: the ring refills with stale records
        t.register(rooms, [1] * 8, now=i)
        assert t.stats.pending_records <= t.ring_records
    assert sorted(q(t, rooms, 200)) == rooms and t.stats.evicted == 0
    check_invariants(t)


def test_one_room_renewals_that_fill_the_ring_evict_the_oldest_live_room() -> None:
    """Calls of one room take their own path; when renewals have filled the ring, the
    next call evicts the oldest live room (counted), as a batch's would."""
    t = RoomTable(ttl=1000, max_rooms=8, max_batch=1, ring_records=8)
    for room in (1, 2, 3, 4):
        t.register([room], [0], now=0)
    for i in range(4):  # the ring's 8 records: rooms 1-4, then 4 renewed four times
        assert t.register([4], [0], now=i).unchanged == 1
    res = t.register([4], [0], now=5)
    assert (res.added, res.unchanged, res.evicted) == (0, 1, 1)
    assert q(t, [1, 2, 3, 4], 5) == {2: 0, 3: 0, 4: 0} and t.stats.evicted == 1
    check_invariants(t)


def test_validates_configuration() -> None:
    with pytest.raises(InvalidBootstrapRequest):
        RoomTable(ttl=0)
    with pytest.raises(InvalidBootstrapRequest):
        RoomTable(max_rooms=10, max_batch=11)
    with pytest.raises(InvalidBootstrapRequest):
        RoomTable(max_rooms=0, max_batch=1)


def colliding_rooms(t: RoomTable, count: int, seed: int = 0) -> list[int]:
    """Rooms whose home is bucket 0: enough of them overflow into buckets 1, 2, ..."""
    rng, out = random.Random(seed), []
    while len(out) < count:
        room = rng.getrandbits(64) or 1
        if t.home_bucket(room) == 0:
            out.append(room)
    return out


@pytest.mark.parametrize("n", [1, 40])
def test_overflowing_buckets(n: int) -> None:
    t = RoomTable(ttl=10, max_rooms=64, max_batch=64, seed=3)  # 8 buckets of 16 slots
    rooms = colliding_rooms(t, 60)
    for i in range(0, 60, n):
        t.register(rooms[i : i + n], [i % 3] * len(rooms[i : i + n]), now=1)
    check_invariants(t)
    assert [t.overflow(b) for b in range(4)] == [44, 28, 12, 0]  # 60 rooms: 16 home, 44 pushed past bucket 0, ...
    assert len(q(t, rooms, 1)) == 60
    missing = colliding_rooms(t, 200, seed=1)[100:]  # probe along the chain and stop
    assert q(t, missing, 1) == {}
    t.expire(11)
    assert len(t) == 0 and not any(t.overflow(b) for b in range(8))
    check_invariants(t)


# --------------------------------------------------------------------- reference model


class Model:
    """The table's behaviour with dicts and a deque, no hashing, no numpy."""

    def __init__(self, ttl: float, max_rooms: int, max_batch: int, ring: int) -> None:
        self.ttl, self.max_rooms, self.max_batch, self.ring_cap = ttl, max_rooms, max_batch, ring
        self.rooms: dict[int, tuple[int, int, float]] = {}  # room -> (rank, seq, time)
        self.ring: collections.deque[tuple[int, int, float]] = collections.deque()  # (seq, room, time)
        self.seq = 0
        self.now = float("-inf")
        self.expired = self.evicted = self.evicted_full = 0
        self.queried: set[int] = set()
        self.pinned: set[int] = set()
        self.owner: dict[int, int] = {}
        self.cursor = 0

    def held(self, registrant: int) -> int:
        return sum(1 for r in self.rooms if r not in self.queried and self.owner[r] == registrant)

    def _pop(self, n: int, now: float) -> None:
        for _ in range(n):
            seq, room, t = self.ring.popleft()
            if room in self.rooms and self.rooms[room][1] == seq:
                if t + self.ttl > now and (room in self.queried or room in self.pinned):
                    self._append(room, self.rooms[room][0], t)  # kept: requeued, time unchanged
                    continue
                del self.rooms[room]
                self.queried.discard(room)
                if t + self.ttl <= now:
                    self.expired += 1
                else:
                    self.evicted += 1

    def _append(self, room: int, rank: int, now: float) -> None:
        self.rooms[room] = (rank, self.seq, now)
        self.ring.append((self.seq, room, now))
        self.seq += 1

    def expire(self, now: float) -> None:
        self.now = now = max(now, self.now)
        while self.ring and self.ring[0][2] + self.ttl <= now:
            self._pop(1, now)

    def query(self, rooms: list[int], now: float) -> tuple[list[int], list[int], list[int]]:
        if len(rooms) > self.max_batch or 0 in rooms:
            raise InvalidBootstrapRequest("")
        found = [r for r in rooms if r in self.rooms and self.rooms[r][2] + self.ttl > now]
        self.queried.update(found)
        return found, [self.rooms[r][0] for r in found], [r for r in rooms if r not in found]

    def register(
        self, rooms: list[int], ranks: list[int], now: float, dp_size: int | None, registrant: int = 0, quota: int | None = None
    ) -> tuple[int, int, int]:
        if len(rooms) > self.max_batch:
            raise InvalidBootstrapRequest("")
        self.now = now = max(now, self.now)
        if any(r == 0 or (dp_size is not None and k >= dp_size) for r, k in zip(rooms, ranks)):
            raise InvalidBootstrapRequest("")
        want: dict[int, int] = {}
        for r, k in zip(rooms, ranks):
            if want.setdefault(r, k) != k:
                raise RoomConflict(r, want[r], k)
        evicted_before = self.evicted
        while True:
            for r in want:
                if r in self.rooms and self.rooms[r][2] + self.ttl <= now:
                    del self.rooms[r]
                    self.queried.discard(r)
                    self.expired += 1
            for r, k in want.items():
                if r in self.rooms and self.rooms[r][0] != k:
                    raise RoomConflict(r, self.rooms[r][0], k)
            renew = [r for r in want if r in self.rooms]
            new = [r for r in want if r not in self.rooms]
            if len(want) <= self.ring_cap - len(self.ring):
                break
            popped = 0
            while len(want) > self.ring_cap - len(self.ring):
                if popped >= self.ring_cap:
                    raise RoomTableFull(len(self.rooms), self.max_rooms, len(want))
                d = len(want) - (self.ring_cap - len(self.ring))
                self._pop(d, now)
                popped += d
        if quota is not None and self.held(registrant) + len(new) > quota:
            self.expire(now)
            if self.held(registrant) + len(new) > quota:
                raise RoomQuotaFull(self.held(registrant), quota, len(new))
        if len(self.rooms) + len(new) > self.max_rooms:
            self.expire(now)
            need = len(self.rooms) + len(new) - self.max_rooms
            self.pinned = {r for r in renew if r not in self.queried}
            if need > 0 and need > len(self.rooms) - len(self.queried) - len(self.pinned):
                raise RoomTableFull(len(self.rooms), self.max_rooms, len(new))
            before = self.evicted
            for seq, room, t in list(self.ring):  # on from the cursor, oldest first
                if len(self.rooms) + len(new) <= self.max_rooms:
                    break
                if seq < self.cursor:
                    continue
                self.cursor = seq + 1
                if room in self.rooms and self.rooms[room][1] == seq and room not in self.queried and room not in self.pinned:
                    del self.rooms[room]
                    if t + self.ttl <= now:
                        self.expired += 1
                    else:
                        self.evicted += 1
            self.evicted_full += self.evicted - before
            self.pinned = set()
        for r in renew:
            self._append(r, want[r], now)
        for r in new:
            self._append(r, want[r], now)
            self.owner[r] = registrant
        return len(new), len(rooms) - len(new), self.evicted - evicted_before


def op_lists(min_batch: int, max_batch: int = 24) -> st.SearchStrategy[list]:
    batch = st.lists(st.tuples(st.sampled_from(range(40)), st.integers(0, 3)), min_size=min_batch, max_size=max_batch)
    rooms = st.lists(st.sampled_from(range(40)), min_size=min_batch, max_size=max_batch)
    return st.lists(
        st.one_of(
            st.tuples(st.just("register"), batch, st.floats(0, 3), st.sampled_from([None, 3, 4]), st.sampled_from([0, 1]),
                      st.sampled_from([None, None, 4, 20])),
            st.tuples(st.just("query"), rooms, st.floats(0, 3), st.none(), st.none(), st.none()),
            st.tuples(st.just("expire"), st.just([]), st.floats(0, 3), st.none(), st.none(), st.none()),
        ),
        max_size=40,
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    # 17+: every batch takes the numpy path; exactly 1: every call takes the one-room path
    ops=st.one_of(op_lists(0), op_lists(17), op_lists(1, 1)),
    ttl=st.sampled_from([1.0, 5.0]),
    max_rooms=st.sampled_from([6, 24, 100]),
    small_ring=st.booleans(),  # a ring that renewals fill up: exercises its evictions
)
def test_matches_reference_model(ops: list, ttl: float, max_rooms: int, small_ring: bool) -> None:
    max_batch = min(24, max_rooms)
    t = RoomTable(ttl=ttl, max_rooms=max_rooms, max_batch=max_batch, seed=7, ring_records=max_batch if small_ring else None)
    # 40 candidate rooms, most of them with the same home bucket (overflow chains).
    pool = colliding_rooms(t, 30, seed=11) + [random.Random(i).getrandbits(63) or 1 for i in range(9)] + [0]
    m = Model(ttl, max_rooms, t.max_batch, t.ring_records)
    now = 0.0
    for kind, args, dt, dp_size, registrant, quota in ops:
        now += dt
        if kind == "register":
            rooms, ranks = [pool[i] for i, _ in args], [k for _, k in args]
            try:
                want = m.register(rooms, ranks, now, dp_size, registrant, quota)
            except (InvalidBootstrapRequest, RoomConflict, RoomTableFull) as exc:
                with pytest.raises(type(exc)) as raised:
                    t.register(rooms, ranks, now, dp_size=dp_size, registrant=registrant, quota=quota)
                assert type(raised.value) is type(exc)
            else:
                got = t.register(rooms, ranks, now, dp_size=dp_size, registrant=registrant, quota=quota)
                assert (got.added, got.unchanged, got.evicted) == want
        elif kind == "query":
            rooms = [pool[i] for i in args]
            try:
                want_q = m.query(rooms, now)
            except InvalidBootstrapRequest:
                with pytest.raises(InvalidBootstrapRequest):
                    t.query(rooms, now)
            else:
                assert t.query(rooms, now) == want_q
        else:
            m.expire(now)
            while t.expire(now, budget=5) == 5:
                pass
        assert (t.stats.expired, t.stats.evicted, t.stats.evicted_full, len(t)) == (m.expired, m.evicted, m.evicted_full, len(m.rooms))
        assert [t.held(0), t.held(1)] == [m.held(0), m.held(1)]
    check_invariants(t)
