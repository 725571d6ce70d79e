"""Capped exponential backoff with full jitter (pure: no clock, no sleeping).

``Backoff(initial=0.05, maximum=2.0, multiplier=2.0)`` yields delays for attempt 1, 2,
...: attempt ``k`` waits a uniform random time in ``[0, min(maximum, initial *
multiplier**(k-1))]`` ("full jitter", so clients that failed together do not retry
together). The caller owns the clock and the overall deadline.
"""

from __future__ import annotations

import dataclasses
import random


@dataclasses.dataclass(frozen=True)
class Backoff:
    initial: float = 0.05  # cap of the first delay, seconds
    maximum: float = 2.0  # cap of every delay, seconds
    multiplier: float = 2.0  # growth of the cap per attempt

    def __post_init__(self) -> None:
        if not (0 < self.initial <= self.maximum and self.multiplier >= 1):
            raise ValueError(f"need 0 < initial <= maximum and multiplier >= 1, got {self}")

    def cap(self, attempt: int) -> float:
        """Upper bound of the delay after failed attempt ``attempt`` (1-based)."""
        return min(self.maximum, self.initial * self.multiplier ** max(0, attempt - 1))

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """A jittered delay in ``[0, cap(attempt)]``."""
        return (rng or random).uniform(0.0, self.cap(attempt))
