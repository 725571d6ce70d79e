"""The decode queues over many requests: pending dp rank -> prealloc -> transfer -> committed.

Pure logic (h11 style): the driver calls in with events and the current time and carries
out the returned actions. One instance per TP rank.

::

    q.add(NewRequest(room, addr, num_pages), now)   # -> queue: resolving or prealloc
    q.poll_dp_ranks(now)          -> [QueryDpRanks]   (throttled per prefill address)
    q.on_dp_ranks(addr, answers)  # answers from bootstrap
    q.prealloc(now)               -> [SendHandshake]  (pages + slot, when both are free)
    q.on_local_status(room, s[, why])  # this rank's transport reported a KVPoll for the room
    q.poll_transfers(now, all_reduce_min) -> [Committed | Aborted]
    q.cancel(room, now) / q.on_abort_ack(room) / q.tick(now) / q.release_pages(pages)
    q.on_writers_gone(room)       # this rank's transport: the room's writers cannot write here

**TP lock-step.** Everything that changes which slot or page a request gets is decided
from the reduced poll tensor, so every rank makes the same decision at the same poll:
commits, transfer-stage aborts (transport failure, corruption, cancellation, deadlines —
each rank folds its own view into the tensor before the reduce) and the release of
quarantined slots/pages (acked or lease expired on *every* rank). The driver must feed
``add``/``on_dp_ranks``/``prealloc``/``cancel``/``tick`` identically on every rank (e.g.
rank 0 broadcasts its scheduling input); if ranks still disagree on which room a slot
holds, the poll detects it and aborts that request with ``TP_DESYNC`` instead of hanging.

**Cost.** Per request event: O(1) dict/bytearray work. One rank's poll: the per-slot rule
(:meth:`DecodeQueues._votes`) for the slots whose vote may have changed (all slots in use
when they are few: microseconds, no tensor; else a fixed number of tensor ops picks
them). With a collective: the rule for every slot in use, one tensor each way.

**Abort safety.** A request aborted after its handshake was sent keeps its slot and pages
in quarantine: a late write from the prefill lands in memory nobody else owns. They return
to the pools once every rank saw the prefill's ack (:meth:`on_abort_ack`) or its own
transport confirmed the writers gone (:meth:`on_writers_gone`), or the lease
(``DecodeDeadlines.abort_lease_s``) expired. Freeing a slot zeroes its room first.
"""

from __future__ import annotations

import array
import collections
import dataclasses
from typing import Callable, Iterable, Mapping, Union

import torch

from pdgrpc.errors import ConfigError, StateError
from pdgrpc.kvpoll import KVPoll
from pdgrpc.state import transfer_poll
from pdgrpc.state.config import DecodeDeadlines, DpConfig
from pdgrpc.state.decode_request import (
    Abort,
    DecodeRequest,
    DecodeState,
    DpRankResolved,
    MemoryAllocated,
    PrefillReady,
    TransferDone,
    TransferStarted,
    state_limits,
    timeout_message,
)
from pdgrpc.state.dp_rank import DpRankResolver, QueryDpRanks, resolve_locally
from pdgrpc.state.metadata import MetadataBuffers, row_problem
from pdgrpc.state.outcomes import REASON_NONE, AbortReason, Aborted, Committed
from pdgrpc.state.pages import PageAllocator
from pdgrpc.state.poll import advance_code
from pdgrpc.state.slots import SlotAllocator
from pdgrpc.state.transfer_poll import NEG_ROOM, POLL_ROWS, REASON, ROOM, STATE, AllReduceMin

__all__ = ["DecodeQueues", "LocalPoll", "NewRequest", "Outcome", "SendHandshake"]

_ROOM_MAX = (1 << 63) - 1
Outcome = Union[Committed, Aborted]
# A rank's transport state of a room: a KVPoll, or (KVPoll, why it FAILED).
LocalPoll = Callable[[int], Union[KVPoll, "tuple[KVPoll, AbortReason]"]]

# Per-slot modes.
_FREE, _TRANSFER, _QUARANTINE = 0, 1, 2
# Why a quarantined slot may be released (its _acked value): the prefill acked the abort
# (replayed: every rank), or this rank's transport confirmed the writers gone (this rank).
_ACKED, _GONE = 1, 2
# One rank's poll looks at every slot in use up to this many, and above it lets a few
# tensor ops pick the slots that changed (~0.1 ms of ops against ~1 us per slot).
_SCAN_ALL_MAX = 64
_S = DecodeState


@dataclasses.dataclass(frozen=True)
class NewRequest:
    room: int  # bootstrap_room, random 63-bit, never 0
    prefill_address: str  # the prefill (its bootstrap) serving this request
    num_pages: int  # KV pages to allocate for the prompt
    dp_rank: int | None = None  # explicit prefill dp rank, when the router pinned one
    fake: bool = False  # fake transfer: no metadata row is written, the gate is skipped
    dp: DpConfig = DpConfig()  # that prefill instance's dp size and rank rule


@dataclasses.dataclass(frozen=True)
class SendHandshake:
    """Action: tell prefill ``dp_rank`` at ``prefill_address`` where to write ``room``."""

    room: int
    prefill_address: str
    dp_rank: int
    slot: int
    pages: tuple[int, ...]


class DecodeQueues:
    def __init__(
        self,
        buffers: MetadataBuffers,
        num_pages: int,
        deadlines: DecodeDeadlines | None = None,
        query_interval_s: float = DpConfig.query_interval_s,
        vocab_size: int | None = None,
    ) -> None:
        """``query_interval_s``: at most one QueryDpRanks per prefill address per interval.
        ``vocab_size``: a landed metadata row is checked against it before commit
        (:func:`~pdgrpc.state.metadata.row_problem`); a bad row aborts its request alone
        as METADATA_CORRUPTION. None: rows are not checked."""
        self.vocab_size = vocab_size
        self._bad_row: dict[int, str] = {}  # slot -> why its landed row was refused
        self.buffers = buffers
        self.deadlines = deadlines if deadlines is not None else DecodeDeadlines()
        self.slots = SlotAllocator(buffers)
        self.pages = PageAllocator(num_pages)
        self._limits = state_limits(self.deadlines)
        self._requests: dict[int, DecodeRequest] = {}
        self._spec: dict[int, NewRequest] = {}
        self._resolver = DpRankResolver(query_interval_s)
        self._prealloc: collections.deque[int] = collections.deque()
        # (deadline, room) per pre-transfer state; one limit per state keeps each FIFO
        # sorted by deadline, so tick() only looks at the heads.
        self._timers: dict[DecodeState, collections.deque[tuple[float, int]]] = {
            _S.RESOLVING_DP_RANK: collections.deque(),
            _S.WAITING_FOR_MEMORY: collections.deque(),
        }
        self._cancel_msg: dict[int, str] = {}

        n = buffers.num_slots
        # Per-slot state in Python buffers (cheap scalar writes per event) with torch views
        # over the same memory (for _candidates).
        self._mode = bytearray(n)
        self._local = bytearray(n)  # this rank's KVPoll
        self._reason = bytearray([REASON_NONE]) * n  # this rank's failure reason
        self._prev = bytearray(n)  # last reduced KVPoll
        self._fake = bytearray(n)
        self._acked = bytearray(n)
        self._expected = array.array("q", [0]) * n
        self._seq = array.array("q", [0]) * n
        self._deadline = array.array("d", [0.0]) * n  # current state's deadline (or lease end)
        self._slot_room = [0] * n
        self._room_slot: dict[int, int] = {}
        self._next_seq = 0
        self._mode_t = torch.frombuffer(self._mode, dtype=torch.uint8)
        self._local_t = torch.frombuffer(self._local, dtype=torch.uint8)
        self._prev_t = torch.frombuffer(self._prev, dtype=torch.uint8)
        self._fake_t = torch.frombuffer(self._fake, dtype=torch.uint8)
        self._acked_t = torch.frombuffer(self._acked, dtype=torch.uint8)
        self._expected_t = torch.frombuffer(self._expected, dtype=torch.int64)
        self._seq_t = torch.frombuffer(self._seq, dtype=torch.int64)
        self._deadline_t = torch.frombuffer(self._deadline, dtype=torch.float64)
        # reduced state (1..3) -> the timeout reason naming it
        lut = [REASON_NONE] * 5
        lut[KVPoll.BOOTSTRAPPING] = AbortReason.BOOTSTRAP_TIMEOUT
        lut[KVPoll.WAITING_FOR_INPUT] = AbortReason.WAITING_FOR_INPUT_TIMEOUT
        lut[KVPoll.TRANSFERRING] = AbortReason.TRANSFER_TIMEOUT
        self._timeout_reason = tuple(lut)

    # -- admission and dp rank --------------------------------------------------------
    def add(self, req: NewRequest, now: float) -> None:
        room = req.room
        if not isinstance(room, int) or not 0 < room <= _ROOM_MAX:
            raise ConfigError(f"NewRequest.room must be in [1, 2**63), got {room!r}")
        if room in self._requests or room in self._room_slot:
            raise StateError(f"room {room} is already in use on this decode")
        if not 0 < req.num_pages <= self.pages.num_pages:
            raise ConfigError(f"NewRequest.num_pages must be in [1, {self.pages.num_pages}], got {req.num_pages}")
        rank = resolve_locally(room, req.dp_rank, req.dp)
        r = DecodeRequest(room, now, self._limits, rank)
        self._requests[room] = r
        self._spec[room] = req
        if rank is None:
            self._resolver.add(room, req.prefill_address, req.dp.dp_size)
        else:
            self._prealloc.append(room)
        self._timers[r.state].append((r.deadline, room))

    def poll_dp_ranks(self, now: float) -> list[QueryDpRanks]:
        return self._resolver.poll(now)

    def on_dp_ranks(self, prefill_address: str, answers: Mapping[int, int | None], now: float) -> int:
        """Apply a QueryDpRanks answer; returns how many rooms moved to the prealloc queue."""
        resolved = self._resolver.on_answer(prefill_address, answers)
        for room, rank in resolved:
            r = self._requests[room]
            r.handle(DpRankResolved(rank), now)
            self._prealloc.append(room)
            self._timers[_S.WAITING_FOR_MEMORY].append((r.deadline, room))
        return len(resolved)

    # -- prealloc ---------------------------------------------------------------------
    def prealloc(self, now: float) -> list[SendHandshake]:
        """Give KV pages and a slot to queued requests, in arrival order, while both are
        available. The head of the queue waits for memory rather than being overtaken, so
        every TP rank allocates identically."""
        out: list[SendHandshake] = []
        queue, requests, slots, pages = self._prealloc, self._requests, self.slots, self.pages
        while queue:
            room = queue[0]
            r = requests.get(room)
            if r is None or r.state is not _S.WAITING_FOR_MEMORY:
                queue.popleft()  # cancelled or timed out while queued
                continue
            spec = self._spec[room]
            if slots.num_free == 0 or pages.num_free < spec.num_pages:
                break
            slot = slots.alloc()
            got = pages.alloc(spec.num_pages)
            assert slot is not None and got is not None
            queue.popleft()
            r.handle(MemoryAllocated(slot, got), now)
            self._mode[slot] = _TRANSFER
            self._local[slot] = KVPoll.BOOTSTRAPPING
            self._prev[slot] = KVPoll.BOOTSTRAPPING
            self._reason[slot] = REASON_NONE
            self._fake[slot] = spec.fake
            self._acked[slot] = 0
            self._expected[slot] = room
            self._seq[slot] = self._next_seq
            self._next_seq += 1
            self._deadline[slot] = r.deadline
            self._slot_room[slot] = room
            self._room_slot[room] = slot
            assert r.dp_rank is not None
            out.append(SendHandshake(room, spec.prefill_address, r.dp_rank, slot, got))
        return out

    # -- transport reports --------------------------------------------------------------
    def on_local_status(self, room: int, status: KVPoll, why: AbortReason = AbortReason.TRANSFER_FAILED) -> None:
        """This rank's transport state for ``room``: forward only, FAILED wins, and a report
        for a room not in transfer (committed, aborted, unknown) is ignored. ``why``: the
        reason a FAILED report aborts it with (``PEER_FAILURE`` when the transport failed
        it because its peer is gone); of several reasons the most specific (smallest)
        wins, as across TP ranks, so a peer's death outranks a cancel that followed it."""
        slot = self._room_slot.get(room)
        if slot is None or self._mode[slot] != _TRANSFER:
            return
        self._local[slot] = advance_code(self._local[slot], status)
        if status == KVPoll.FAILED:
            self._reason[slot] = min(self._reason[slot], why)

    # -- aborts -------------------------------------------------------------------------
    def cancel(self, room: int, now: float, message: str = "cancelled") -> Aborted | None:
        """Abort ``room``. Before its handshake the abort is immediate (returned). After
        it, the abort is folded into the next poll so that every TP rank aborts it at the
        same poll (returned from :meth:`poll_transfers`). Unknown/finished rooms: no-op."""
        r = self._requests.get(room)
        if r is None:
            return None
        if r.state in (_S.RESOLVING_DP_RANK, _S.WAITING_FOR_MEMORY):
            self._resolver.remove(room)
            return self._finish_abort(r, AbortReason.CANCELLED, f"room {room}: {message} in state {r.state.name}", now)
        slot = self._room_slot[room]
        self._local[slot] = KVPoll.FAILED
        self._reason[slot] = min(self._reason[slot], AbortReason.CANCELLED)
        self._cancel_msg[room] = message
        return None

    def on_abort_ack(self, room: int) -> bool:
        """The prefill acknowledged ``room``'s abort (no write of it will follow). Returns
        False when the room is not quarantined (late or duplicate ack: ignored)."""
        slot = self._room_slot.get(room)
        if slot is None or self._mode[slot] != _QUARANTINE:
            return False
        self._acked[slot] = _ACKED
        return True

    def on_writers_gone(self, room: int) -> bool:
        """This rank's transport confirmed that none of ``room``'s writers can still write
        here (their processes are gone, their connections drained). Not replayed: each
        rank tells its own, and a quarantined slot is released at the poll where every
        rank has this or the ack (the MIN over ranks). False when ``room`` is not
        quarantined."""
        slot = self._room_slot.get(room)
        if slot is None or self._mode[slot] != _QUARANTINE:
            return False
        self._acked[slot] = self._acked[slot] or _GONE
        return True

    def tick(self, now: float) -> list[Aborted]:
        """Abort requests overdue in a pre-transfer state (resolving dp rank, waiting for
        memory). Transfer-stage deadlines are checked by every poll, inside the reduce."""
        out: list[Aborted] = []
        for state, timers in self._timers.items():
            while timers and timers[0][0] < now:
                deadline, room = timers.popleft()
                r = self._requests.get(room)
                if r is None or r.state is not state or r.deadline != deadline:
                    continue  # moved on since
                self._resolver.remove(room)
                msg = timeout_message(state, self._limits[state], room)
                out.append(self._finish_abort(r, _TIMEOUT[state], msg, now))
        return out

    def _finish_abort(self, r: DecodeRequest, reason: AbortReason, message: str, now: float) -> Aborted:
        state = r.state
        r.handle(Abort(reason, message), now)
        del self._requests[r.room]
        del self._spec[r.room]
        return Aborted(r.room, reason, message, state.name, awaiting_ack=False)

    # -- the transfer poll ----------------------------------------------------------------
    def poll_transfers(
        self,
        now: float,
        all_reduce_min: AllReduceMin | None = None,
        local_poll: LocalPoll | None = None,
    ) -> list[Outcome]:
        """local poll -> metadata gate -> all-reduce MIN -> act.

        With a collective (TP > 1) this is :meth:`prepare_poll`, the reduce and
        :meth:`finish_poll`; call it on every rank at every step, also when nothing is in
        flight (the collective must match). One rank has nothing to reduce: its own votes
        are acted on directly, with no tensor (the decode loop polls whenever a transfer
        lands, on the first token's path)."""
        if all_reduce_min is not None:
            return self.finish_poll(all_reduce_min(self.prepare_poll(now, local_poll)), now)
        if not self._room_slot:
            return []
        self._apply_local_poll(local_poll)
        votes = [(slot, s, reason, False) for slot, s, reason in self._votes(now, self._candidates(now))]
        return self._act_on_votes(votes, now)

    def prepare_poll(self, now: float, local_poll: LocalPoll | None = None) -> torch.Tensor:
        """Steps 1-2: this rank's votes as the ``int64[4, num_slots]`` poll tensor (the
        same shape whatever the queue holds; a free slot votes SUCCESS for no room).

        ``local_poll(room)``, if given, is asked for every room in transfer (convenient; the
        O(1)-per-event path is :meth:`on_local_status` as reports arrive): a KVPoll, or a
        ``(KVPoll, why)`` pair as :meth:`on_local_status` takes them."""
        self._apply_local_poll(local_poll)
        n = self.buffers.num_slots
        states, reasons, rooms = [int(KVPoll.SUCCESS)] * n, [REASON_NONE] * n, [0] * n
        for slot, s, reason in self._votes(now, self._room_slot.values()):
            states[slot], reasons[slot], rooms[slot] = s, reason, self._expected[slot]
        t = torch.tensor([states, reasons, rooms, rooms], dtype=torch.int64)
        t[NEG_ROOM].neg_()
        return t

    def finish_poll(self, reduced: torch.Tensor, now: float) -> list[Outcome]:
        """Step 4: act on the all-reduced poll tensor; identical on every rank."""
        if reduced.shape != (POLL_ROWS, self.buffers.num_slots):
            raise StateError(f"reduced poll tensor has shape {tuple(reduced.shape)}, expected {(POLL_ROWS, self.buffers.num_slots)}")
        if not self._room_slot:
            return []
        rows = reduced.tolist()
        states, reasons, rooms, neg_rooms = rows[STATE], rows[REASON], rows[ROOM], rows[NEG_ROOM]
        votes = [(slot, states[slot], reasons[slot], rooms[slot] != -neg_rooms[slot]) for slot in self._room_slot.values()]
        return self._act_on_votes(votes, now)

    def _apply_local_poll(self, local_poll: LocalPoll | None) -> None:
        if local_poll is not None:
            for room, slot in list(self._room_slot.items()):
                if self._mode[slot] == _TRANSFER:
                    got = local_poll(room)
                    if isinstance(got, tuple):
                        self.on_local_status(room, *got)
                    else:
                        self.on_local_status(room, got)

    def _candidates(self, now: float) -> Iterable[int]:
        """One rank: the slots whose vote may differ from their last state, in admission
        order. Few slots in use: all of them. Many: a fixed number of tensor ops over all
        slots picks them (a vote changes only with a new local state, a deadline passed,
        a row holding another room, or a quarantine acked or over), so a poll's Python
        work follows what changed, not the queue length."""
        if len(self._room_slot) <= _SCAN_ALL_MAX:
            return self._room_slot.values()
        mode, deadline_passed = self._mode_t, self._deadline_t < now
        landed = self.buffers.room_column()
        corrupt = (self._fake_t == 0) & (landed != 0) & (landed != self._expected_t)
        moved = (self._local_t != self._prev_t) | deadline_passed | corrupt
        released = (self._acked_t != 0) | deadline_passed
        idx = torch.nonzero(((mode == _TRANSFER) & moved) | ((mode == _QUARANTINE) & released)).flatten()
        if idx.numel() > 1:
            idx = idx[torch.argsort(self._seq_t[idx])]
        slots: list[int] = idx.tolist()
        return slots

    def _votes(self, now: float, slots: Iterable[int]) -> list[tuple[int, int, int]]:
        """This rank's ``(slot, state, reason)`` for ``slots`` (in transfer or quarantine).
        In transfer: its KVPoll after the metadata gate and its deadline (FAILED, with the
        reason, when either fails it). Quarantined: 1 to release it (acked, its writers
        gone here, or its lease over here), else 0."""
        out: list[tuple[int, int, int]] = []
        mode, local, reasons, fake, prev, deadline = self._mode, self._local, self._reason, self._fake, self._prev, self._deadline
        room_of_slot, expected = self.buffers.room, self._expected
        for slot in slots:
            if mode[slot] == _QUARANTINE:
                out.append((slot, 1 if self._acked[slot] or deadline[slot] < now else 0, REASON_NONE))
                continue
            s, reason = local[slot], reasons[slot]
            if not fake[slot]:
                s, corrupt = transfer_poll.metadata_gate(s, room_of_slot(slot), expected[slot])
                if corrupt:
                    reason = min(reason, AbortReason.METADATA_CORRUPTION)
                elif s == KVPoll.SUCCESS and self.vocab_size is not None:
                    # Before the all-reduce, like the gate: every TP rank then aborts it together.
                    why = row_problem(self.buffers.read_row(slot), self.vocab_size)
                    if why is not None:
                        self._bad_row[slot] = why
                        s, reason = KVPoll.FAILED, min(reason, AbortReason.METADATA_CORRUPTION)
            if deadline[slot] < now and KVPoll.FAILED < s < KVPoll.SUCCESS:
                s, reason = KVPoll.FAILED, min(reason, self._timeout_reason[prev[slot]])
            out.append((slot, s, reason))
        return out

    def _act_on_votes(self, votes: list[tuple[int, int, int, bool]], now: float) -> list[Outcome]:
        """Release quarantined slots voted free; advance, commit or abort the slots in
        transfer whose (reduced) state changed or whose ranks disagree on the room."""
        out: list[Outcome] = []
        for slot, s, reason, desync in votes:
            if self._mode[slot] == _QUARANTINE:
                if s == 1:
                    self._release(slot)
            elif desync or s != self._prev[slot]:
                self._act(slot, s, reason, desync, now, out)
        return out

    def _act(self, slot: int, s: int, reason: int, desync: bool, now: float, out: list[Outcome]) -> None:
        """A slot in transfer whose reduced state changed: advance, commit or abort it."""
        r = self._requests[self._slot_room[slot]]
        if desync:
            out.append(self._abort_in_transfer(slot, r, AbortReason.TP_DESYNC, now))
        elif s == KVPoll.FAILED:
            out.append(self._abort_in_transfer(slot, r, AbortReason(reason), now))
        else:
            s = max(s, self._prev[slot])  # forward only
            if s >= KVPoll.WAITING_FOR_INPUT and r.state is _S.BOOTSTRAPPING:
                r.handle(PrefillReady(), now)
            if s >= KVPoll.TRANSFERRING and r.state is _S.WAITING_FOR_INPUT:
                r.handle(TransferStarted(), now)
            if s == KVPoll.SUCCESS:
                out.append(self._commit(slot, r, now))
            else:
                self._prev[slot] = s
                self._deadline[slot] = r.deadline

    def _commit(self, slot: int, r: DecodeRequest, now: float) -> Committed:
        room = r.room
        row = None if self._fake[slot] else self.buffers.read_row(slot)
        r.handle(TransferDone(), now)
        self._mode[slot] = _FREE
        self.slots.free(slot)  # zeroes the room
        del self._room_slot[room]
        del self._requests[room]
        del self._spec[room]
        return Committed(room, slot, r.pages, row)

    def _abort_in_transfer(self, slot: int, r: DecodeRequest, reason: AbortReason, now: float) -> Aborted:
        room, state = r.room, r.state
        bad_row = self._bad_row.pop(slot, None)
        if reason is AbortReason.METADATA_CORRUPTION:
            found = self.buffers.room(slot)
            if bad_row is not None and found == room:
                msg = f"room {room}: metadata row refused: {bad_row} (slot {slot})"
            elif found not in (0, room):
                msg = f"bootstrap_room mismatch: expected {room}, found {found} in slot {slot}"
            else:
                msg = f"bootstrap_room mismatch in slot {slot} (expected {room}) detected on another TP rank"
        elif reason is AbortReason.CANCELLED:
            msg = f"room {room}: {self._cancel_msg.get(room, 'cancelled on another TP rank')} in state {state.name}"
        elif reason is AbortReason.TRANSFER_FAILED:
            msg = f"room {room}: transfer failed in state {state.name}"
        elif reason is AbortReason.PEER_FAILURE:
            msg = f"room {room}: peer failed in state {state.name}"
        elif reason is AbortReason.TP_DESYNC:
            msg = f"room {room}: TP ranks disagree on the room held by slot {slot} (in state {state.name})"
        else:
            msg = timeout_message(state, self._limits[state], room)
        self._cancel_msg.pop(room, None)
        r.handle(Abort(reason, msg), now)
        del self._requests[room]
        del self._spec[room]
        # Quarantine: the prefill may still write into this slot and these pages.
        self._mode[slot] = _QUARANTINE
        self._acked[slot] = 0
        self._deadline[slot] = now + self.deadlines.abort_lease_s
        self.pages.quarantine(room, r.pages)
        return Aborted(room, reason, msg, state.name, awaiting_ack=True)

    def _release(self, slot: int) -> None:
        room = self._slot_room[slot]
        self.pages.release(room)
        self._mode[slot] = _FREE
        self.slots.free(slot)  # zeroes whatever a late write left there
        del self._room_slot[room]

    # -- engine side ------------------------------------------------------------------
    def release_pages(self, pages: Iterable[int]) -> None:
        """Return a committed request's pages once the engine is done with them."""
        self.pages.free(pages)

    # -- introspection ------------------------------------------------------------------
    def state_of(self, room: int) -> DecodeState | None:
        """The request's state, or None once it has ended (terminal requests are dropped)."""
        r = self._requests.get(room)
        return r.state if r is not None else None

    def deadline_of(self, room: int) -> float | None:
        r = self._requests.get(room)
        return r.deadline if r is not None else None

    def slot_of(self, room: int) -> int | None:
        return self._room_slot.get(room)

    def is_quarantined(self, room: int) -> bool:
        slot = self._room_slot.get(room)
        return slot is not None and self._mode[slot] == _QUARANTINE

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    @property
    def num_quarantined(self) -> int:
        return sum(1 for s in self._room_slot.values() if self._mode[s] == _QUARANTINE)

    def is_idle(self) -> bool:
        """No request tracked, every slot and page free."""
        return (
            not self._requests
            and not self._room_slot
            and self.slots.num_free == self.slots.num_slots
            and self.pages.num_free == self.pages.num_pages
        )


_TIMEOUT = {
    _S.RESOLVING_DP_RANK: AbortReason.RESOLVE_DP_RANK_TIMEOUT,
    _S.WAITING_FOR_MEMORY: AbortReason.ALLOCATE_TIMEOUT,
}
