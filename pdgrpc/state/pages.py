"""KV page allocator with quarantine.

Pages of a request that completed normally go straight back to the pool. Pages of an
aborted or failed request may still be the target of a live writer (the prefill has not
heard of the abort yet, or its RDMA writes are in flight), so they are **quarantined**
under their owner's room and return to the pool only when the owner is released (the
prefill acknowledged the abort, or its lease expired; the decode queues decide which).
No late write can then land in a page that a new request owns.

Allocation is all-or-nothing and deterministic (a LIFO free list: ranks that apply the same
alloc/free sequence get the same pages): ``alloc(n)`` returns ``None`` when
fewer than ``n`` pages are free, and the caller waits. Freed pages go back so that they
are handed out again in the order they were held: a request that got a contiguous
ascending run returns it, and the next one gets an ascending run too, which a transport
sends as one op (a descending run is one op per page).
"""

from __future__ import annotations

from typing import Iterable

from pdgrpc.errors import ConfigError, SlotError

__all__ = ["PageAllocator"]

_FREE, _USED, _QUARANTINED = 0, 1, 2


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ConfigError(f"num_pages must be > 0, got {num_pages}")
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop from the end: 0, 1, 2, ...
        self._state = bytearray(num_pages)
        self._quarantine: dict[int, tuple[int, ...]] = {}
        self._num_quarantined = 0

    def alloc(self, n: int) -> tuple[int, ...] | None:
        if n <= 0:
            raise ConfigError(f"alloc(n): n must be > 0, got {n}")
        if n > len(self._free):
            return None
        free, state = self._free, self._state
        pages = tuple(free[: -n - 1 : -1])
        del free[-n:]
        for p in pages:
            state[p] = _USED
        return pages

    def free(self, pages: Iterable[int]) -> None:
        pages = tuple(pages)
        self._check_used(pages, "free")
        for p in pages:
            self._state[p] = _FREE
        self._free.extend(reversed(pages))  # reallocated in the order they were held

    def quarantine(self, owner: int, pages: Iterable[int]) -> None:
        """Hold ``pages`` (in use by ``owner``) until :meth:`release` of ``owner``."""
        pages = tuple(pages)
        if owner in self._quarantine:
            raise SlotError(f"quarantine({owner}): owner already has quarantined pages")
        self._check_used(pages, "quarantine")
        for p in pages:
            self._state[p] = _QUARANTINED
        self._quarantine[owner] = pages
        self._num_quarantined += len(pages)

    def release(self, owner: int) -> tuple[int, ...]:
        """Return ``owner``'s quarantined pages to the pool."""
        try:
            pages = self._quarantine.pop(owner)
        except KeyError:
            raise SlotError(f"release({owner}): owner has no quarantined pages") from None
        for p in pages:
            self._state[p] = _FREE
        self._free.extend(reversed(pages))
        self._num_quarantined -= len(pages)
        return pages

    def is_free(self, page: int) -> bool:
        return self._state[page] == _FREE

    def is_quarantined(self, page: int) -> bool:
        return self._state[page] == _QUARANTINED

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_quarantined(self) -> int:
        return self._num_quarantined

    def _check_used(self, pages: tuple[int, ...], op: str) -> None:
        if len(set(pages)) != len(pages):
            raise SlotError(f"{op}: duplicate page in {pages}")
        for p in pages:
            if not 0 <= p < self.num_pages:
                raise SlotError(f"{op}: page {p} out of range [0, {self.num_pages})")
            if self._state[p] != _USED:
                what = "free" if self._state[p] == _FREE else "quarantined"
                raise SlotError(f"{op}: page {p} is {what}, not allocated (double free?)")
