"""Tensor-parallel decode: rank 0 drives, the other ranks replay.

A TP-N decode server is N processes. Rank 0 (``python -m pdgrpc.decode --tp-size N``)
serves gRPC, runs :class:`~pdgrpc.decode.scheduler.DecodeScheduler` and starts ranks
1..N-1 (:mod:`pdgrpc.decode.follower`). Every rank holds its own engine shard (its KV
heads), its own transport endpoint with its KV pool slice, and its own metadata rows,
and runs its own :class:`~pdgrpc.state.DecodeQueues`.

The queues are kept identical by replay, not by sharing: on rank 0 every mutating call
goes through :class:`ReplicatedQueues`, which applies it and appends it (arguments,
``now`` included) to a log. Each scheduler iteration rank 0 broadcasts the log and the
poll time on the gloo group; every rank applies the same calls in the same order (the
queues are pure, so they allocate the same slots and pages and abort on the same
ticks), then every rank runs the transfer poll -- its own transport states, its own
metadata gate -- and the MIN all-reduce, so all ranks commit and abort the same rooms in
the same order. Decode steps are broadcast the same way and run with the engine's own
all-reduces. A rank that dies breaks the collectives: the others fail loudly and exit.
"""

from __future__ import annotations

import logging
import pickle
from typing import Any, Iterable, Mapping, TypeVar

import torch

from pdgrpc.errors import ConfigError, PdgrpcError
from pdgrpc.serving.rendezvous import join_tp_group
from pdgrpc.state import Aborted, DecodeDeadlines, DecodeQueues, MetadataBuffers, NewRequest, QueryDpRanks, SendHandshake

_T = TypeVar("_T")

log = logging.getLogger("pdgrpc.decode.tp")

__all__ = ["EVICTABLE", "REPLAYED", "ROOM_BIND", "ROOM_INFO", "ROOM_WRITERS", "Command", "ReplicatedQueues", "TpGroup", "TpGroupBroken"]

# Calls of DecodeQueues that change its state and are replayed on every rank.
# (poll_dp_ranks too: it advances the dp-rank resolver's throttle and in-flight state,
# which on_dp_ranks reads.)
REPLAYED = ("add", "poll_dp_ranks", "on_dp_ranks", "cancel", "on_abort_ack", "alloc_pages", "release_pages", "tick", "prealloc")
ROOM_INFO = "room_info"  # a log entry for the followers only: (room, pages the prefill writes, prefill_tp_size)
# A log entry for the followers only: (room, writer instance ids per decode rank) of a
# quarantined room (pdgrpc.decode.rank.RankTransfers.watch_writers).
ROOM_WRITERS = "room_writers"
# A log entry for the followers only: (room, decode rank, prefill tp rank, writer instance
# id): that rank's room admits that writer (pdgrpc.decode.rank.RankTransfers.bind_writer).
ROOM_BIND = "room_bind"
# A log entry for the followers only: (pages,) the decode prefix cache holds that no
# request holds -- free for the taking, so GetStats counts them free on every rank.
EVICTABLE = "evictable"


class TpGroupBroken(PdgrpcError):
    """A collective on the TP group failed: another rank died or hung past the timeout."""


Command = tuple[str, Any]
"""What rank 0 broadcasts: ``("sync", (log, now))``, ``("step", requests)``,
``("prefill", requests)`` or ``("stop", None)``."""


class TpGroup:
    """The gloo group of one decode instance's TP ranks (rank 0 leads), over ``dist``:
    ``torch.distributed`` once this process joined the group (:meth:`join`), or a
    stand-in with its collectives."""

    def __init__(self, rank: int, size: int, dist: Any) -> None:
        self.rank, self.size = rank, size
        self._dist = dist

    @classmethod
    async def join(cls, rank: int, size: int, init_method: str, timeout_s: float) -> "TpGroup":
        """Join the gloo group of ``size`` ranks at ``init_method`` as ``rank``, once every
        rank has (:func:`~pdgrpc.serving.rendezvous.join_tp_group`: cancelled, this returns
        at once, so a stop during start-up need not wait out ``timeout_s``)."""
        await join_tp_group(rank, size, init_method, timeout_s, who="decode")
        import torch.distributed as dist

        return cls(rank, size, dist)

    def _guard(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except RuntimeError as exc:  # gloo's way of reporting a lost peer or a timeout
            raise TpGroupBroken(f"TP rank {self.rank}/{self.size}: {what} failed (a rank died or hung): {exc}") from exc

    def broadcast(self, cmd: Command | None = None) -> Command:
        """Rank 0 sends ``cmd``; every other rank returns what rank 0 sent (its ``cmd``
        is ignored). Rank 0 must pass a command: the followers unpack what they get."""
        if self.rank == 0:
            if cmd is None:
                raise ConfigError(f"TP rank 0/{self.size}: broadcast needs a command to send")
            box: list[Any] = [pickle.dumps(cmd, protocol=pickle.HIGHEST_PROTOCOL)]
            self._guard("broadcast", self._dist.broadcast_object_list, box, 0)
            return cmd
        box = [None]
        self._guard("broadcast", self._dist.broadcast_object_list, box, 0)
        received: Command = pickle.loads(box[0])
        return received

    def all_reduce_min(self, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        self._guard("all_reduce(MIN)", self._dist.all_reduce, t, self._dist.ReduceOp.MIN)
        return t

    def all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.size
        self._guard("all_gather", self._dist.all_gather_object, out, obj)
        return out

    def close(self) -> None:
        try:
            self._dist.destroy_process_group()
        except Exception:  # already broken: nothing left to release cleanly
            pass


class ReplicatedQueues(DecodeQueues):
    """Rank 0's :class:`DecodeQueues`: the calls in :data:`REPLAYED` are applied, then
    logged (a call that raises is not replayed). :meth:`take_log` hands over the calls
    since the last take, for the next broadcast."""

    def __init__(self, buffers: MetadataBuffers, num_pages: int, deadlines: DecodeDeadlines, query_interval_s: float) -> None:
        super().__init__(buffers, num_pages, deadlines, query_interval_s)
        self._log: list[tuple[str, tuple[Any, ...]]] = []

    def note(self, name: str, *args: Any) -> None:
        """Log an entry the followers need that is not a queue call (e.g. ROOM_INFO)."""
        self._log.append((name, args))

    def take_log(self) -> list[tuple[str, tuple[Any, ...]]]:
        out, self._log = self._log, []
        return out

    def _logged(self, name: str, args: tuple[Any, ...], result: _T) -> _T:
        self._log.append((name, tuple(_frozen(a) for a in args)))
        return result

    def add(self, req: NewRequest, now: float) -> None:
        self._logged("add", (req, now), super().add(req, now))

    def poll_dp_ranks(self, now: float) -> list[QueryDpRanks]:
        return self._logged("poll_dp_ranks", (now,), super().poll_dp_ranks(now))

    def on_dp_ranks(self, prefill_address: str, answers: Mapping[int, int | None], now: float) -> int:
        return self._logged("on_dp_ranks", (prefill_address, answers, now), super().on_dp_ranks(prefill_address, answers, now))

    def cancel(self, room: int, now: float, message: str = "cancelled") -> Aborted | None:
        return self._logged("cancel", (room, now, message), super().cancel(room, now, message))

    def on_abort_ack(self, room: int) -> bool:
        return self._logged("on_abort_ack", (room,), super().on_abort_ack(room))

    def alloc_pages(self, n: int) -> tuple[int, ...] | None:
        return self._logged("alloc_pages", (n,), super().alloc_pages(n))

    def release_pages(self, pages: Iterable[int]) -> None:
        pages = tuple(pages)
        self._logged("release_pages", (pages,), super().release_pages(pages))

    def tick(self, now: float) -> list[Aborted]:
        return self._logged("tick", (now,), super().tick(now))

    def prealloc(self, now: float) -> list[SendHandshake]:
        return self._logged("prealloc", (now,), super().prealloc(now))


def _frozen(a: Any) -> Any:
    # Arguments must not change after they were logged (a dict the caller reuses, a
    # generator that would be consumed).
    if isinstance(a, dict):
        return dict(a)
    if isinstance(a, (list, tuple, range)) or hasattr(a, "__next__"):
        return tuple(a)
    return a
