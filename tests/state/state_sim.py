"""In-process simulation of one decode with 1-4 TP ranks and its prefill, for the property and
regression tests of pdgrpc.state.

Each rank has its own DecodeQueues and MetadataBuffers (as separate processes would); the
all-reduce MIN is the elementwise minimum of the ranks' poll tensors. The simulated
prefill writes metadata rows into each rank's slot at times the test chooses, can write
a wrong room (corruption), and keeps writing after an abort until it acknowledged it or
its lease ran out (a "live writer"). Ground truth is recorded so invariants can be checked.
"""

from __future__ import annotations

import dataclasses

import torch

from pdgrpc.kvpoll import KVPoll
from pdgrpc.state import decode_transfers
from pdgrpc.state import (
    AbortReason,
    Aborted,
    Committed,
    DecodeDeadlines,
    DecodeQueues,
    MetadataBuffers,
    MetadataRow,
    NewRequest,
)

PREFILL = "prefill-0:7000"


def token_of(room: int) -> int:
    """The first token the prefill computes for ``room`` (ground truth)."""
    return room % 50021 + 1


@dataclasses.dataclass
class Truth:
    room: int
    slot: int | None = None
    pages: tuple[int, ...] = ()
    landed: set[int] = dataclasses.field(default_factory=set)  # ranks whose row holds the room
    corrupted: set[int] = dataclasses.field(default_factory=set)  # ranks whose row holds a wrong room
    aborted_at: float | None = None
    acked: bool = False
    writers_gone: set[int] = dataclasses.field(default_factory=set)  # ranks whose transport saw its writers go
    outcome: str | None = None  # "committed" | "aborted"
    reason: AbortReason | None = None


class Violation(AssertionError):
    pass


class Cluster:
    def __init__(
        self,
        tp: int,
        num_slots: int = 8,
        num_pages: int = 32,
        deadlines: DecodeDeadlines | None = None,
        gate_after_reduce: bool = False,
    ) -> None:
        self.tp = tp
        self.deadlines = deadlines or DecodeDeadlines(
            resolve_dp_rank_s=5, allocate_s=50, bootstrap_s=20, waiting_for_input_s=30, transferring_s=20, abort_lease_s=15
        )
        self.buffers = [MetadataBuffers(num_slots) for _ in range(tp)]
        self.ranks = [DecodeQueues(b, num_pages, deadlines=self.deadlines) for b in self.buffers]
        self.now = 0.0
        self.truth: dict[int, Truth] = {}
        self.pops: list[list[tuple[str, int, int]]] = [[] for _ in range(tp)]
        self.committed_pages: dict[int, tuple[int, ...]] = {}
        self.gate_after_reduce = gate_after_reduce  # the broken pipeline, for a regression test
        self.violations: list[str] = []

    # -- driving ---------------------------------------------------------------------
    def add(self, room: int, num_pages: int = 2) -> None:
        for q in self.ranks:
            q.add(NewRequest(room, PREFILL, num_pages, dp_rank=0), self.now)
        self.truth[room] = Truth(room)

    def prealloc(self) -> None:
        per_rank = [q.prealloc(self.now) for q in self.ranks]
        if any(p != per_rank[0] for p in per_rank):
            self.violations.append(f"ranks preallocated differently: {per_rank}")
        for hs in per_rank[0]:
            t = self.truth[hs.room]
            # A page handed out while an aborted request's writer may still write into it.
            for other in self.live_writers():
                shared = set(other.pages) & set(hs.pages)
                if shared:
                    self.violations.append(f"pages {sorted(shared)} given to room {hs.room} while room {other.room}'s writer is live")
                if other.slot == hs.slot:
                    self.violations.append(f"slot {hs.slot} given to room {hs.room} while room {other.room}'s writer is live")
            t.slot, t.pages = hs.slot, hs.pages

    def report(self, rank: int, room: int, status: KVPoll) -> None:
        self.ranks[rank].on_local_status(room, status)

    def land(self, rank: int, room: int) -> None:
        """The prefill's metadata row for ``room`` lands on ``rank`` (room written last)."""
        t = self.truth[room]
        assert t.slot is not None
        if rank in t.corrupted:
            return  # this rank's prefill wrote a wrong row; it does not write a second one
        self.buffers[rank].write_row(t.slot, MetadataRow(token_of(room), cached_tokens=3), room)
        if t.outcome is None:
            t.landed.add(rank)

    def corrupt(self, rank: int, room: int, wrong_room: int) -> None:
        t = self.truth[room]
        assert t.slot is not None and wrong_room not in (0, room)
        self.buffers[rank].write_row(t.slot, MetadataRow(token_of(wrong_room)), wrong_room)
        t.corrupted.add(rank)
        t.landed.discard(rank)

    def late_write(self, room: int) -> None:
        """An aborted request's live writer writes its row into its old slot on every rank."""
        t = self.truth[room]
        assert t.slot is not None and self.writer_live(t)
        for b in self.buffers:
            b.write_row(t.slot, MetadataRow(token_of(room)), room)

    def cancel(self, room: int) -> None:
        for q in self.ranks:
            out = q.cancel(room, self.now)
            if out is not None:
                self._record(self.ranks.index(q), out)

    def ack(self, room: int) -> None:
        self.truth[room].acked = True
        for q in self.ranks:
            q.on_abort_ack(room)

    def writers_gone(self, room: int, ranks: set[int]) -> None:
        """The transports of ``ranks`` confirmed ``room``'s writers gone; once every rank
        has, nothing of them can land any more."""
        t = self.truth[room]
        t.writers_gone |= ranks
        if t.writers_gone == set(range(self.tp)):
            t.acked = True
        for i in ranks:
            self.ranks[i].on_writers_gone(room)

    def advance(self, dt: float) -> None:
        self.now += dt

    def tick(self) -> None:
        for i, q in enumerate(self.ranks):
            for out in q.tick(self.now):
                self._record(i, out)

    def poll(self) -> None:
        before = {room: (set(t.landed), set(t.corrupted)) for room, t in self.truth.items() if t.outcome is None}
        if self.gate_after_reduce:
            per_rank = self._poll_gate_after_reduce()
        else:
            tensors = [q.prepare_poll(self.now) for q in self.ranks]
            reduced = torch.stack(tensors).amin(dim=0)
            per_rank = [q.finish_poll(reduced.clone(), self.now) for q in self.ranks]
        for i, outs in enumerate(per_rank):
            for out in outs:
                self._record(i, out, before)
        # Corruption present at a poll is detected by that poll, every time.
        for room, (_, corrupted) in before.items():
            t = self.truth[room]
            if corrupted and (t.outcome != "aborted" or t.reason is not AbortReason.METADATA_CORRUPTION):
                self.violations.append(f"room {room}: corrupt row on ranks {sorted(corrupted)} not detected (outcome {t.outcome}, {t.reason})")

    def _poll_gate_after_reduce(self) -> list[list[Committed | Aborted]]:
        """The broken order some peers shipped: reduce the raw states, then gate locally."""
        real_gate = decode_transfers.metadata_gate

        def no_gate(state: int, landed: int, expected: int) -> tuple[int, bool]:
            return state, False

        decode_transfers.metadata_gate = no_gate  # type: ignore[assignment]
        try:
            tensors = [q.prepare_poll(self.now) for q in self.ranks]
        finally:
            decode_transfers.metadata_gate = real_gate  # type: ignore[assignment]
        reduced = torch.stack(tensors).amin(dim=0)
        out = []
        for q, b in zip(self.ranks, self.buffers):
            mine = reduced.clone()
            for slot in range(b.num_slots):
                expected = int(mine[2][slot])
                if expected != 0:
                    mine[0][slot] = real_gate(int(mine[0][slot]), b.room(slot), expected)[0]
            out.append(q.finish_poll(mine, self.now))
        return out

    def settle(self) -> None:
        """tick + poll at the current time; afterwards nothing may be past its deadline."""
        self.tick()
        self.poll()
        self._settled_at = self.now

    def release_committed(self) -> None:
        for room, pages in list(self.committed_pages.items()):
            for q in self.ranks:
                q.release_pages(pages)
            del self.committed_pages[room]

    # -- ground truth ---------------------------------------------------------------------
    def writer_live(self, t: Truth) -> bool:
        if t.outcome != "aborted" or t.slot is None or t.acked:
            return False
        assert t.aborted_at is not None
        return self.now < t.aborted_at + self.deadlines.abort_lease_s

    def live_writers(self) -> list[Truth]:
        return [t for t in self.truth.values() if self.writer_live(t)]

    def _record(self, rank: int, out: Committed | Aborted, before: dict[int, tuple[set[int], set[int]]] | None = None) -> None:
        t = self.truth[out.room]
        if isinstance(out, Committed):
            self.pops[rank].append(("commit", out.room, 0))
            landed = before[out.room][0] if before is not None else t.landed
            if landed != set(range(self.tp)):
                self.violations.append(f"room {out.room} committed with metadata landed only on ranks {sorted(landed)}")
            if out.row is None or out.row.output_id != token_of(out.room):
                self.violations.append(f"room {out.room} committed with token {out.row and out.row.output_id}, expected {token_of(out.room)}")
            if rank == 0:
                self.committed_pages[out.room] = out.pages
            t.outcome = "committed"
        else:
            self.pops[rank].append(("abort", out.room, int(out.reason)))
            if out.reason is AbortReason.METADATA_CORRUPTION and not t.corrupted:
                self.violations.append(f"room {out.room} aborted as corrupt without corruption: {out.message}")
            if t.outcome is None:
                t.outcome, t.reason, t.aborted_at = "aborted", out.reason, self.now
                if not out.awaiting_ack:
                    t.slot = None

    # -- invariants ---------------------------------------------------------------------
    def check(self) -> None:
        if any(p != self.pops[0] for p in self.pops):
            self.violations.append("TP ranks popped different sequences:\n" + "\n".join(map(str, self.pops)))
        for room, t in self.truth.items():
            if t.outcome is None:
                for q in self.ranks:
                    d = q.deadline_of(room)
                    if d is None:
                        self.violations.append(f"room {room} vanished without an outcome")
                    elif d < self.now and self._settled_at == self.now:
                        self.violations.append(f"room {room} in {q.state_of(room)} past its deadline {d} at {self.now}")
            if t.outcome == "aborted" and t.aborted_at is not None and self._settled_at == self.now:
                lease_end = t.aborted_at + self.deadlines.abort_lease_s
                if lease_end < self.now and any(q.is_quarantined(room) for q in self.ranks):
                    self.violations.append(f"room {room} still quarantined after its lease ended at {lease_end}")
        # Every page is free, quarantined, in a transfer, or a committed request's until the
        # engine gives it back; every slot free, quarantined or in a transfer: none lost.
        open_ = [t for t in self.truth.values() if t.outcome is None and t.slot is not None]
        in_transfer = sum(len(t.pages) for t in open_)
        committed = sum(len(p) for p in self.committed_pages.values())
        for i, q in enumerate(self.ranks):
            pages = q.pages.num_free + q.pages.num_quarantined + in_transfer + committed
            slots = q.slots.num_free + q.num_quarantined + len(open_)
            if (pages, slots) != (q.pages.num_pages, q.slots.num_slots):
                self.violations.append(
                    f"rank {i}: {q.pages.num_free} free + {q.pages.num_quarantined} quarantined + {in_transfer} in transfer + "
                    f"{committed} committed pages of {q.pages.num_pages}; {q.slots.num_free} free + {q.num_quarantined} "
                    f"quarantined + {len(open_)} in transfer slots of {q.slots.num_slots}"
                )
        if self.violations:
            raise Violation("\n".join(self.violations))

    _settled_at: float | None = None

    def quiesce(self) -> None:
        """Let every open request finish: land everything, ack every abort, run past every deadline."""
        for _ in range(50):
            if all(t.outcome is not None for t in self.truth.values()) and all(q.is_idle() for q in self.ranks):
                break
            for room, t in self.truth.items():
                if t.outcome is None and t.slot is not None:
                    for r in range(self.tp):
                        if r not in t.corrupted:
                            self.land(r, room)
                        self.report(r, room, KVPoll.SUCCESS)
                elif t.outcome == "aborted":
                    self.ack(room)
            self.poll()
            self.release_committed()
            self.prealloc()
            self.advance(100.0)
            self.settle()
        self.release_committed()
        for i, q in enumerate(self.ranks):
            if not q.is_idle():
                self.violations.append(
                    f"rank {i} not idle at quiescence: {q.num_requests} requests, {q.slots.num_free}/{q.slots.num_slots} slots "
                    f"and {q.pages.num_free}/{q.pages.num_pages} pages free"
                )
        self.check()
