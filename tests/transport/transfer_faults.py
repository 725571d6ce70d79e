"""Fault injection for tests: a sender-side :class:`Transport` wrapper that fails a
seeded random share of transfers at one of four points.

:class:`FailingTransfers` wraps a sender's transport (a prefill's). Each room it writes
is *hit* with probability ``probability``, decided by ``random.Random(f"{seed}:{room}")``
alone -- so a given room is hit, and at which point, the same way in every run with the
same seed. A hit room fails (its sender-side status becomes ``FAILED`` with a reason
starting ``injected transfer fault``) at one of :data:`POINTS`:

``before_first_page``
    at the room's first write, before anything of it is sent;
``mid_pages``
    at the room's first write, after the first half of its page ops was sent;
``before_row``
    at the write that carries the metadata row, after its pages but without the row;
``after_row``
    right after the metadata row was queued (the receiver may already see ``SUCCESS``).

Writes for a room after it failed send nothing. The receiver learns of the failure only
the way it learns of any sender-side failure: from the sender's abort, not from the
data plane. Every hit is logged (``pdgrpc transport test faults: room R hit at P``) and
listed in :attr:`FailingTransfers.hits`.

Test-only: nothing in the servers loads it by itself; a test loads a subclass through the
transport registry's ``module:Class`` names (see ``tests/e2e/faulty.py``).
"""

from __future__ import annotations

import logging
import math
import random
from typing import Sequence

from pdgrpc.errors import ConfigError
from pdgrpc.kvpoll import KVPoll
from pdgrpc.transport.base import Peer, Transport, WriteOp
from tests.transport.faults import FaultyTransport

__all__ = ["POINTS", "FailingTransfers"]

POINTS = ("before_first_page", "mid_pages", "before_row", "after_row")

log = logging.getLogger("pdgrpc.transport.testing.faults")


def fault_point(seed: int, room: int, probability: float) -> str | None:
    """The point at which ``room`` fails under ``seed`` (one of :data:`POINTS`), or None."""
    rng = random.Random(f"{seed}:{room}")
    if rng.random() >= probability:
        return None
    return rng.choice(POINTS)


class FailingTransfers(FaultyTransport):
    """See the module docstring. Only the sender hooks change; the receiver side is
    the inner transport's, unchanged."""

    def __init__(self, inner: Transport, *, seed: int, probability: float) -> None:
        super().__init__(inner)
        if isinstance(probability, bool) or not isinstance(probability, (int, float)) \
                or not math.isfinite(probability) or not 0 <= probability <= 1:
            raise ConfigError(f"FailingTransfers: probability must be a number in [0, 1], got {probability!r}")
        self.seed = seed
        self.probability = float(probability)
        self.hits: dict[int, str] = {}  # room -> point, for every room failed so far
        self._written: set[int] = set()  # rooms with at least one write

    def __repr__(self) -> str:
        return f"FailingTransfers({self._inner!r}, seed={self.seed}, probability={self.probability})"

    async def write(
        self, peer: Peer, room: int, ops: Sequence[WriteOp], *, metadata: WriteOp | None = None
    ) -> None:
        if room in self.hits:
            return  # failed already: nothing more of it is sent
        first = room not in self._written
        self._written.add(room)
        point = fault_point(self.seed, room, self.probability)
        if point == "before_first_page" and first:
            self.rooms.create(room, KVPoll.TRANSFERRING)
            self._fail(room, point)
        elif point == "mid_pages" and first:
            await self._inner.write(peer, room, list(ops)[: len(ops) // 2])
            self._fail(room, point)
        elif point == "before_row" and metadata is not None:
            await self._inner.write(peer, room, ops)
            self._fail(room, point)
        elif point == "after_row" and metadata is not None:
            await self._inner.write(peer, room, ops, metadata=metadata)
            self._fail(room, point)
        else:
            await self._inner.write(peer, room, ops, metadata=metadata)

    def release(self, room: int) -> None:
        self._written.discard(room)
        self.hits.pop(room, None)
        super().release(room)

    def _fail(self, room: int, point: str) -> None:
        self.hits[room] = point
        log.warning("pdgrpc transport test faults: room %d hit at %s (seed %d)", room, point, self.seed)
        self.rooms.fail(room, f"injected transfer fault at {point} (seed {self.seed})")
