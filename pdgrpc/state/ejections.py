"""Which prefill and decode instances the router passes over for now.

A call that fails UNAVAILABLE (the instance is gone, unreachable, draining, or lost a
worker) ejects its instance for ``seconds``: new requests and retries pick among the
others, so a dead instance costs one failed attempt rather than every n-th request's.
When every instance of a role is ejected, requests go to them anyway (one of them may be
back, and a request has nowhere else to go). A call sent since the ejection that
succeeds ends it early; a call sent before does not, because a draining instance finishes
the streams it admitted while it refuses new ones. Pure: the clock is a parameter;
:class:`~pdgrpc.router.service.GenerateServicer` logs and counts.
"""

from __future__ import annotations

from typing import Callable, Sequence

__all__ = ["Ejections"]


class Ejections:
    """Ejected ``(role, address)`` pairs and when each ejection ends. At most one entry per
    instance that failed within the last ``seconds``: bounded by the instances known."""

    def __init__(self, seconds: float, clock: Callable[[], float]) -> None:
        self.seconds = seconds  # how long an ejection lasts; 0: never eject
        self._clock = clock
        # (role, address) -> clock() when it was last ejected, and when it ends
        self._until: dict[tuple[str, str], tuple[float, float]] = {}

    def eject(self, role: str, address: str) -> bool:
        """Pass ``address`` over from now for ``seconds`` (again, if it already was).
        True when it was not ejected before."""
        if self.seconds <= 0:
            return False
        now = self._clock()
        for key in [k for k, (_, until) in self._until.items() if until <= now]:
            del self._until[key]
        fresh = (role, address) not in self._until
        self._until[(role, address)] = (now, now + self.seconds)
        return fresh

    def recovered(self, role: str, address: str, sent: float) -> bool:
        """A call to ``address`` sent at ``sent`` (on this clock) succeeded: unless it was
        sent before the last ejection, ``address`` is no longer ejected. True if it was."""
        entry = self._until.get((role, address))
        if entry is None or sent < entry[0]:
            return False
        del self._until[(role, address)]
        return True

    def __len__(self) -> int:
        """Entries held: ejections in force, and those run out that no later
        :meth:`eject` has dropped yet."""
        return len(self._until)

    def now(self, role: str) -> frozenset[str]:
        """The addresses of ``role`` ejected now (:func:`~pdgrpc.state.routing.candidates`
        passes them over)."""
        now = self._clock()
        return frozenset(a for (r, a), (_, until) in self._until.items() if r == role and until > now)
