"""The prefix cache: full KV pages that earlier prompts computed, reused by later prompts.

A page is cached only when it is full; it is named by a hash chain over token ids, so a
page's name covers the whole prefix up to its last token:
``block_hash(parent, tokens, salt)`` is blake2b over the parent's name, the page's token
ids and a salt, read as a signed 64-bit integer (smg's ``block_hash`` is ``int64``). The
names are the same in every process and on every host, because nothing of Python's
``hash()`` enters them.

The cache sits over a page pool (an engine's ``alloc_pages``/``free_pages``) and hands out
:class:`Lease` objects: a prompt's longest cached prefix, locked, plus fresh pages for the
rest. Rules:

- At most ``(len(prompt) - 1) // page_size`` pages match: the last prompt token is always
  computed, so the last chunk yields the logits of the first generated token. A caller
  that computes nothing of the prompt (a decode, whose first token comes with the KV)
  passes ``whole=True``: every full page may match.
- A page is refcounted while a lease holds it; a held page is never evicted, so a page a
  request computes from, or a transfer reads, keeps its KV.
- When the pool runs short, unreferenced cached pages are evicted least recently used
  first. Released chains enter the LRU order deepest page first, so a prefix's tail goes
  before its head, and a head stays reachable as long as possible.
- A TP group's ranks each keep a cache and must all start the compute at one offset: a
  rank acquires with ``spare=True`` (a fresh page beside each matched one), the group
  agrees on the fewest matched pages, and :meth:`PrefixCache.settle` keeps that many,
  computing the rest into the spare pages. The pool gives such a lease as many fresh
  pages as a cold prompt takes, so a rank never waits for pages after agreeing.
- :meth:`PrefixCache.release` inserts a lease's full pages only when told their KV is
  complete (``insert=True``); a failed or aborted prompt's pages are freed.
- Every change of the set of reusable pages goes to the :class:`CacheEvents` sink:
  ``stored`` (parents first), ``removed`` on eviction, ``cleared`` on :meth:`clear`.
- :meth:`PrefixCache.announce` publishes a lease's own full pages as ``stored`` when its
  compute starts, before their KV is complete, so a router sends the prompts sharing them
  to this cache, where they wait for it (:mod:`pdgrpc.state.prefix_leaders`) instead of
  computing them elsewhere. An announced page is never matched before its lease inserts
  it; it is ``removed`` when the lease is released without inserting it. A page is
  published once, whether cached or announced.

Pure: no clocks, threads or I/O; one caller at a time (an engine's scheduler loop).
"""

from __future__ import annotations

import array
import collections
import dataclasses
import functools
import hashlib
import struct
import sys
from typing import Iterator, Protocol, Sequence

from pdgrpc.state.cache_events import CacheEvents, NoCacheEvents, StoredBlock
from pdgrpc.errors import ConfigError, SlotError

__all__ = ["Lease", "PagePool", "PrefixCache", "block_hash", "block_hashes"]

_ROOT = b"\x00" * 8  # the parent of a prompt's first page
_PERSON = b"pdgrpc-kv"
_INT64 = struct.Struct("<q")


def block_hash(parent: int | None, token_ids: Sequence[int], salt: bytes = b"") -> int:
    """The name of a full page: signed 64-bit, the same in every process."""
    return _name(parent, _salted(salt), _packed(token_ids))


def block_hashes(token_ids: Sequence[int], page_size: int, salt: bytes = b"") -> list[int]:
    """The names of every full page of ``token_ids``, first page first."""
    return list(_chain(token_ids, page_size, salt))


def _salted(salt: bytes) -> bytes:
    return struct.pack("<I", len(salt)) + salt


def _packed(token_ids: Sequence[int]) -> bytes:
    """``token_ids`` as little-endian int64s."""
    data = array.array("q", token_ids)
    if sys.byteorder != "little":
        data.byteswap()
    return data.tobytes()


def _name(parent: int | None, salted: bytes, page: bytes) -> int:
    head = _ROOT if parent is None else b"\x01" + _INT64.pack(parent)
    digest = hashlib.blake2b(head + salted + page, digest_size=8, person=_PERSON).digest()
    return int.from_bytes(digest, "little", signed=True)


def _chain(token_ids: Sequence[int], page_size: int, salt: bytes = b"", parent: int | None = None,
           start: int = 0) -> Iterator[int]:
    """The names of the full pages of ``token_ids`` from page ``start`` on (``parent``:
    the name of page ``start - 1``), computed as they are read: a caller that stops at
    the first uncached page hashes no further."""
    raw, salted, step = _packed(token_ids), _salted(salt), page_size * 8
    for i in range(start, len(token_ids) // page_size):
        parent = _name(parent, salted, raw[i * step : (i + 1) * step])
        yield parent


class PagePool(Protocol):
    """Where the cache takes pages from and returns them to (an engine's pool)."""

    def alloc_pages(self, n: int) -> list[int] | None: ...

    def free_pages(self, pages: Sequence[int]) -> None: ...

    @property
    def num_free_pages(self) -> int: ...


@dataclasses.dataclass(frozen=True)
class Lease:
    """One prompt's pages: ``pages[:cached_pages]`` hold a cached prefix (shared, never to
    be written), the rest are the prompt's own. Give it back with :meth:`PrefixCache.release`."""

    pages: tuple[int, ...]
    cached_pages: int
    page_size: int
    token_ids: tuple[int, ...]
    salt: bytes = b""
    known: tuple[int, ...] = ()  # names of the first full pages, as far as acquire() read them
    spare: tuple[int, ...] = ()  # fresh pages for the cached prefix, until settle()

    @functools.cached_property
    def hashes(self) -> tuple[int, ...]:
        """Names of the prompt's full pages: computed when first read, so a prompt whose
        first page misses the cache starts computing before the rest are hashed."""
        rest = _chain(self.token_ids, self.page_size, self.salt, self.known[-1] if self.known else None, len(self.known))
        return self.known + tuple(rest)

    @property
    def cached_tokens(self) -> int:
        """Tokens whose KV is already in the pages: compute starts here (page-aligned)."""
        return self.cached_pages * self.page_size


@dataclasses.dataclass(eq=False)
class _Entry:
    page: int
    block: StoredBlock
    refs: int = 0
    indexed: bool = True  # reusable; False once clear() dropped it while leases held it


class PrefixCache:
    """A prefix cache of full pages over ``pool``, ``page_size`` tokens a page."""

    def __init__(self, pool: PagePool, page_size: int, events: CacheEvents | None = None) -> None:
        if not isinstance(page_size, int) or page_size <= 0:
            raise ConfigError(f"PrefixCache: page_size must be a positive int, got {page_size!r}")
        self._pool = pool
        self.page_size = page_size
        self._events: CacheEvents = events if events is not None else NoCacheEvents()
        self._index: dict[int, _Entry] = {}  # block hash -> entry (reusable pages)
        self._shared: dict[int, _Entry] = {}  # page -> entry, for every cached or held-cached page
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # unreferenced pages, oldest first
        self._announced: dict[int, int] = {}  # block hash -> the page of the lease that published it ahead of its KV
        self.evictions = 0  # pages evicted since construction

    # ---- what it holds ---------------------------------------------------------------

    @property
    def num_cached_pages(self) -> int:
        """Pages holding reusable KV (held by a lease or not)."""
        return len(self._index)

    @property
    def num_announced_pages(self) -> int:
        """Pages published by :meth:`announce` and not cached (yet): their KV is being computed."""
        return sum(1 for h in self._announced if h not in self._index)

    @property
    def num_free_pages(self) -> int:
        """Pages an allocation may take: the pool's free pages and the evictable cached ones."""
        return self._pool.num_free_pages + len(self._lru)

    def match(self, token_ids: Sequence[int], salt: bytes = b"", whole: bool = False) -> int:
        """How many leading pages of ``token_ids`` are cached (at most all but the last
        token's; every full page with ``whole``)."""
        return len(self._match(token_ids[: len(token_ids) if whole else max(0, len(token_ids) - 1)], salt))

    def _match(self, token_ids: Sequence[int], salt: bytes) -> list[int]:
        """The names of the cached leading pages of ``token_ids``: hashing stops at the
        first page not cached."""
        out: list[int] = []
        for h in _chain(token_ids, self.page_size, salt):
            if h not in self._index:
                break
            out.append(h)
        return out

    # ---- leases ------------------------------------------------------------------------

    def acquire(
        self, token_ids: Sequence[int], num_pages: int, salt: bytes = b"", whole: bool = False, spare: bool = False,
    ) -> Lease | None:
        """Pages for a prompt: its longest cached prefix (as :meth:`match` counts it),
        locked, and fresh pages up to ``num_pages`` in all, evicting unreferenced cached
        pages as needed; with ``spare``, one more fresh page per matched page, for
        :meth:`settle`. ``None`` when the pool cannot supply them; nothing is taken then."""
        ids = tuple(token_ids)
        if not isinstance(num_pages, int) or num_pages < 0:
            raise ConfigError(f"acquire: num_pages must be an int >= 0, got {num_pages!r}")
        known = self._match(ids if whole else ids[: max(0, len(ids) - 1) // self.page_size * self.page_size], salt)
        matched = min(len(known), num_pages)
        held = [self._index[h] for h in known[:matched]]
        need = num_pages if spare else num_pages - matched
        unheld_matched = sum(1 for e in held if e.refs == 0)
        if self._pool.num_free_pages + len(self._lru) - unheld_matched < need:
            return None
        for e in held:
            self._hold(e)
        fresh = self._take(need)
        assert fresh is not None  # counted above
        own, extra = fresh[: num_pages - matched], fresh[num_pages - matched :]
        return Lease(tuple(e.page for e in held) + tuple(own), matched, self.page_size, ids, salt, tuple(known), tuple(extra))

    def settle(self, lease: Lease, keep: int) -> Lease:
        """``lease`` with only its first ``keep`` cached pages: the spare pages take the
        places of the others (their locks are dropped), the remaining spare pages go back
        to the pool. ``keep`` beyond the lease's cached pages, or below them without spare
        pages, is an error (nothing changes then)."""
        m = lease.cached_pages
        if not isinstance(keep, int) or not 0 <= keep <= m or (keep < m and len(lease.spare) != m):
            raise ConfigError(f"settle: keep must be an int in [0, {m}] (below {m} only with spare pages), got {keep!r}")
        for page in lease.pages[:m]:
            e = self._shared.get(page)
            if e is None or e.refs <= 0:
                raise SlotError(f"settle: page {page} is not held by a lease (released already?)")
        free = list(lease.spare[:keep])
        for page in reversed(lease.pages[keep:m]):  # the deepest page becomes the oldest
            self._unhold(self._shared[page], free)
        if free:
            self._pool.free_pages(free)
        pages = lease.pages[:keep] + lease.spare[keep:m] + lease.pages[m:]
        return dataclasses.replace(lease, pages=pages, cached_pages=keep, spare=())

    def announce(self, lease: Lease) -> None:
        """Publish ``lease``'s own full pages as stored, ahead of their KV: a page already
        published (cached, or announced by another lease) is skipped, and the announcement
        stops at a page whose parent is not published."""
        blocks: list[StoredBlock] = []
        for i in range(lease.cached_pages, len(lease.hashes)):
            h = lease.hashes[i]
            if h in self._index or h in self._announced:
                continue
            parent = lease.hashes[i - 1] if i else None
            if parent is not None and parent not in self._index and parent not in self._announced:
                break
            self._announced[h] = lease.pages[i]
            blocks.append(StoredBlock(h, parent, lease.token_ids[i * self.page_size : (i + 1) * self.page_size]))
        if blocks:
            self._events.stored(blocks)

    def release(self, lease: Lease, insert: bool) -> None:
        """Give ``lease`` back. ``insert``: its full pages hold complete KV of its prompt and
        become reusable; otherwise only the cached prefix it held stays cached."""
        for i, page in enumerate(lease.pages):  # all or nothing: check before any change
            e = self._shared.get(page)
            if i < lease.cached_pages and (e is None or e.refs <= 0):
                raise SlotError(f"release: page {page} is not held by a lease (released twice?)")
            if i >= lease.cached_pages and e is not None:
                raise SlotError(f"release: page {page} is cached, not the lease's own (released twice?)")
        free: list[int] = []
        stored: list[StoredBlock] = []
        withdrawn: list[int] = []  # announced by this lease, and not cached after all
        done: list[_Entry] = []  # entries to hand back to the LRU order, parents first
        for i, page in enumerate(lease.pages):
            if i < lease.cached_pages:
                done.append(self._shared[page])
                continue
            full = i < len(lease.hashes)
            mine = full and self._announced.get(lease.hashes[i]) == page
            if mine:
                del self._announced[lease.hashes[i]]
            if (not insert or not full or lease.hashes[i] in self._index
                    or (i and lease.hashes[i - 1] not in self._index)):
                # Not complete, not full, an equal page is cached already, or its parent is
                # gone (clear() during the lease): its own page goes back to the pool.
                free.append(page)
                if mine and lease.hashes[i] not in self._index:
                    withdrawn.append(lease.hashes[i])
                continue
            h = lease.hashes[i]
            parent = lease.hashes[i - 1] if i else None
            block = StoredBlock(h, parent, lease.token_ids[i * self.page_size : (i + 1) * self.page_size])
            e = _Entry(page, block, refs=1)
            self._index[h] = self._shared[page] = e
            if not mine and h not in self._announced:  # else published already
                stored.append(block)
            done.append(e)
        if stored:
            self._events.stored(stored)
        if withdrawn:
            self._events.removed(withdrawn[::-1])  # children first
        for e in reversed(done):  # the deepest page becomes the oldest: evicted first
            self._unhold(e, free)
        free += lease.spare
        if free:
            self._pool.free_pages(free)

    def alloc(self, n: int) -> list[int] | None:
        """``n`` uncached pages, evicting as needed; ``None`` (nothing taken) when short."""
        if not isinstance(n, int) or n < 0:
            raise ConfigError(f"alloc: n must be an int >= 0, got {n!r}")
        if self.num_free_pages < n:
            return None
        return self._take(n)

    def reclaim(self, n: int) -> None:
        """Evict unreferenced cached pages, least recently used first, until the pool has
        ``n`` free pages or nothing is left to evict (for an owner that allocates from the
        pool itself)."""
        short = n - self._pool.num_free_pages
        if short > 0:
            self._evict(short)

    def clear(self) -> None:
        """Forget every cached page: unreferenced ones go back to the pool now, held ones
        when their last lease is released."""
        free = [page for page in self._lru]
        for page in free:
            del self._shared[page]
        for e in self._index.values():
            e.indexed = False
        self._index.clear()
        self._lru.clear()
        self._announced.clear()
        if free:
            self._pool.free_pages(free)
        self._events.cleared()

    # ---- internals ---------------------------------------------------------------------

    def _hold(self, e: _Entry) -> None:
        if e.refs == 0:
            del self._lru[e.page]
        e.refs += 1

    def _unhold(self, e: _Entry, free: list[int]) -> None:
        e.refs -= 1
        if e.refs:
            return
        if e.indexed:
            self._lru[e.page] = None
        else:
            del self._shared[e.page]
            free.append(e.page)

    def _take(self, n: int) -> list[int] | None:
        short = n - self._pool.num_free_pages
        if short > 0:
            self._evict(short)
        return self._pool.alloc_pages(n)

    def _evict(self, n: int) -> None:
        gone: list[int] = []
        pages: list[int] = []
        for _ in range(min(n, len(self._lru))):
            page, _ = self._lru.popitem(last=False)
            e = self._shared.pop(page)
            del self._index[e.block.block_hash]
            self._announced.pop(e.block.block_hash, None)  # removed for its announcer too
            gone.append(e.block.block_hash)
            pages.append(page)
        if pages:
            self.evictions += len(pages)
            # Ascending, not in eviction order (a chain's deepest page first): the pool then
            # hands a later prompt contiguous runs, which the engine gathers and a transport
            # moves faster than pages in reverse.
            self._pool.free_pages(sorted(pages))
            self._events.removed(gone)
