"""What a receiver allows for one room (:class:`RoomGrant`): the contract's argument to
``Transport.advertise``, and what the receiver core (:mod:`pdgrpc.transport.receiver`)
checks every write against.

numpy-free at import: :mod:`pdgrpc.transport.base` names this class, and every role's
flags import the base through the transport registry.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

from pdgrpc.errors import ConfigError

__all__ = ["RoomGrant"]


@dataclasses.dataclass(frozen=True)
class RoomGrant:
    """What a receiver allows for one room: these page indices in every KV region and
    this slot in every metadata region (``slot=None``: no metadata row for this room,
    e.g. an intermediate TP rank). ``bound``: only the writers the control plane binds
    to the room (``Transport.bind_writer``) may write into it, none before; unbound, any
    proven writer may. Build with :meth:`of`, which sorts and dedups."""

    room: int  # a room key in [1, 2**63), checked where its room entered (pdgrpc.state.room)
    pages: tuple[int, ...]
    slot: int | None = None
    bound: bool = False

    @classmethod
    def of(cls, room: int, pages: Iterable[int], slot: int | None = None, *, bound: bool = False) -> "RoomGrant":
        ps = tuple(sorted(set(int(p) for p in pages)))
        if ps and ps[0] < 0:
            raise ConfigError(f"RoomGrant.pages must be >= 0, got {ps[0]}")
        if slot is not None and slot < 0:
            raise ConfigError(f"RoomGrant.slot must be >= 0, got {slot}")
        return cls(room, ps, slot, bound)

    @property
    def page_runs(self) -> tuple[tuple[int, int], ...]:
        """Maximal runs of consecutive pages as ``(first, last_exclusive)``."""
        runs: list[tuple[int, int]] = []
        for p in self.pages:
            if runs and runs[-1][1] == p:
                runs[-1] = (runs[-1][0], p + 1)
            else:
                runs.append((p, p + 1))
        return tuple(runs)

    def runs_array(self) -> tuple[Any, Any]:
        """Page runs as ``(starts, ends_exclusive)`` int64 arrays (cached)."""
        cached = self.__dict__.get("_runs_np")
        if cached is None:
            runs = self.page_runs
            # Imported here, not at the top, so this module loads without numpy: every
            # role's flags import it (through transport.base), and only the receiver
            # core, which has numpy loaded already, calls this.
            import numpy as np

            cached = (np.array([a for a, _ in runs], dtype=np.int64), np.array([b for _, b in runs], dtype=np.int64))
            object.__setattr__(self, "_runs_np", cached)
        return cached

    def runs_lists(self) -> tuple[list[int], list[int]]:
        """Page runs as ``(starts, ends_exclusive)`` Python lists (cached), for
        :meth:`~pdgrpc.transport.receiver.RegionTable.authorize`'s few-op path."""
        cached = self.__dict__.get("_runs_py")
        if cached is None:
            runs = self.page_runs
            cached = ([a for a, _ in runs], [b for _, b in runs])
            object.__setattr__(self, "_runs_py", cached)
        return cached
