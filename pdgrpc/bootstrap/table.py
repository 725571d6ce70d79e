"""The room → prefill dp-rank table: TTL, a hard cap, incremental expiry. Pure.

At the cap (``max_rooms`` live rooms) a batch with new rooms evicts the oldest rooms that
no decode has queried yet (counted in ``evicted_full``); a queried room is never evicted,
because a decode is about to use it. Refusing instead let one registrant that loops
``RegisterDpRanks`` make every other registration fail for a whole TTL; evicting the
oldest unqueried rooms confines the harm to rooms nobody has asked for. Only when every
live room has been queried is a batch with new rooms refused whole with
:class:`~pdgrpc.bootstrap.errors.RoomTableFull` (RESOURCE_EXHAUSTED). Size ``max_rooms``
for the rooms registered within one TTL.

No I/O, no threads, no clock: every call that depends on time takes ``now`` (seconds,
any monotonic origin). The server calls :meth:`RoomTable.expire` from a background task
in small steps; tests call it directly with a fake ``now``.

Why not a dict
--------------
A ``dict`` of a million 63-bit rooms costs ~140 MB after churn (int objects, dummy
slots, a 3x growth step) and its resize stops the process. This table
preallocates flat numpy arrays sized from ``max_rooms``, so it never resizes, costs a
fixed ~62 bytes per room of capacity (pages are touched as rooms arrive), and batch
operations are vectorised.

Layout
------
* **Hash table** (:class:`~pdgrpc.bootstrap.room_slots.RoomSlots`, the storage half):
  ``2 * max_rooms`` slots in buckets of 16, open addressing with per-bucket overflow
  counts, no tombstones, load <= 50 %.
* **Ring of registrations**, in time order: (slot, time) per registration, plus the
  slot's ``seq`` (the ring index of its latest registration, mod 2**32). Expiry and
  ring-space eviction pop from the head, a full table's eviction scans on from a
  cursor; a record whose slot has been re-registered since
  (renewed) or freed no longer matches ``seq`` and is skipped. The ring holds
  ``2 * max_rooms`` records (by default); if renewals ever fill it, the oldest unqueried
  live rooms are evicted (counted). A popped record of a live queried room is appended
  again with its registration time, so ring times are only roughly in order: expiry
  frees the due prefix, and a due record behind a live one waits (readers check the
  time, so it is invisible).
* **Flags** per slot: queried (a decode found the room), pinned (being renewed by the
  call in progress: never evicted by it); and its **registrant** (a small int the caller
  gives), with a count per registrant of its stored rooms no decode has queried.

Quota
-----
``register(..., registrant=i, quota=q)`` refuses new rooms with
:class:`~pdgrpc.bootstrap.errors.RoomQuotaFull` while registrant ``i`` holds ``q`` rooms
no decode has queried: one registrant looping ``RegisterDpRanks`` then hits its own quota
instead of evicting the others' rooms. A lookup by the room's own registrant
(``query(..., querier=i)``) does not count as a decode's: a credential that may both
register and query would otherwise make its rooms unevictable and leave its quota.

Expiry is exact for readers (a lookup checks the registration time, so an expired room
is missing even before the sweep reaches it) and incremental for memory: one
``expire(now, budget)`` step frees at most ``budget`` records, a few hundred
microseconds of vectorised work.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from pdgrpc.bootstrap.defaults import DEFAULT_MAX_BATCH, DEFAULT_MAX_ROOMS, DEFAULT_TTL_S, MAX_ROOMS_LIMIT
from pdgrpc.bootstrap.errors import InvalidBootstrapRequest, RoomConflict, RoomQuotaFull, RoomTableFull
from pdgrpc.bootstrap.room_slots import W, RoomSlots, pow2_at_least

_M64 = (1 << 64) - 1


def _distinct(a: np.ndarray) -> np.ndarray:
    """The distinct values of ``a``, sorted (a sort: np.unique hashes, several times slower here)."""
    s = np.sort(a)
    if len(s) > 1:
        s = s[np.concatenate(([True], s[1:] != s[:-1]))]
    return s
_M32 = (1 << 32) - 1
_SMALL = 16  # batches up to this size take the per-room (pure Python) path: less overhead
# Lookups of up to this many rooms go room by room too: numpy's code is cold between two
# calls, and its fixed cost is then most of what a few dozen lookups cost.
_FEW_LOOKUPS = 64
_QUERIED = 1  # a decode found the room: never evicted
_PINNED = 2  # renewed by the call in progress: that call does not evict it


@dataclasses.dataclass(frozen=True)
class RegisterResult:
    added: int  # rooms new to the table
    unchanged: int  # rooms already registered with the same rank (TTL renewed)
    evicted: int  # live rooms this call evicted (only when renewals filled the ring)


_ADDED_ONE = RegisterResult(1, 0, 0)  # results of a one-room call (frozen: shared)
_RENEWED_ONE = RegisterResult(0, 1, 0)


@dataclasses.dataclass(frozen=True)
class TableStats:
    size: int  # rooms stored (live, or expired and not yet swept)
    max_rooms: int
    registered: int  # registrations accepted, ever (renewals included)
    expired: int  # rooms removed because their TTL passed
    evicted: int  # live unqueried rooms removed, oldest first (a full table or a full ring)
    evicted_full: int  # of those, the rooms evicted because the table was full
    pending_records: int  # ring records not yet popped (size + stale renewals)


class RoomTable(RoomSlots):
    """room → dp rank with TTL and a hard cap; see the module docstring for the layout.

    All-or-none: a call that raises has changed nothing visible (it may have dropped
    rooms that had already expired, which no reader could see anyway).
    """

    def __init__(
        self,
        *,
        ttl: float = DEFAULT_TTL_S,
        max_rooms: int = DEFAULT_MAX_ROOMS,
        max_batch: int = DEFAULT_MAX_BATCH,
        seed: int | None = None,
        ring_records: int | None = None,
    ) -> None:
        """``seed`` fixes the hash (tests); ``ring_records`` sizes the ring (default: the
        power of two >= 2 * max_rooms; at least max_batch)."""
        if not ttl > 0:
            raise InvalidBootstrapRequest(f"ttl must be > 0 seconds, got {ttl}")
        if not 1 <= max_rooms <= MAX_ROOMS_LIMIT:
            raise InvalidBootstrapRequest(f"max_rooms must be in [1, {MAX_ROOMS_LIMIT}], got {max_rooms}")
        if not 1 <= max_batch <= max_rooms:
            raise InvalidBootstrapRequest(f"max_batch must be in [1, max_rooms={max_rooms}], got {max_batch}")
        self.ttl = float(ttl)
        self.max_rooms = max_rooms
        self.max_batch = max_batch
        super().__init__(max_rooms, seed)
        self._seq = np.zeros(len(self._keys), np.uint32)
        self._flags = np.zeros(len(self._keys), np.uint8)
        self._owner = np.zeros(len(self._keys), np.uint16)
        self._held: list[int] = []  # per registrant: its stored rooms no decode has queried
        nring = pow2_at_least(max(max_batch, ring_records or 2 * max_rooms))
        self._rmask = nring - 1
        self._ring_slot = np.zeros(nring, np.uint32)
        self._ring_time = np.zeros(nring, np.float64)
        # Memoryviews for the per-room paths, as in RoomSlots: plain Python ints and floats.
        self._seq_v = self._seq.data
        self._flags_v = self._flags.data
        self._ring_slot_v = self._ring_slot.data
        self._ring_time_v = self._ring_time.data.cast("B").cast("d")
        self._head = 0  # absolute index of the oldest record
        self._tail = 0  # absolute index of the next record
        # Eviction of a full table scans from here: every record before it is stale or a
        # queried room's (queried stays queried), so no record is scanned twice per lap.
        self._cursor = 0
        self._now = float("-inf")
        self._registered = 0
        self._expired = 0
        self._evicted = 0
        self._evicted_full = 0
        self._queried_live = 0  # stored rooms with the queried flag

    # ------------------------------------------------------------------ public API

    def held(self, registrant: int) -> int:
        """Stored rooms of ``registrant`` that no decode has queried (what its quota counts)."""
        return self._held[registrant] if registrant < len(self._held) else 0

    def __len__(self) -> int:
        return self._size

    @property
    def ring_records(self) -> int:
        """Registrations the ring holds, stale renewals included (``pending_records`` of
        :attr:`stats` never exceeds it)."""
        return len(self._ring_slot)

    def check(self) -> None:
        """Raise :class:`AssertionError` naming the first broken invariant: the hash
        table's (:meth:`RoomSlots.check`), then the cap, the ring's bound, and what each
        registrant's quota counts. Reads every slot: for tests."""
        super().check()
        if self._size > self.max_rooms:
            raise AssertionError(f"{self._size} rooms are stored, over max_rooms={self.max_rooms}")
        if self._tail - self._head > len(self._ring_slot):
            raise AssertionError(f"{self._tail - self._head} records pending in a ring of {len(self._ring_slot)}")
        stored = self._keys != 0
        queried = stored & ((self._flags & _QUERIED) != 0)
        if int(np.count_nonzero(queried)) != self._queried_live:
            raise AssertionError(f"{np.count_nonzero(queried)} stored rooms are queried, the count says {self._queried_live}")
        held = np.bincount(self._owner[stored & ~queried], minlength=len(self._held)).tolist()
        if held != self._held:
            raise AssertionError(f"unqueried rooms per registrant are {held}, the quotas count {self._held}")

    @property
    def stats(self) -> TableStats:
        return TableStats(self._size, self.max_rooms, self._registered, self._expired, self._evicted, self._evicted_full,
                          self._tail - self._head)

    def register(
        self, rooms: Sequence[int] | np.ndarray, ranks: Sequence[int] | np.ndarray, now: float, *, dp_size: int | None = None,
        registrant: int = 0, quota: int | None = None,
    ) -> RegisterResult:
        """Register ``rooms[i] → ranks[i]``, all or none, for ``registrant`` (a small int
        >= 0), whose unqueried rooms may not exceed ``quota`` (None: no quota).

        Raises :class:`InvalidBootstrapRequest` (room 0, batch over ``max_batch``, a rank outside
        ``[0, dp_size)`` when ``dp_size`` is given) or :class:`RoomConflict` (a room
        registered, here or earlier in the same batch, with a different rank).
        Re-registering with the same rank renews the room's TTL (its registrant stays the
        first one). Over the quota raises :class:`RoomQuotaFull`.
        """
        n = len(rooms)
        if n != len(ranks):
            raise InvalidBootstrapRequest(f"{n} rooms but {len(ranks)} ranks")
        self._check_batch(n)
        if not 0 <= registrant <= 0xFFFF:
            raise InvalidBootstrapRequest(f"registrant must be in [0, 65535], got {registrant}")
        if registrant >= len(self._held):
            self._held.extend([0] * (registrant + 1 - len(self._held)))
        now = self._advance(now)
        who = (registrant, quota)
        if n == 1:
            return self._register_one(int(rooms[0]), int(ranks[0]), now, dp_size, who)
        if n <= _SMALL:
            return self._register_small(rooms, ranks, now, dp_size, who)
        return self._register_many(np.asarray(rooms, np.uint64), np.asarray(ranks, np.int64), now, dp_size, who)

    def query(
        self, rooms: Sequence[int] | np.ndarray, now: float, querier: int | None = None,
    ) -> tuple[list[int], list[int], list[int]]:
        """Look rooms up: ``(found_rooms, their_ranks, missing_rooms)``, each in request
        order. Unknown or expired rooms are missing, not an error; room 0 and batches
        over ``max_batch`` raise :class:`InvalidBootstrapRequest`. A found room becomes
        queried (never evicted, out of its registrant's quota) unless ``querier``, the
        caller's registrant number, registered it (see Quota above)."""
        n = len(rooms)
        self._check_batch(n)
        if n <= _FEW_LOOKUPS:
            if 0 in rooms:  # before any lookup marks a room queried: a refused call changes nothing
                raise InvalidBootstrapRequest("bootstrap_room 0 is invalid: 0 means not written")
            found: list[int] = []
            ranks: list[int] = []
            missing: list[int] = []
            keys, rank, seq, times, flags = self._keys_v, self._rank_v, self._seq_v, self._ring_time_v, self._flags_v
            mult, shift, rmask, ttl = self._mult, self._shift, self._rmask, self.ttl
            for room in rooms:
                base = (((room * mult) & _M64) >> shift) * W  # the home bucket (home_bucket), inlined
                row = keys[base : base + W].tolist()
                s = base + row.index(room) if room in row else self._find(room)
                if s >= 0 and times[seq[s] & rmask] + ttl > now:
                    found.append(room)
                    ranks.append(rank[s])
                    if not flags[s] & _QUERIED and (querier is None or self._owner[s] != querier):
                        flags[s] |= _QUERIED
                        self._queried_live += 1
                        self._held[self._owner[s]] -= 1
                else:
                    missing.append(room)
            return found, ranks, missing
        found_a, ranks_a, missing_a = self.query_array(np.asarray(rooms, np.uint64), now, querier)
        return found_a.tolist(), ranks_a.tolist(), missing_a.tolist()

    def query_array(
        self, keys: np.ndarray, now: float, querier: int | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`query` on and to numpy arrays (uint64 rooms; uint32 ranks)."""
        self._check_batch(len(keys))
        if not keys.all():
            raise InvalidBootstrapRequest("bootstrap_room 0 is invalid: 0 means not written")
        slots = self._find_many(keys)
        hit = slots >= 0
        if hit.all():  # the usual case: every room is in the table
            hs = slots
            alive = self._alive_many(slots, now)
        else:
            hs = slots[hit]
            alive = hit
            alive[hit] = self._alive_many(hs, now)
        if alive.all():
            self._mark_queried(hs, querier)
            return keys, np.take(self._rank, hs), keys[:0]
        self._mark_queried(slots[alive], querier)
        return keys[alive], np.take(self._rank, slots[alive]), keys[~alive]

    def _mark_queried(self, slots: np.ndarray, querier: int | None) -> None:
        fresh = slots[(np.take(self._flags, slots) & _QUERIED) == 0]
        if querier is not None and len(fresh):
            fresh = fresh[np.take(self._owner, fresh) != querier]
        if len(fresh):
            fresh = _distinct(fresh)
            self._flags[fresh] |= _QUERIED
            self._queried_live += len(fresh)
            self._release(fresh)

    def _release(self, slots: np.ndarray) -> None:
        """Rooms at ``slots`` stop counting against their registrants' quotas."""
        counts = np.bincount(self._owner[slots], minlength=len(self._held))
        for o in np.flatnonzero(counts).tolist():
            self._held[o] -= int(counts[o])

    def _alive_many(self, slots: np.ndarray, now: float) -> np.ndarray:
        # np.take rather than fancy indexing: several times faster on random rows.
        seq = np.take(self._seq, slots) & np.uint32(self._rmask)
        alive: np.ndarray = np.take(self._ring_time, seq) + self.ttl > now
        return alive

    def expire(self, now: float, budget: int = 16384) -> int:
        """Free rooms whose TTL has passed, looking at no more than ``budget`` records.
        Returns the number of records consumed; ``== budget`` means call again."""
        now = self._advance(now)
        k = min(budget, self._tail - self._head)
        if k <= 0:
            return 0
        idx = np.arange(self._head, self._head + k, dtype=np.int64)
        due = self._ring_time[idx & self._rmask] + self.ttl <= now
        n = k if due.all() else int(np.argmin(due))  # the due prefix (requeued records break the order)
        if n:
            self._pop_head(n, now)
        return n

    # ------------------------------------------------------------------ internals

    def _check_batch(self, n: int) -> None:
        if n > self.max_batch:
            raise InvalidBootstrapRequest(f"batch of {n} rooms is over the limit of {self.max_batch} per call; split it")

    def _advance(self, now: float) -> float:
        # The ring is kept in time order, so time never runs backwards here.
        if now > self._now:
            self._now = float(now)
        return self._now

    def _alive(self, slot: int, now: float) -> bool:
        return self._ring_time_v[self._seq_v[slot] & self._rmask] + self.ttl > now

    def _append(self, slots: np.ndarray | list[int], now: float) -> None:
        m = len(slots)
        assert self._tail - self._head + m <= len(self._ring_slot), "ring space not reserved"
        if isinstance(slots, list):  # a few rooms: scalar stores beat array set-up
            for s in slots:
                seq = self._tail
                self._ring_slot_v[seq & self._rmask] = s
                self._ring_time_v[seq & self._rmask] = now
                self._seq_v[s] = seq & _M32
                self._tail += 1
            self._registered += m
            return
        seqs = np.arange(self._tail, self._tail + m, dtype=np.int64)
        idx = seqs & self._rmask
        self._ring_slot[idx] = slots
        self._ring_time[idx] = now
        self._seq[slots] = seqs & _M32
        self._tail += m
        self._registered += m

    def _pop_head(self, n: int, now: float) -> int:
        """Consume the ``n`` oldest records, deleting rooms they still own. Rooms past
        their TTL count as expired, unqueried live ones as evicted; a live queried (or
        pinned) room keeps its place: its record is appended again, time unchanged.
        Returns rooms deleted."""
        seqs = np.arange(self._head, self._head + n, dtype=np.int64)
        slots = self._ring_slot[seqs & self._rmask].astype(np.int64)
        own = (self._keys[slots] != 0) & (self._seq[slots] == (seqs & _M32))
        self._head += n
        live = slots[own]
        if not len(live):
            return 0
        times = self._ring_time[seqs[own] & self._rmask]
        due = times + self.ttl <= now
        keep = ~due & (self._flags[live] != 0)
        if keep.any():
            self._requeue(live[keep], times[keep])
            live = live[~keep]
        ndue = int(np.count_nonzero(due))
        self._expired += ndue
        self._evicted += len(live) - ndue
        self._drop(live)
        return len(live)

    def _requeue(self, slots: np.ndarray, times: np.ndarray) -> None:
        seqs = np.arange(self._tail, self._tail + len(slots), dtype=np.int64)
        idx = seqs & self._rmask
        self._ring_slot[idx] = slots
        self._ring_time[idx] = times
        self._seq[slots] = seqs & _M32
        self._tail += len(slots)

    def _drop(self, slots: np.ndarray) -> None:
        """Delete stored rooms, clearing their flags."""
        queried = (self._flags[slots] & _QUERIED) != 0
        self._queried_live -= int(np.count_nonzero(queried))
        self._release(slots[~queried])
        self._flags[slots] = 0
        self._delete(slots)

    def _ring_space(self, records: int, now: float) -> bool:
        """Pop the oldest records until ``records`` more fit in the ring. Needed only when
        renewals have filled it with stale records. Returns whether anything was popped."""
        free = len(self._ring_slot) - (self._tail - self._head)
        if records <= free:
            return False
        popped = 0
        while records > free:
            if popped >= len(self._ring_slot):  # every record is a queried live room's
                raise RoomTableFull(self._size, self.max_rooms, records)
            self._pop_head(records - free, now)
            popped += records - free
            free = len(self._ring_slot) - (self._tail - self._head)
        return True

    def _check_quota(self, new: int, now: float, who: tuple[int, int | None]) -> None:
        """Raise :class:`RoomQuotaFull` if ``new`` rooms take the registrant over its
        quota once expired rooms are swept."""
        registrant, quota = who
        if quota is None or self._held[registrant] + new <= quota:
            return
        while self._head < self._tail and self.expire(now) > 0:
            if self._held[registrant] + new <= quota:
                return
        raise RoomQuotaFull(self._held[registrant], quota, new)

    def _own(self, slots: np.ndarray | list[int], registrant: int) -> None:
        self._owner[slots] = registrant
        self._held[registrant] += len(slots)

    def _check_room(self, new: int, now: float, renew: np.ndarray | list[int]) -> None:
        """Make ``new`` more rooms fit under max_rooms: sweep expired rooms, then evict the
        oldest unqueried ones other than ``renew`` (the batch's own). Raise
        :class:`RoomTableFull`, having evicted nothing, when even that is not enough."""
        if self._size + new <= self.max_rooms:
            return
        while self._head < self._tail and self.expire(now) > 0:
            if self._size + new <= self.max_rooms:
                return
        need = self._size + new - self.max_rooms
        renew_a = _distinct(np.asarray(renew, np.int64))
        pin = renew_a[(self._flags[renew_a] & _QUERIED) == 0]
        if need > self._size - self._queried_live - len(pin):
            raise RoomTableFull(self._size, self.max_rooms, new)
        self._flags[pin] |= _PINNED
        before = self._evicted
        try:
            while self._size + new > self.max_rooms:
                self._pop_victims(self._size + new - self.max_rooms, now)
        finally:
            self._flags[pin] &= ~np.uint8(_PINNED)
        self._evicted_full += self._evicted - before

    def _pop_victims(self, need: int, now: float) -> None:
        """Delete the ``need`` oldest unqueried, unpinned rooms, scanning on from the
        cursor; their records go stale in place."""
        c = max(self._cursor, self._head)
        while need > 0 and c < self._tail:
            k = min(self._tail - c, max(need, 256))
            seqs = np.arange(c, c + k, dtype=np.int64)
            slots = self._ring_slot[seqs & self._rmask].astype(np.int64)
            victim = (self._keys[slots] != 0) & (self._seq[slots] == (seqs & _M32)) & (self._flags[slots] == 0)
            count = np.cumsum(victim)
            if count[-1] >= need:
                k = int(np.searchsorted(count, need)) + 1
                victim, slots, seqs = victim[:k], slots[:k], seqs[:k]
            gone = slots[victim]
            ndue = int(np.count_nonzero(self._ring_time[seqs[victim] & self._rmask] + self.ttl <= now))
            self._expired += ndue
            self._evicted += len(gone) - ndue
            self._drop(gone)
            need -= len(gone)
            c += k
        self._cursor = c

    # Registering a batch, both paths: (1) validate; (2) classify every room as renewed or
    # new, freeing rooms that expired but were not swept yet, and raise on a conflict —
    # nothing visible has changed yet; (3) make ring space (if that evicted a room being
    # renewed, classify again); (4) refuse the batch if its new rooms do not fit under
    # max_rooms once expired rooms are swept; (5) renew, so renewed rooms are the newest;
    # (6) insert the new rooms.

    def _register_one(self, room: int, rank: int, now: float, dp_size: int | None, who: tuple[int, int | None]) -> RegisterResult:
        """One room, in the usual cases: a new room where there is space, or a live room
        renewed; steps (3)-(4) need nothing then. Anything else (an expired room not yet
        swept, a full ring, a full table) goes through :meth:`_register_small`."""
        if not (0 < room <= _M64 and 0 <= rank <= _M32 and (dp_size is None or rank < dp_size)):
            self._check_entry(room, rank, dp_size)  # raises, naming what is wrong
        b = ((room * self._mult) & _M64) >> self._shift  # the home bucket (home_bucket), inlined
        base = b * W
        row: list[int] = self._keys_v[base : base + W].tolist()
        s = base + row.index(room) if room in row else self._find(room) if self._ovf_v[b] else -1
        tail = self._tail
        if tail - self._head > self._rmask:  # the ring is full
            return self._register_small((room,), (rank,), now, dp_size, who)
        if s >= 0:
            if not self._alive(s, now):
                return self._register_small((room,), (rank,), now, dp_size, who)
            old = self._rank_v[s]
            if old != rank:
                raise RoomConflict(room, old, rank)
            result = _RENEWED_ONE
        elif self._size >= self.max_rooms or (who[1] is not None and self._held[who[0]] >= who[1]):
            return self._register_small((room,), (rank,), now, dp_size, who)
        elif 0 in row:  # a free slot in the home bucket: no overflow count to touch
            s = base + row.index(0)
            self._keys_v[s] = room
            self._rank_v[s] = rank
            self._size += 1
            self._owner[s] = who[0]
            self._held[who[0]] += 1
            result = _ADDED_ONE
        else:
            s = self._insert_one(room, rank)
            self._owner[s] = who[0]
            self._held[who[0]] += 1
            result = _ADDED_ONE
        i = tail & self._rmask
        self._ring_slot_v[i] = s
        self._ring_time_v[i] = now
        self._seq_v[s] = tail & _M32
        self._tail = tail + 1
        self._registered += 1
        return result

    def _register_small(
        self, rooms: Sequence[int] | np.ndarray, ranks: Sequence[int] | np.ndarray, now: float, dp_size: int | None,
        who: tuple[int, int | None],
    ) -> RegisterResult:
        pairs = [(int(room), int(rank)) for room, rank in zip(rooms, ranks)]
        for room, rank in pairs:  # invalid entries first, then conflicts (like the numpy path)
            self._check_entry(room, rank, dp_size)
        want: dict[int, int] = {}
        for room, rank in pairs:
            if want.setdefault(room, rank) != rank:
                raise RoomConflict(room, want[room], rank)
        evicted_before = self._evicted
        while True:
            slots = {room: self._find(room) for room in want}
            gone = [s for s in slots.values() if s >= 0 and not self._alive(s, now)]
            if gone:  # expired, not yet swept: free them now
                self._expired += len(gone)
                self._drop(np.asarray(gone, np.int64))
                slots = {room: -1 if s in gone else s for room, s in slots.items()}
            renew: list[int] = []
            new: list[int] = []
            for room, s in slots.items():
                if s < 0:
                    new.append(room)
                elif self._rank_v[s] != want[room]:
                    raise RoomConflict(room, self._rank_v[s], want[room])
                else:
                    renew.append(s)
            if not self._ring_space(len(want), now):
                break
        self._check_quota(len(new), now, who)
        self._check_room(len(new), now, renew)
        self._append(renew, now)
        added = [self._insert_one(room, want[room]) for room in new]
        self._own(added, who[0])
        self._append(added, now)
        return RegisterResult(len(new), len(rooms) - len(new), self._evicted - evicted_before)

    def _register_many(
        self, keys: np.ndarray, ranks: np.ndarray, now: float, dp_size: int | None, who: tuple[int, int | None]
    ) -> RegisterResult:
        n = len(keys)
        if not keys.all():
            i = int(np.argmin(keys != 0))
            raise InvalidBootstrapRequest(f"entries[{i}]: bootstrap_room 0 is invalid: 0 means not written")
        bad = (ranks < 0) | (ranks > _M32) if dp_size is None else (ranks < 0) | (ranks >= dp_size)
        if bad.any():
            i = int(np.argmax(bad))
            self._check_entry(int(keys[i]), int(ranks[i]), dp_size)
        uniq, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
        if len(uniq) != n:
            inverse = inverse.reshape(-1)
            clash = ranks != ranks[first][inverse]
            if clash.any():
                i = int(np.argmax(clash))
                raise RoomConflict(int(keys[i]), int(ranks[first[inverse[i]]]), int(ranks[i]))
            first.sort()  # keep request order (of first occurrences)
            keys, ranks = keys[first], ranks[first]
        evicted_before = self._evicted
        while True:
            slots = self._find_many(keys)
            hit = slots >= 0
            hit_idx = np.flatnonzero(hit)
            hs = slots[hit_idx]
            gone = self._ring_time[self._seq[hs] & self._rmask] + self.ttl <= now
            if gone.any():  # expired, not yet swept: free them now
                self._expired += int(gone.sum())
                self._drop(hs[gone])
                hit[hit_idx[gone]] = False
                hit_idx, hs = hit_idx[~gone], hs[~gone]
            clash = self._rank[hs] != ranks[hit_idx]
            if clash.any():
                i = int(hit_idx[np.argmax(clash)])
                raise RoomConflict(int(keys[i]), int(self._rank[hs[np.argmax(clash)]]), int(ranks[i]))
            if not self._ring_space(len(keys), now):
                break
        new = len(keys) - len(hit_idx)
        self._check_quota(new, now, who)
        self._check_room(new, now, hs)
        self._append(hs, now)
        if new:
            added = self._insert_many(keys[~hit], ranks[~hit])
            self._own(added, who[0])
            self._append(added, now)
        return RegisterResult(new, n - new, self._evicted - evicted_before)

    @staticmethod
    def _check_entry(room: int, rank: int, dp_size: int | None) -> None:
        if room == 0:
            raise InvalidBootstrapRequest("bootstrap_room 0 is invalid: 0 means not written")
        if not 0 <= room <= _M64:
            raise InvalidBootstrapRequest(f"bootstrap_room {room} is not a uint64")
        if dp_size is not None and not 0 <= rank < dp_size:
            raise InvalidBootstrapRequest(f"bootstrap_room {room}: dp_rank {rank} is outside [0, dp_size={dp_size})")
        if not 0 <= rank <= _M32:
            raise InvalidBootstrapRequest(f"bootstrap_room {room}: dp_rank {rank} is not a uint32")
