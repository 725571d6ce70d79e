"""Which candidate a request goes to, by load and cached prefix (pure: no I/O, no clock).

The router picks among prefills (:class:`~pdgrpc.router.policy.PrefillPolicy`) and a
prefill's dp dispatch among its ranks (:mod:`pdgrpc.prefill.dispatch`) by these rules, so
both balance alike.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["cache_aware_choice", "least_loaded"]


def least_loaded(loads: Sequence[int], turn: int) -> int:
    """The position of the smallest load; ties go in turn from ``turn`` (they rotate
    rather than pile on the first)."""
    n = len(loads)
    return min(((turn + k) % n for k in range(n)), key=lambda i: loads[i])


def cache_aware_choice(matched: Sequence[int], loads: Sequence[int], turn: int, margin: int) -> int:
    """The position of the candidate holding the longest prefix (``matched`` tokens each;
    the less loaded on a tie), unless its load exceeds the smallest by more than
    ``margin``: then, as when nobody holds any of the prompt, :func:`least_loaded`. A
    cached prefix saves its whole prefill, so it outweighs a small queue; the margin
    bounds the work that piles up on a candidate because it holds popular prefixes."""
    n = len(loads)
    least = least_loaded(loads, turn)
    best = max(((turn + k) % n for k in range(n)), key=lambda i: (matched[i], -loads[i]))
    if matched[best] == 0 or loads[best] - loads[least] > margin:
        return least
    return best
