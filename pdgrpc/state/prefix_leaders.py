"""Which running request a prompt waits for, so that one cache computes a prefix once (pure).

A request that computes pages of a prompt is their *leader* while it runs: a later prompt
that shares more of them than the cache holds waits for the leader to end, and then finds
that prefix cached instead of computing it a second time beside it. The rule is the
router's (:meth:`pdgrpc.state.prefix_index.PendingPrefixes.leader`, one trie of running
prompts); here it serves one prefix cache, a prefill worker's, whatever front door sent
the requests.

- Only the pages a prompt leaves cached count: its full pages but the last token's.
- A prompt waits only for a leader that computes more of it than the cache holds, and
  only while the leader runs: a leader that fails or is aborted ends the wait at once
  (its pages never become cached, and the follower computes them itself).
- A leader is registered once it holds its pages and computes, so it never waits for a
  follower: a chain of waits ends at a computing request, and there is no cycle.
- A wait is bounded by :func:`leader_wait_s`: a leader that hangs leaves the follower the
  rest of its time to compute the prefix itself.
"""

from __future__ import annotations

from typing import Generic, Hashable, Sequence, TypeVar

from pdgrpc.state.prefix_index import PendingPrefixes

__all__ = ["PrefixLeaders", "leader_wait_s"]

K = TypeVar("K", bound=Hashable)

_ONE = ""  # the one instance: a single cache
_NO_LIMIT = 1 << 62  # running requests are bounded by the pool's pages, never dropped here


def leader_wait_s(budget_s: float) -> float:
    """How long a follower waits for its leader, of the ``budget_s`` it has to start
    computing: at most half, so a leader that hangs leaves it the other half."""
    return max(0.0, budget_s / 2)


class PrefixLeaders(Generic[K]):
    """The running requests of one prefix cache of ``page_size``-token pages, by key."""

    def __init__(self, page_size: int) -> None:
        self._page = page_size
        self._running = PendingPrefixes(chunk=page_size, grace_s=0.0, limit=_NO_LIMIT)
        self._tickets: dict[K, int] = {}
        self._keys: dict[int, K] = {}

    def __len__(self) -> int:
        return len(self._tickets)

    def running(self, key: K, prompt: Sequence[int]) -> None:
        """The request ``key`` computes ``prompt`` now (its pages are its own or cached)."""
        if key in self._tickets:
            raise ValueError(f"PrefixLeaders.running: key {key!r} is running already")
        ticket = self._running.add(_ONE, self._cacheable(prompt), 0.0)
        self._tickets[key], self._keys[ticket] = ticket, key

    def ended(self, key: K) -> None:
        """The request ``key`` ended (its pages were inserted into the cache, or freed);
        an unknown key is ignored."""
        ticket = self._tickets.pop(key, None)
        if ticket is not None:
            del self._keys[ticket]
            self._running.remove(ticket)

    def leader(self, prompt: Sequence[int], cached_tokens: int = 0) -> K | None:
        """The running request that computes the most pages of ``prompt`` beyond its
        first ``cached_tokens`` (what the cache holds of it), when it computes any."""
        ticket = self._running.leader(_ONE, self._cacheable(prompt), cached_tokens)
        return None if ticket is None else self._keys[ticket]

    def _cacheable(self, prompt: Sequence[int]) -> Sequence[int]:
        """What of ``prompt`` its request leaves cached: full pages, never the last token."""
        n = max(0, len(prompt) - 1) // self._page * self._page
        return prompt[:n]
