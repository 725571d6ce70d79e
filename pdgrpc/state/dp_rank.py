"""Which prefill data-parallel rank holds a room (DESIGN.md, "Request lifecycle" step 3).

Decode side: :func:`resolve_locally` applies the rules that need no network; rooms it cannot
place go to a :class:`DpRankResolver`, which batches them into one
:class:`QueryDpRanks` action per prefill address and sends **at most one per address per
``query_interval_s``** (a query per loop iteration was a peer's connect storm). The driver
performs the query and feeds the answer back with :meth:`DpRankResolver.on_answer`; rooms
the bootstrap does not know yet stay pending and are asked again next interval, until
their deadline (enforced by the decode queues).

Prefill side: :func:`check_prefill_dispatch` decides whether the rank a request landed on
must be registered with bootstrap, or whether the request must fail because decode would
compute another rank.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from pdgrpc.errors import BootstrapError, ConfigError
from pdgrpc.state.config import DpConfig

__all__ = ["DispatchDecision", "DpRankConflict", "DpRankResolver", "QueryDpRanks", "check_prefill_dispatch", "resolve_locally"]


def _check_rank(rank: int, dp_size: int, what: str) -> None:
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < dp_size:
        raise ConfigError(f"{what} must be an integer in [0, {dp_size}), got {rank!r}")


def resolve_locally(room: int, explicit_rank: int | None, cfg: DpConfig) -> int | None:
    """The prefill dp rank of ``room`` if it is known without asking bootstrap, else None."""
    if explicit_rank is not None:
        _check_rank(explicit_rank, cfg.dp_size, "dp_rank")
        return explicit_rank
    if cfg.dp_size == 1:
        return 0
    if cfg.follow_bootstrap_room and not cfg.force_query:
        return room % cfg.dp_size
    return None


@dataclasses.dataclass(frozen=True)
class QueryDpRanks:
    """Action: ask the bootstrap serving ``prefill_address`` for the dp rank of ``rooms``."""

    prefill_address: str
    rooms: tuple[int, ...]


class DpRankResolver:
    """Pending rooms per prefill address, with a per-address query throttle: at most one
    query per address per ``query_interval_s``. Each room is checked against the dp size
    of its own prefill instance (one decode serves instances of different sizes)."""

    def __init__(self, query_interval_s: float = DpConfig.query_interval_s) -> None:
        if not query_interval_s > 0:
            raise ConfigError(f"query_interval_s must be a positive number of seconds, got {query_interval_s!r}")
        self.query_interval_s = query_interval_s
        self._pending: dict[str, dict[int, None]] = {}  # address -> rooms, insertion-ordered
        self._address_of: dict[int, str] = {}
        self._dp_size: dict[int, int] = {}
        self._last_sent: dict[str, float] = {}

    def add(self, room: int, prefill_address: str, dp_size: int) -> None:
        self._pending.setdefault(prefill_address, {})[room] = None
        self._address_of[room] = prefill_address
        self._dp_size[room] = dp_size

    def remove(self, room: int) -> None:
        addr = self._address_of.pop(room, None)
        if addr is None:
            return
        del self._dp_size[room]
        rooms = self._pending[addr]
        del rooms[room]
        if not rooms:
            del self._pending[addr]

    def poll(self, now: float) -> list[QueryDpRanks]:
        """Queries due now: one per address with pending rooms whose interval has elapsed."""
        out: list[QueryDpRanks] = []
        for addr, rooms in self._pending.items():
            last = self._last_sent.get(addr)
            if last is not None and now - last < self.query_interval_s:
                continue
            self._last_sent[addr] = now
            out.append(QueryDpRanks(addr, tuple(rooms)))
        return out

    def on_answer(self, prefill_address: str, ranks: Mapping[int, int | None]) -> list[tuple[int, int]]:
        """Apply an answer (room -> rank, None = not known yet). Returns the (room, rank)
        pairs resolved now. Rooms not pending (answered twice, aborted) are ignored. A rank
        outside [0, dp_size) of a pending room is refused before anything is applied."""
        for room, rank in ranks.items():
            dp_size = self._dp_size.get(room)
            if rank is not None and dp_size is not None and (not isinstance(rank, int) or not 0 <= rank < dp_size):
                raise BootstrapError(
                    f"QueryDpRanks answer from {prefill_address}: room {room} has dp rank {rank!r}, "
                    f"outside [0, {dp_size})"
                )
        pending = self._pending.get(prefill_address)
        if not pending:
            return []
        out: list[tuple[int, int]] = []
        for room, rank in ranks.items():
            if rank is not None and room in pending:
                out.append((room, rank))
        for room, _ in out:
            self.remove(room)
        return out

    def is_pending(self, room: int) -> bool:
        return room in self._address_of

    def __len__(self) -> int:
        return len(self._address_of)


class DpRankConflict(ConfigError):
    """Strict ``follow_bootstrap_room``, but the request runs on another rank than
    ``room % dp_size``: decode would look for it on the wrong rank."""


@dataclasses.dataclass(frozen=True)
class DispatchDecision:
    """``register``: the prefill must register room -> rank with bootstrap (batched)."""

    register: bool


def check_prefill_dispatch(room: int, actual_rank: int, method_follows_room: bool, cfg: DpConfig) -> DispatchDecision:
    """Prefill's rule once a request has a dp rank (``actual_rank``; ``routed_dp_rank`` may
    have overridden the load-balance method). ``method_follows_room``: the dispatcher's
    method is ``follow_bootstrap_room``. Raises :class:`DpRankConflict` on a strict conflict."""
    _check_rank(actual_rank, cfg.dp_size, "actual dp rank")
    if cfg.dp_size == 1:
        return DispatchDecision(register=False)
    if cfg.force_query:
        return DispatchDecision(register=True)
    if not (method_follows_room and cfg.follow_bootstrap_room):
        return DispatchDecision(register=True)
    expected = room % cfg.dp_size
    if actual_rank != expected:
        raise DpRankConflict(
            f"room {room}: dispatched to dp rank {actual_rank} (routed_dp_rank override), but strict "
            f"follow_bootstrap_room makes decode look on rank {expected} = room % dp_size ({cfg.dp_size}); "
            "enable force-query mode to allow routed ranks"
        )
    return DispatchDecision(register=False)
