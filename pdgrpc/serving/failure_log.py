"""Warnings about a peer that keeps failing, at a bounded rate.

A call that is retried on an interval (the decode asks a prefill's bootstrap for dp
ranks every few milliseconds while rooms wait) fails as often as it is retried while
that peer is down: one warning per failure would be tens of lines a second. So the first
failure of a peer is logged at once, later ones at most every ``every_s`` as one line
with their count and the last error, and the first success after failures says how
many there were.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time

__all__ = ["FailureLog"]


@dataclasses.dataclass(slots=True)
class _Failing:
    logged_at: float  # monotonic seconds of the last line about this peer
    unlogged: int = 0  # failures since that line
    total: int = 1  # failures since the peer last answered


class FailureLog:
    """Rate-limited warnings per peer (an address). Keeps at most ``max_peers`` failing
    peers (the one failing longest forgotten first)."""

    def __init__(self, log: logging.Logger, what: str, *, every_s: float = 10.0, max_peers: int = 4096) -> None:
        self._log, self._what, self._every_s, self._max = log, what, every_s, max_peers
        self._failing: collections.OrderedDict[str, _Failing] = collections.OrderedDict()

    def failed(self, peer: str, error: object, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        state = self._failing.get(peer)
        if state is None:
            self._failing[peer] = _Failing(now)
            while len(self._failing) > self._max:
                self._failing.popitem(last=False)
            self._log.warning("%s to %s failed (asked again next interval; repeats are logged every %.0f s): %s",
                              self._what, peer, self._every_s, error)
            return
        state.unlogged += 1
        state.total += 1
        if now - state.logged_at >= self._every_s:
            self._log.warning("%s to %s still failing: %d more failures in %.0f s, the last: %s",
                              self._what, peer, state.unlogged, now - state.logged_at, error)
            state.unlogged, state.logged_at = 0, now

    def succeeded(self, peer: str) -> None:
        state = self._failing.pop(peer, None)
        if state is not None:
            self._log.info("%s to %s answers again after %d failed calls", self._what, peer, state.total)
