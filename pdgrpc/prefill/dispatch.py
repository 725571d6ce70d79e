"""The DP controller's choice of dp rank for one request (pure: no I/O).

Order: an explicit ``routed_dp_rank`` wins; otherwise the load-balance method picks
(``round_robin``: live ranks in turn; ``follow_bootstrap_room``: ``room % dp_size``;
``shortest_queue``: the live rank with the fewest requests in flight, lowest rank on a
tie). Then :func:`~pdgrpc.state.dp_rank.check_prefill_dispatch` decides whether the
room -> rank mapping must be registered with bootstrap for decode to query, or whether a
strict ``follow_bootstrap_room`` conflict refuses the request.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from pdgrpc.errors import ConfigError
from pdgrpc.state.config import DpConfig
from pdgrpc.state.dp_rank import DpRankConflict, check_prefill_dispatch

__all__ = ["Dispatch", "Dispatcher", "DpRankConflict", "InvalidRoute", "NoLiveRank"]


class InvalidRoute(ConfigError):
    """``routed_dp_rank`` outside ``[0, dp_size)``."""


class NoLiveRank(ConfigError):
    """Every worker the method could pick is dead."""


@dataclasses.dataclass(frozen=True)
class Dispatch:
    rank: int
    register: bool  # register room -> rank with bootstrap before the request runs


class Dispatcher:
    def __init__(self, dp_size: int, method: str, force_query: bool = False) -> None:
        if method not in ("round_robin", "follow_bootstrap_room", "shortest_queue"):
            raise ConfigError(f"load_balance_method must be round_robin, follow_bootstrap_room or shortest_queue, got {method!r}")
        self.method = method
        self.dp = DpConfig(dp_size=dp_size, follow_bootstrap_room=method == "follow_bootstrap_room", force_query=force_query)
        self._next = 0

    @property
    def dp_size(self) -> int:
        return self.dp.dp_size

    def pick(self, room: int, routed: int | None, queue_lengths: Sequence[int], alive: Sequence[bool]) -> Dispatch:
        """Raises :class:`InvalidRoute`, :class:`DpRankConflict` or :class:`NoLiveRank`."""
        n = self.dp_size
        if routed is not None:
            if not 0 <= routed < n:
                raise InvalidRoute(f"routed_dp_rank must be in [0, dp_size={n}), got {routed}")
            rank = routed
        elif self.method == "follow_bootstrap_room":
            rank = room % n
        elif self.method == "round_robin":
            live = [r for r in range(n) if alive[r]]
            if not live:
                raise NoLiveRank("no live prefill worker")
            rank = next((r for r in live if r >= self._next), live[0])
            self._next = (rank + 1) % n
        else:
            live = [r for r in range(n) if alive[r]]
            if not live:
                raise NoLiveRank("no live prefill worker")
            rank = min(live, key=lambda r: (queue_lengths[r], r))
        decision = check_prefill_dispatch(room, rank, self.method == "follow_bootstrap_room", self.dp)
        return Dispatch(rank, decision.register)
