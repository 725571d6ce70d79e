"""Which candidate a request goes to, by load and cached prefix (pure: no I/O, no clock).

The router picks among prefills (:class:`~pdgrpc.router.policy.PrefillPolicy`) and a
prefill's dp dispatch among its ranks (:mod:`pdgrpc.prefill.dispatch`) by these rules, so
both balance alike.
"""

from __future__ import annotations

from typing import Collection, Sequence

__all__ = ["cache_aware_choice", "candidates", "least_loaded"]


def candidates(addresses: Sequence[str], ejected: Collection[str], exclude: Collection[str] = ()) -> list[int]:
    """The positions in ``addresses`` a request may go to: those neither in ``exclude``
    (the instance a retry leaves) nor ``ejected``; when every one not excluded is
    ejected, all of those (one may be back, and the request has nowhere else to go).
    Empty when every one is excluded."""
    allowed = [i for i, a in enumerate(addresses) if a not in exclude]
    return [i for i in allowed if addresses[i] not in ejected] or allowed


def least_loaded(loads: Sequence[int], turn: int) -> int:
    """The position of the smallest load; ties go in turn from ``turn`` (they rotate
    rather than pile on the first)."""
    n = len(loads)
    return min(((turn + k) % n for k in range(n)), key=lambda i: loads[i])


def cache_aware_choice(
    matched: Sequence[int], loads: Sequence[int], turn: int, margin: int, sizes: Sequence[int] | None = None,
) -> int:
    """The position of the candidate holding the longest prefix (``matched`` tokens each;
    the less loaded on a tie), unless its load exceeds the smallest by more than
    ``margin``. A cached prefix saves its whole prefill, so it outweighs a small queue;
    the margin bounds the work that piles up on a candidate because it holds popular
    prefixes.

    When nobody holds any of the prompt, or the holder is over the margin: with
    ``sizes`` (what each candidate caches), the candidate caching least among those
    within ``margin`` of the smallest load, so new prefixes spread the cached ones
    evenly and no candidate evicts what it will be asked for while another has room;
    without, :func:`least_loaded`. Ties go to the less loaded, then in turn."""
    n = len(loads)
    least = least_loaded(loads, turn)
    best = max(((turn + k) % n for k in range(n)), key=lambda i: (matched[i], -loads[i]))
    if matched[best] > 0 and loads[best] - loads[least] <= margin:
        return best
    if sizes is None:
        return least
    near = [(turn + k) % n for k in range(n) if loads[(turn + k) % n] - loads[least] <= margin]
    return min(near, key=lambda i: (sizes[i], loads[i]))
