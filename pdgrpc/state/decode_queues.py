"""The decode queues over many requests: pending dp rank -> prealloc -> transfer -> committed.

Pure logic (h11 style): the driver calls in with events and the current time and carries
out the returned actions. One instance per TP rank. Its transfer stage (the slots in
transfer or quarantine, the transfer poll) is :mod:`pdgrpc.state.decode_transfers`.

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
(:class:`TransferStage`'s vote) for the slots whose vote
may have changed (all slots in use when they are few: microseconds, no tensor; else a
fixed number of tensor ops picks them). With a collective: the rule for every slot in
use, one tensor each way.

**Abort safety.** A request aborted after its handshake was sent keeps its slot and pages
in quarantine: a late write from the prefill lands in memory nobody else owns. They return
to the pools once every rank saw the prefill's ack (:meth:`on_abort_ack`) or its own
transport confirmed the writers gone (:meth:`on_writers_gone`), or the lease
(``DecodeDeadlines.abort_lease_s``) expired. Freeing a slot zeroes its room first.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Iterable, Mapping

import torch

from pdgrpc.errors import ConfigError, StateError
from pdgrpc.kvpoll import KVPoll
from pdgrpc.state.config import DecodeDeadlines, DpConfig
from pdgrpc.state.decode_request import (
    TIMEOUT_REASON,
    Abort,
    DecodeRequest,
    DecodeState,
    DpRankResolved,
    MemoryAllocated,
    state_limits,
    timeout_message,
)
from pdgrpc.state.decode_transfers import LocalPoll, Outcome, TransferStage
from pdgrpc.state.dp_rank import DpRankResolver, QueryDpRanks, resolve_locally
from pdgrpc.state.metadata import MetadataBuffers
from pdgrpc.state.outcomes import AbortReason, Aborted
from pdgrpc.state.pages import PageAllocator
from pdgrpc.state.room import Room
from pdgrpc.state.slots import SlotAllocator
from pdgrpc.state.transfer_poll import AllReduceMin

__all__ = ["DecodeQueues", "LocalPoll", "NewRequest", "Outcome", "SendHandshake"]

_S = DecodeState


@dataclasses.dataclass(frozen=True)
class NewRequest:
    room: Room  # checked where the request entered (as_room)
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
        self._transfers = TransferStage(buffers, self.slots, self.pages, self._limits, self.deadlines.abort_lease_s, vocab_size)

    # -- admission and dp rank --------------------------------------------------------
    def add(self, req: NewRequest, now: float) -> None:
        room = req.room
        if room in self._requests or self._transfers.slot_of(room) is not None:
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
            del requests[room], self._spec[room]
            self._transfers.start(r, spec.fake)
            assert r.dp_rank is not None
            out.append(SendHandshake(room, spec.prefill_address, r.dp_rank, slot, got))
        return out

    # -- aborts -------------------------------------------------------------------------
    def cancel(self, room: int, now: float, message: str = "cancelled") -> Aborted | None:
        """Abort ``room``. Before its handshake the abort is immediate (returned). After
        it, the abort is folded into the next poll so that every TP rank aborts it at the
        same poll (returned from :meth:`poll_transfers`). Unknown/finished rooms: no-op."""
        r = self._requests.get(room)
        if r is not None:
            self._resolver.remove(room)
            return self._finish_abort(r, AbortReason.CANCELLED, f"room {room}: {message} in state {r.state.name}", now)
        if self._transfers.request(room) is not None:
            self._transfers.cancel(room, message)
        return None

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
                out.append(self._finish_abort(r, TIMEOUT_REASON[state], msg, now))
        return out

    def _finish_abort(self, r: DecodeRequest, reason: AbortReason, message: str, now: float) -> Aborted:
        state = r.state
        r.handle(Abort(reason, message), now)
        del self._requests[r.room]
        del self._spec[r.room]
        return Aborted(r.room, reason, message, state.name, awaiting_ack=False)

    # -- engine side ------------------------------------------------------------------
    def alloc_pages(self, n: int) -> tuple[int, ...] | None:
        """Pages for a request whose prompt the decode computes itself (a local prefill:
        no slot, no transfer); None when fewer than ``n`` are free."""
        return self.pages.alloc(n)

    def release_pages(self, pages: Iterable[int]) -> None:
        """Return a committed request's pages once the engine is done with them."""
        self.pages.free(pages)

    # -- the transfer stage ---------------------------------------------------------------
    def on_local_status(self, room: int, status: KVPoll, why: AbortReason = AbortReason.TRANSFER_FAILED) -> None:
        """This rank's transport state of ``room`` (:meth:`TransferStage.on_local_status`)."""
        self._transfers.on_local_status(room, status, why)

    def on_abort_ack(self, room: int) -> bool:
        """The prefill acknowledged ``room``'s abort (:meth:`TransferStage.on_abort_ack`)."""
        return self._transfers.on_abort_ack(room)

    def on_writers_gone(self, room: int) -> bool:
        """This rank's transport confirmed ``room``'s writers gone (not replayed)."""
        return self._transfers.on_writers_gone(room)

    def poll_transfers(
        self, now: float, all_reduce_min: AllReduceMin | None = None, local_poll: LocalPoll | None = None
    ) -> list[Outcome]:
        """local poll -> metadata gate -> all-reduce MIN -> act.

        With a collective (TP > 1) this is :meth:`prepare_poll`, the reduce and
        :meth:`finish_poll`; call it on every rank at every step, also when nothing is in
        flight (the collective must match). One rank has nothing to reduce."""
        if all_reduce_min is not None:
            return self.finish_poll(all_reduce_min(self.prepare_poll(now, local_poll)), now)
        return self._transfers.poll_transfers(now, local_poll)

    def prepare_poll(self, now: float, local_poll: LocalPoll | None = None) -> torch.Tensor:
        """This rank's votes as the poll tensor, for the all-reduce."""
        return self._transfers.prepare_poll(now, local_poll)

    def finish_poll(self, reduced: torch.Tensor, now: float) -> list[Outcome]:
        """Act on the all-reduced poll tensor; identical on every rank."""
        return self._transfers.finish_poll(reduced, now)

    # -- introspection ------------------------------------------------------------------
    def state_of(self, room: int) -> DecodeState | None:
        """The request's state, or None once it has ended (terminal requests are dropped)."""
        r = self._requests.get(room) or self._transfers.request(room)
        return r.state if r is not None else None

    def deadline_of(self, room: int) -> float | None:
        r = self._requests.get(room) or self._transfers.request(room)
        return r.deadline if r is not None else None

    def slot_of(self, room: int) -> int | None:
        return self._transfers.slot_of(room)

    def is_quarantined(self, room: int) -> bool:
        return self._transfers.is_quarantined(room)

    @property
    def num_requests(self) -> int:
        return len(self._requests) + self._transfers.num_requests

    @property
    def num_quarantined(self) -> int:
        return self._transfers.num_quarantined

    def is_idle(self) -> bool:
        """No request tracked, every slot and page free."""
        return (
            not self._requests
            and not self._transfers.holds_slots
            and self.slots.num_free == self.slots.num_slots
            and self.pages.num_free == self.pages.num_pages
        )
