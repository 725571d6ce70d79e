"""The decode's prefix cache: prompt pages that earlier requests received stay here for
later prompts that begin the same way, and their prefill sends only the rest.

At admission a request locks the prompt's longest cached run of full pages
(:meth:`DecodeReuse.hold`); the decode queues allocate only its other pages, and the
handshake tells the prefill how many leading pages to skip (``cached_pages``). The
transport's grant holds only the pages the prefill writes, so a write into a cached page
is refused. When a request ends after its KV landed, its full pages join the cache
(:meth:`DecodeReuse.release`), the generated tokens' pages too, so the next turn of a chat
(this prompt, its answer and a new message) finds the answer; its other pages, the last
partial one among them, go back to the queues.

The cache is :class:`~pdgrpc.state.prefix_cache.PrefixCache` over the decode queues' page
allocator, the one source of truth for the pool: cached pages count as allocated there,
and the scheduler reclaims unreferenced ones (:meth:`DecodeReuse.reclaim`) before the
queues allocate. Only the scheduler's loop touches it. With TP it lives on rank 0: every
page it takes came from the queues and every page it frees goes back through
``release_pages``, calls the other ranks replay, so each rank holds the same pages.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from pdgrpc.state.cache_events import CacheEvents
from pdgrpc.state.prefix_cache import Lease, PrefixCache
from pdgrpc.errors import SlotError
from pdgrpc.state import DecodeQueues

__all__ = ["DecodeReuse"]


class _QueuePages:
    """The decode queues' page allocator as the cache's page pool."""

    def __init__(self, queues: DecodeQueues) -> None:
        self._queues = queues

    def alloc_pages(self, n: int) -> list[int] | None:
        # The queues allocate every page a request writes (a call TP ranks replay); the
        # cache only locks pages it holds already.
        if n:
            raise SlotError(f"the decode prefix cache takes no pages of its own (asked for {n})")
        return []

    def free_pages(self, pages: Sequence[int]) -> None:
        self._queues.release_pages(pages)

    @property
    def num_free_pages(self) -> int:
        return self._queues.pages.num_free


class DecodeReuse:
    """A prefix cache of ``page_size``-token pages over ``queues``' pool; what it stores
    and evicts goes to ``events`` (the decode's ``SubscribeKvEvents``)."""

    def __init__(self, queues: DecodeQueues, page_size: int, events: CacheEvents | None = None) -> None:
        self._pool = _QueuePages(queues)
        self.cache = PrefixCache(self._pool, page_size, events)

    def hold(self, input_ids: Sequence[int], most: int) -> Lease:
        """Lock the longest cached run of ``input_ids``' full pages, at most ``most``
        pages (the lease holds no page of its own)."""
        k = min(self.cache.match(input_ids, whole=True), most)
        lease = self.cache.acquire(input_ids, k, whole=True)
        assert lease is not None and lease.cached_pages == k  # locking cached pages takes nothing from the pool
        return lease

    def release(self, lease: Lease, own_pages: Sequence[int], kv_ids: Sequence[int] | None) -> None:
        """Unlock ``lease``. ``kv_ids``: the tokens whose KV the lease's pages and then
        ``own_pages`` (the request's pages after the cached ones) hold -- the prompt and
        what the request generated -- or None when the prompt's KV never landed. Their
        full pages join the cache; the rest go back to the queues."""
        if kv_ids is None:
            self.cache.release(dataclasses.replace(lease, pages=lease.pages + tuple(own_pages)), insert=False)
            return
        ids = tuple(kv_ids)
        if ids[: len(lease.token_ids)] != lease.token_ids:
            raise SlotError("DecodeReuse.release: kv_ids must begin with the lease's prompt")
        # The prompt's chain goes on over the generated tokens: a later prompt that repeats
        # this one's answer matches those pages too.
        full = dataclasses.replace(lease, pages=lease.pages + tuple(own_pages), token_ids=ids, known=lease.hashes)
        self.cache.release(full, insert=True)

    def reclaim(self, need: int) -> None:
        """Evict unreferenced cached pages until the queues have ``need`` free pages (or
        nothing is left to evict)."""
        self.cache.reclaim(need)

    @property
    def evictable(self) -> int:
        """Cached pages no request holds: free for the taking."""
        return self.cache.num_free_pages - self._pool.num_free_pages
