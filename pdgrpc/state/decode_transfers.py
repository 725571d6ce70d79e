"""The transfer stage of the decode queues: the slots in transfer or quarantine, the
reports on them, and the transfer poll that commits or aborts them.

:class:`~pdgrpc.state.decode_queues.DecodeQueues` owns one :class:`TransferStage` and
hands it each request that got its slot and pages (:meth:`TransferStage.start`); see that
module for the TP lock-step rules, the poll's cost and abort safety. One rank's poll, or
with a collective :meth:`~TransferStage.prepare_poll`, the reduce and
:meth:`~TransferStage.finish_poll`, runs the steps of :mod:`pdgrpc.state.transfer_poll`.
Pure: no I/O, time is an argument.
"""

from __future__ import annotations

import array
from typing import Callable, Iterable, Union

import torch

from pdgrpc.errors import StateError
from pdgrpc.kvpoll import KVPoll
from pdgrpc.state.decode_request import (
    Abort,
    DecodeRequest,
    DecodeState,
    PrefillReady,
    TransferDone,
    TransferStarted,
    timeout_message,
)
from pdgrpc.state.metadata import MetadataBuffers, row_problem
from pdgrpc.state.outcomes import REASON_NONE, AbortReason, Aborted, Committed
from pdgrpc.state.pages import PageAllocator
from pdgrpc.state.poll import advance_code
from pdgrpc.state.slots import SlotAllocator
from pdgrpc.state.transfer_poll import NEG_ROOM, POLL_ROWS, REASON, ROOM, STATE, metadata_gate

__all__ = ["FREE", "LocalPoll", "Outcome", "QUARANTINE", "TRANSFER", "TransferStage"]

Outcome = Union[Committed, Aborted]
# A rank's transport state of a room: a KVPoll, or (KVPoll, why it FAILED).
LocalPoll = Callable[[int], Union[KVPoll, "tuple[KVPoll, AbortReason]"]]

# Per-slot modes.
FREE, TRANSFER, QUARANTINE = 0, 1, 2
# Why a quarantined slot may be released (its _acked value): the prefill acked the abort
# (replayed: every rank), or this rank's transport confirmed the writers gone (this rank).
_ACKED, _GONE = 1, 2
# One rank's poll looks at every slot in use up to this many, and above it lets a few
# tensor ops pick the slots that changed: their fixed cost pays off only for many slots.
_SCAN_ALL_MAX = 64
_S = DecodeState


class TransferStage:
    """The requests between their handshake and their commit or abort, and the slots of
    aborted ones in quarantine. ``slots`` and ``pages``: the pools :class:`DecodeQueues`
    allocates from; this stage frees into them. ``limits``: each state's deadline, for
    the timeout messages. ``vocab_size``: a landed row is checked against it (None: not)."""

    def __init__(
        self,
        buffers: MetadataBuffers,
        slots: SlotAllocator,
        pages: PageAllocator,
        limits: dict[DecodeState, float],
        abort_lease_s: float,
        vocab_size: int | None,
    ) -> None:
        self.buffers, self.slots, self.pages = buffers, slots, pages
        self.vocab_size = vocab_size
        self._limits = limits
        self._abort_lease_s = abort_lease_s
        self._requests: dict[int, DecodeRequest] = {}  # room -> request, while in transfer
        self._cancel_msg: dict[int, str] = {}
        self._bad_row: dict[int, str] = {}  # slot -> why its landed row was refused
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

    # -- entering and leaving ---------------------------------------------------------------
    def start(self, r: DecodeRequest, fake: bool) -> None:
        """``r`` got its slot and pages (BOOTSTRAPPING): its transfer starts now."""
        slot, room = r.slot, r.room
        assert slot is not None
        self._requests[room] = r
        self._mode[slot] = TRANSFER
        self._local[slot] = KVPoll.BOOTSTRAPPING
        self._prev[slot] = KVPoll.BOOTSTRAPPING
        self._reason[slot] = REASON_NONE
        self._fake[slot] = fake
        self._acked[slot] = 0
        self._expected[slot] = room
        self._seq[slot] = self._next_seq
        self._next_seq += 1
        self._deadline[slot] = r.deadline
        self._slot_room[slot] = room
        self._room_slot[room] = slot

    def cancel(self, room: int, message: str) -> None:
        """Fold a cancel of ``room`` (in transfer) into the next poll, so that every TP
        rank aborts it at the same poll."""
        slot = self._room_slot[room]
        self._local[slot] = KVPoll.FAILED
        self._reason[slot] = min(self._reason[slot], AbortReason.CANCELLED)
        self._cancel_msg[room] = message

    # -- introspection ------------------------------------------------------------------------
    def request(self, room: int) -> DecodeRequest | None:
        return self._requests.get(room)

    def slot_of(self, room: int) -> int | None:
        return self._room_slot.get(room)

    def is_quarantined(self, room: int) -> bool:
        slot = self._room_slot.get(room)
        return slot is not None and self._mode[slot] == QUARANTINE

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    @property
    def num_quarantined(self) -> int:
        return sum(1 for s in self._room_slot.values() if self._mode[s] == QUARANTINE)

    @property
    def holds_slots(self) -> bool:
        return bool(self._room_slot)

    # -- reports on rooms in transfer or quarantine -------------------------------------
    def on_local_status(self, room: int, status: KVPoll, why: AbortReason = AbortReason.TRANSFER_FAILED) -> None:
        """This rank's transport state for ``room``: forward only, FAILED wins, and a report
        for a room not in transfer (committed, aborted, unknown) is ignored. ``why``: the
        reason a FAILED report aborts it with (``PEER_FAILURE`` when the transport failed
        it because its peer is gone); of several reasons the most specific (smallest)
        wins, as across TP ranks, so a peer's death outranks a cancel that followed it."""
        slot = self._room_slot.get(room)
        if slot is None or self._mode[slot] != TRANSFER:
            return
        self._local[slot] = advance_code(self._local[slot], status)
        if status == KVPoll.FAILED:
            self._reason[slot] = min(self._reason[slot], why)

    def on_abort_ack(self, room: int) -> bool:
        """The prefill acknowledged ``room``'s abort (no write of it will follow). Returns
        False when the room is not quarantined (late or duplicate ack: ignored)."""
        slot = self._room_slot.get(room)
        if slot is None or self._mode[slot] != QUARANTINE:
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
        if slot is None or self._mode[slot] != QUARANTINE:
            return False
        self._acked[slot] = self._acked[slot] or _GONE
        return True

    # -- the transfer poll ----------------------------------------------------------------
    def poll_transfers(self, now: float, local_poll: LocalPoll | None = None) -> list[Outcome]:
        """One rank, no collective: local poll -> metadata gate -> act. Its own votes are
        acted on directly, with no tensor (the decode loop polls whenever a transfer
        lands, on the first token's path)."""
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
                if self._mode[slot] == TRANSFER:
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
        idx = torch.nonzero(((mode == TRANSFER) & moved) | ((mode == QUARANTINE) & released)).flatten()
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
            if mode[slot] == QUARANTINE:
                out.append((slot, 1 if self._acked[slot] or deadline[slot] < now else 0, REASON_NONE))
                continue
            s, reason = local[slot], reasons[slot]
            if not fake[slot]:
                s, corrupt = metadata_gate(s, room_of_slot(slot), expected[slot])
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
            if self._mode[slot] == QUARANTINE:
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
        self._mode[slot] = FREE
        self.slots.free(slot)  # zeroes the room
        del self._room_slot[room]
        del self._requests[room]
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
        # Quarantine: the prefill may still write into this slot and these pages.
        self._mode[slot] = QUARANTINE
        self._acked[slot] = 0
        self._deadline[slot] = now + self._abort_lease_s
        self.pages.quarantine(room, r.pages)
        return Aborted(room, reason, msg, state.name, awaiting_ack=True)

    def _release(self, slot: int) -> None:
        room = self._slot_room[slot]
        self.pages.release(room)
        self._mode[slot] = FREE
        self.slots.free(slot)  # zeroes whatever a late write left there
        del self._room_slot[room]
