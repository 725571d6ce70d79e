"""The DP controller's choice of dp rank for one request (pure: no I/O).

Order: an explicit ``routed_dp_rank`` wins; otherwise the load-balance method picks
(``round_robin``: live ranks in turn; ``follow_bootstrap_room``: ``room % dp_size``;
``shortest_queue``: the live rank with the fewest requests in flight, lowest rank on a
tie; ``cache_aware``: the live rank whose prefix cache holds the longest prefix of the
prompt, unless it has more than :data:`CACHE_AWARE_MARGIN` requests in flight beyond the
least busy live rank, else the least busy, in turn on a tie:
:func:`~pdgrpc.state.routing.cache_aware_choice`). Then :func:`~pdgrpc.state.dp_rank.check_prefill_dispatch` decides whether the
room -> rank mapping must be registered with bootstrap for decode to query, or whether a
strict ``follow_bootstrap_room`` conflict refuses the request.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

from pdgrpc.errors import ConfigError
from pdgrpc.state.config import DpConfig
from pdgrpc.state.dp_rank import DpRankConflict, check_prefill_dispatch
from pdgrpc.state.routing import cache_aware_choice

__all__ = ["CACHE_AWARE_MARGIN", "METHODS", "Dispatch", "Dispatcher", "DpRankConflict", "InvalidRoute", "NoLiveRank", "RankPrefixes"]

METHODS = ("round_robin", "follow_bootstrap_room", "shortest_queue", "cache_aware")
CACHE_AWARE_MARGIN = 4  # requests in flight

# Tokens of a prompt's longest cached prefix on each dp rank (ranks holding none may be absent).
RankPrefixes = Callable[[Sequence[int]], Mapping[int, int]]


class InvalidRoute(ConfigError):
    """``routed_dp_rank`` outside ``[0, dp_size)``."""


class NoLiveRank(ConfigError):
    """Every worker the method could pick is dead."""


@dataclasses.dataclass(frozen=True)
class Dispatch:
    rank: int
    register: bool  # register room -> rank with bootstrap before the request runs


class Dispatcher:
    def __init__(self, dp_size: int, method: str, force_query: bool = False, prefixes: RankPrefixes | None = None) -> None:
        """``prefixes``: what each rank's cache holds, read by ``cache_aware`` (without it,
        no rank holds anything and ``cache_aware`` picks as ``shortest_queue`` does, in turn on a tie)."""
        if method not in METHODS:
            raise ConfigError(f"load_balance_method must be one of {', '.join(METHODS)}, got {method!r}")
        self.method = method
        self._prefixes = prefixes
        self.dp = DpConfig(dp_size=dp_size, follow_bootstrap_room=method == "follow_bootstrap_room", force_query=force_query)
        self._next = 0

    @property
    def dp_size(self) -> int:
        return self.dp.dp_size

    def pick(
        self, room: int, routed: int | None, queue_lengths: Sequence[int], alive: Sequence[bool], prompt: Sequence[int] = (),
    ) -> Dispatch:
        """``prompt``: the request's input ids (read by ``cache_aware``). Raises :class:`InvalidRoute`, :class:`DpRankConflict` or :class:`NoLiveRank`."""
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
            if self.method == "shortest_queue":
                rank = min(live, key=lambda r: (queue_lengths[r], r))
            else:
                cached = self._prefixes(prompt) if self._prefixes is not None else {}
                turn, self._next = self._next, self._next + 1
                i = cache_aware_choice([cached.get(r, 0) for r in live], [queue_lengths[r] for r in live], turn, CACHE_AWARE_MARGIN)
                rank = live[i]
        decision = check_prefill_dispatch(room, rank, self.method == "follow_bootstrap_room", self.dp)
        return Dispatch(rank, decision.register)
