"""Which instance of a role a request goes to (``--policy``). Pure: no I/O, no clock.

* ``round_robin``: the instances in turn.
* ``least_load``: the instance with the fewest calls this router has in flight on it; a
  tie goes to the first in turn.
* ``cache_aware``: the instance whose prefix cache holds the longest prefix of the
  prompt (:class:`~pdgrpc.state.prefix_index.PrefixIndex`, fed by the instances' KV
  events, and the prompts just sent to it), unless its load exceeds the least loaded
  instance's by more than ``margin`` calls: then, as when nobody holds any of the
  prompt, the instance caching least among those within ``margin`` of the least load
  (:func:`~pdgrpc.state.routing.cache_aware_choice`).

The router keeps one policy per role over one index: prefills by ``--policy``; decodes
by ``cache_aware`` under ``--policy cache_aware`` (a decode holding the prompt's prefix
receives only the rest of its KV), else round robin. The caller passes the candidates
(the instances not ejected) and tells the policy when a call starts and ends, so loads
count only this router's calls (Prefill calls for prefills, Decode streams for decodes).
"""

from __future__ import annotations

from typing import Sequence

from pdgrpc.state.prefix_index import PrefixIndex
from pdgrpc.state.routing import cache_aware_choice, least_loaded

__all__ = ["DEFAULT_MARGIN", "POLICIES", "InFlight", "Policy"]

POLICIES = ("round_robin", "least_load", "cache_aware")
DEFAULT_MARGIN = 4  # calls in flight


class InFlight:
    """Calls in flight by address, counted by the caller as they start and end."""

    def __init__(self) -> None:
        self._calls: dict[str, int] = {}

    def load(self, address: str) -> int:
        return self._calls.get(address, 0)

    def started(self, address: str) -> None:
        """A call to ``address`` started."""
        self._calls[address] = self.load(address) + 1

    def finished(self, address: str) -> None:
        """A call to ``address`` ended, however it ended."""
        n = self.load(address) - 1
        if n > 0:
            self._calls[address] = n
        else:
            self._calls.pop(address, None)


class Policy:
    def __init__(self, name: str, index: PrefixIndex | None = None, margin: int = DEFAULT_MARGIN) -> None:
        if name not in POLICIES:
            raise ValueError(f"--policy must be one of {', '.join(POLICIES)}, got {name!r}")
        if margin < 0:
            raise ValueError(f"--cache-aware-margin must be >= 0, got {margin}")
        if name == "cache_aware" and index is None:
            raise ValueError("--policy cache_aware needs a prefix index")
        self.name = name
        self.margin = margin
        self._index = index
        self._calls = InFlight()

    def load(self, address: str) -> int:
        return self._calls.load(address)

    def started(self, address: str) -> None:
        """A call to ``address`` started."""
        self._calls.started(address)

    def finished(self, address: str) -> None:
        """A call to ``address`` ended, however it ended."""
        self._calls.finished(address)

    def choose(self, addresses: Sequence[str], turn: int, prompt: Sequence[int]) -> int:
        """The position in ``addresses`` (non-empty) of the instance for the request whose
        turn is ``turn`` (a count of requests) and whose prompt is ``prompt``."""
        if self.name == "round_robin":
            return turn % len(addresses)
        loads = [self.load(a) for a in addresses]
        if self.name == "least_load" or self._index is None:
            return least_loaded(loads, turn)
        matches = self._index.match(prompt)
        sizes = [self._index.size(a) for a in addresses]
        return cache_aware_choice([matches.get(a, 0) for a in addresses], loads, turn, self.margin, sizes)
