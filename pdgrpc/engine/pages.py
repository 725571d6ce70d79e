"""The reference engine's page allocator: which KV pages of the pool are in use.

All-or-nothing and deterministic: ``alloc(n)`` hands out the ``n`` pages that have been
free the longest (FIFO), or ``None`` when fewer than ``n`` are free -- "none free, the caller waits". FIFO reuse spreads writes over the pool,
so a bug that reads a page after freeing it shows up in tests instead of hiding behind a
page that happens to be reallocated to the same request.

Misuse raises :class:`~pdgrpc.errors.SlotError` (double free, freeing a page that was never
handed out, an index outside the pool) and leaves the allocator unchanged. Not
thread-safe: an engine is driven by one scheduler loop.
"""

from __future__ import annotations

import collections
from typing import Iterable

from pdgrpc.errors import ConfigError, SlotError

__all__ = ["FifoPageAllocator"]


class FifoPageAllocator:
    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ConfigError(f"num_pages must be > 0, got {num_pages}")
        self.num_pages = num_pages
        self._free: collections.deque[int] = collections.deque(range(num_pages))
        self._used = [False] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """``n`` page indices, or ``None`` when fewer than ``n`` are free (nothing taken)."""
        if n < 0:
            raise ConfigError(f"alloc: n must be >= 0, got {n}")
        if n > len(self._free):
            return None
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._used[p] = True
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return ``pages`` to the pool. All-or-nothing: a bad index frees none of them."""
        pages = list(pages)
        seen: set[int] = set()
        for p in pages:
            if not isinstance(p, int) or not 0 <= p < self.num_pages:
                raise SlotError(f"free: page {p!r} is outside the pool [0, {self.num_pages})")
            if not self._used[p] or p in seen:
                raise SlotError(f"free: page {p} is not allocated (double free?)")
            seen.add(p)
        for p in pages:
            self._used[p] = False
        self._free.extend(pages)
