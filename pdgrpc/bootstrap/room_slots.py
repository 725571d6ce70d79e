"""The room table's slots: an open-addressed hash table of rooms and their dp ranks.

:class:`RoomSlots` is the storage half of :class:`~pdgrpc.bootstrap.table.RoomTable`
(which adds the TTL, the ring of registrations and the cap): it finds, inserts and
deletes rooms, one at a time (plain Python on memoryviews, for calls of a few rooms) or
vectorised (numpy, for batches). Pure: no I/O, no clock.

Layout: ``capacity = 2 * max_rooms`` slots (rounded up to a power of two), grouped in
buckets of ``W = 16`` slots (128 bytes of keys). A room lives in its home bucket (a
keyed multiply-shift hash) or, if that is full, in the next bucket with a free slot;
``overflow[b]`` counts the rooms that probed past bucket ``b``, so a lookup stops at the
first bucket that holds the room or has ``overflow == 0``. Key 0 marks a free slot
(room 0 is invalid). Deleting a room just clears its slot and decrements the counters
it incremented: no tombstones, no rehash, ever. Load stays <= 50 %.
"""

from __future__ import annotations

import random

import numpy as np

__all__ = ["W", "RoomSlots"]

W = 16  # slots per bucket (_find_many relies on 16: one row of matches = two uint64 words)
_M64 = (1 << 64) - 1


def pow2_at_least(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for n <= 1)."""
    return 1 << max(0, (n - 1).bit_length())


class RoomSlots:
    """Rooms (uint64, never 0) → dp rank (uint32) in preallocated numpy arrays, sized for
    ``max_rooms`` rooms at <= 50 % load. ``seed`` fixes the hash (tests)."""

    def __init__(self, max_rooms: int, seed: int | None) -> None:
        nbuckets = max(2, pow2_at_least(-(-2 * max_rooms // W)))
        self._bmask = nbuckets - 1
        self._shift = 64 - (nbuckets.bit_length() - 1)
        # Keyed hash: rooms are client-chosen, so the multiplier is secret and odd.
        rng = random.Random(seed) if seed is not None else random.SystemRandom()
        self._mult = rng.getrandbits(64) | 1
        self._mult_np = np.uint64(self._mult)
        self._shift_np = np.uint64(self._shift)
        cap = nbuckets * W
        self._keys = np.zeros(cap, np.uint64)
        self._keys2d = self._keys.reshape(nbuckets, W)
        self._rank = np.zeros(cap, np.uint32)
        self._ovf = np.zeros(nbuckets, np.uint32)
        # The per-room paths (calls of a few rooms) go through memoryviews of the same
        # arrays: plain Python ints, none of numpy's per-call machinery, whose code is
        # cold between two calls of a server that also runs gRPC.
        self._keys_v = self._keys.data
        self._rank_v = self._rank.data
        self._ovf_v = self._ovf.data
        self._size = 0  # rooms stored

    def home_bucket(self, room: int) -> int:
        """The bucket where ``room``'s probe starts (fixed by ``seed``, so a test can pick
        rooms that collide)."""
        return ((room * self._mult) & _M64) >> self._shift

    def overflow(self, bucket: int) -> int:
        """Stored rooms whose probe passed ``bucket``: a lookup that reaches it without
        finding its room probes on while this is nonzero."""
        return int(self._ovf_v[bucket])

    def check(self) -> None:
        """Raise :class:`AssertionError` naming the first broken invariant: the size counts
        the stored rooms, each stored room is found at its slot, and each bucket's
        :meth:`overflow` counts the stored rooms whose probe passed it. Reads every slot:
        for tests."""
        stored = np.flatnonzero(self._keys).tolist()
        if len(stored) != self._size:
            raise AssertionError(f"{len(stored)} rooms are stored, the size says {self._size}")
        ovf = np.zeros_like(self._ovf)
        for s in stored:
            room = int(self._keys_v[s])
            if (found := self._find(room)) != s:
                raise AssertionError(f"room {room} is stored in slot {s}, a lookup finds slot {found}")
            j = self.home_bucket(room)
            while j != s // W:
                ovf[j] += 1
                j = (j + 1) & self._bmask
        wrong = np.flatnonzero(ovf != self._ovf)
        if len(wrong):
            b = int(wrong[0])
            raise AssertionError(f"bucket {b} counts {self._ovf_v[b]} rooms probed past it, {ovf[b]} did")

    def _home_many(self, keys: np.ndarray) -> np.ndarray:
        return ((keys * self._mult_np) >> self._shift_np).astype(np.int64)

    def _find(self, room: int) -> int:
        """Slot of ``room`` or -1 (expired rooms not yet swept are still found)."""
        b = self.home_bucket(room)
        keys = self._keys_v
        while True:
            row: list[int] = keys[b * W : b * W + W].tolist()
            if room in row:
                return b * W + row.index(room)
            if not self._ovf_v[b]:
                return -1
            b = (b + 1) & self._bmask

    def _find_many(self, keys: np.ndarray) -> np.ndarray:
        home = self._home_many(keys)
        # np.take gathers the 1,024 random 128-byte rows of a query several times faster
        # than fancy indexing (self._keys2d[home]), which copies row by row.
        eq = np.take(self._keys2d, home, axis=0) == keys[:, None]
        words = eq.view(np.uint64)  # each row of 16 bools is two 8-byte words: any() in one OR
        hit = (words[:, 0] | words[:, 1]) != 0
        slots = home * W + eq.argmax(axis=1)
        if hit.all():
            return slots
        slots[~hit] = -1
        for i in np.flatnonzero(~hit & (np.take(self._ovf, home) > 0)).tolist():  # rare: probed past home
            slots[i] = self._find(int(keys[i]))
        return slots

    def _insert_one(self, room: int, rank: int) -> int:
        h = b = self.home_bucket(room)
        while True:
            row: list[int] = self._keys_v[b * W : b * W + W].tolist()
            if 0 in row:
                break
            b = (b + 1) & self._bmask
        j = h
        while j != b:
            self._ovf_v[j] += 1
            j = (j + 1) & self._bmask
        s = b * W + row.index(0)
        self._keys_v[s] = room
        self._rank_v[s] = rank
        self._size += 1
        return s

    def _insert_many(self, keys: np.ndarray, ranks: np.ndarray) -> np.ndarray:
        """Insert rooms known to be absent and distinct; returns their slots."""
        m = len(keys)
        home = self._home_many(keys)
        order = np.argsort(home, kind="stable")
        hs = home[order]
        new_group = np.empty(m, bool)
        new_group[0] = True
        np.not_equal(hs[1:], hs[:-1], out=new_group[1:])
        starts = np.flatnonzero(new_group)
        index_in_group = np.arange(m) - starts[np.cumsum(new_group) - 1]
        # The i-th room of a bucket group takes the bucket's i-th free slot, if any.
        free_before = np.cumsum(self._keys2d[hs] == 0, axis=1)
        fits = index_in_group < free_before[:, -1]
        col = np.argmax(free_before > index_in_group[:, None], axis=1)
        slots = np.empty(m, np.int64)
        slots[order] = np.where(fits, hs * W + col, -1)
        placed = slots >= 0
        ps = slots[placed]
        self._keys[ps] = keys[placed]
        self._rank[ps] = ranks[placed]
        self._size += len(ps)
        for i in np.flatnonzero(~placed).tolist():  # rare: home bucket full
            slots[i] = self._insert_one(int(keys[i]), int(ranks[i]))
        return slots

    def _delete(self, slots: np.ndarray) -> None:
        keys = self._keys[slots]
        home = self._home_many(keys)
        bucket = slots // W
        for i in np.flatnonzero(home != bucket).tolist():  # rare: undo the overflow counts
            j, b = int(home[i]), int(bucket[i])
            while j != b:
                self._ovf[j] -= 1
                j = (j + 1) & self._bmask
        self._keys[slots] = 0
        self._size -= len(slots)
