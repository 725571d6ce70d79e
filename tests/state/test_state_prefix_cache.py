"""The prefix cache: page names, reuse, refcounts, LRU eviction and the events it reports."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Sequence

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdgrpc.state.cache_events import StoredBlock
from pdgrpc.engine.pages import FifoPageAllocator
from pdgrpc.state.prefix_cache import Lease, PrefixCache, block_hash, block_hashes
from pdgrpc.errors import ConfigError, SlotError

PS = 4


class Pool:
    """An engine's page pool, as the cache sees it."""

    def __init__(self, n: int) -> None:
        self.a = FifoPageAllocator(n)

    def alloc_pages(self, n: int) -> list[int] | None:
        return self.a.alloc(n)

    def free_pages(self, pages: Sequence[int]) -> None:
        self.a.free(pages)

    @property
    def num_free_pages(self) -> int:
        return self.a.num_free


class Log:
    """A consumer of the events: the blocks it believes are reusable (or announced), checked as they come."""

    def __init__(self) -> None:
        self.live: dict[int, StoredBlock] = {}
        self.stored_order: list[int] = []
        self.gone: list[int] = []

    def stored(self, blocks: Sequence[StoredBlock]) -> None:
        for b in blocks:
            assert b.block_hash not in self.live, "stored twice"
            assert b.parent_hash is None or b.parent_hash in self.live, "child before its parent"
            assert len(b.token_ids) == PS
            self.live[b.block_hash] = b
            self.stored_order.append(b.block_hash)

    def removed(self, block_hashes: Sequence[int]) -> None:
        for h in block_hashes:
            assert self.live.pop(h, None) is not None, "removed a block never stored"
            self.gone.append(h)

    def cleared(self) -> None:
        self.live.clear()


def test_names_are_blake2b_of_the_parent_salt_and_tokens() -> None:
    """The wire meaning of a name, computed here independently: another implementation
    (another router, a gateway) that follows it names the same pages the same way."""
    import hashlib
    import struct

    def spec(parent: int | None, tokens: Sequence[int], salt: bytes) -> int:
        h = hashlib.blake2b(digest_size=8, person=b"pdgrpc-kv")
        h.update(b"\x00" * 8 if parent is None else b"\x01" + struct.pack("<q", parent))
        h.update(struct.pack("<I", len(salt)) + salt)
        h.update(struct.pack(f"<{len(tokens)}q", *tokens))
        return int.from_bytes(h.digest(), "little", signed=True)

    ids = [0, 1, 2**40, 151_643, -1, 7, 2**63 - 1, 3, 5, 8, 13, 21]
    parent = None
    for i, h in enumerate(block_hashes(ids, PS, b"s")):
        parent = spec(parent, ids[i * PS : (i + 1) * PS], b"s")
        assert h == parent
    assert block_hash(None, ids[:PS]) == spec(None, ids[:PS], b"")


def test_a_lease_names_every_full_page_whatever_acquire_hashed() -> None:
    """acquire() hashes only as far as the cache matches; the lease still names every full
    page of its prompt, cached or not, exactly as block_hashes does."""
    cache = PrefixCache(Pool(64), PS)
    ids = tuple(range(100, 100 + 5 * PS + 2))
    cold = cache.acquire(ids, 6)
    assert cold is not None and cold.cached_pages == 0 and cold.known == ()
    assert cold.hashes == tuple(block_hashes(ids, PS))
    cache.release(cold, insert=True)
    warm = cache.acquire(ids[: 3 * PS] + (1, 2, 3, 4, 5, 6, 7, 8, 9), 5)
    assert warm is not None and warm.cached_pages == 3
    assert warm.hashes == tuple(block_hashes(warm.token_ids, PS))
    assert warm.hashes[:3] == cold.hashes[:3] and warm.hashes[3] != cold.hashes[3]
    cache.release(warm, insert=False)


def test_pages_evicted_for_a_prompt_come_back_as_ascending_runs() -> None:
    """A full cache evicts a chain deepest page first; a later prompt still gets its pages
    in ascending runs, as from a cold pool (what the engine gathers and a transport sends
    as one contiguous message)."""
    cache = PrefixCache(Pool(8), PS)
    first = cache.acquire(tuple(range(1, 8 * PS + 1)), 8)
    assert first is not None and list(first.pages) == list(range(8))
    cache.release(first, insert=True)  # 8 cached pages, nothing free
    second = cache.acquire(tuple(range(500, 500 + 8 * PS + 1)), 8)
    assert second is not None and list(second.pages) == sorted(second.pages)


def test_names_are_deterministic_signed_64_bit_and_chain_their_prefix() -> None:
    ids = list(range(3, 3 + 3 * PS))
    hs = block_hashes(ids, PS)
    assert len(hs) == 3 and all(-(2**63) <= h < 2**63 for h in hs)
    assert hs[1] == block_hash(hs[0], ids[PS : 2 * PS])
    # A different first page renames every later page, though their own tokens are equal.
    other = block_hashes([99] + ids[1:], PS)
    assert all(a != b for a, b in zip(hs, other))
    # A salt renames every page; the same salt gives the same names.
    salted = block_hashes(ids, PS, salt=b"tenant-a")
    assert salted == block_hashes(ids, PS, salt=b"tenant-a")
    assert not set(salted) & set(hs) and not set(salted) & set(block_hashes(ids, PS, salt=b"tenant-b"))
    # Only full pages have names.
    assert block_hashes(ids[: 2 * PS + 3], PS) == hs[:2]
    # The same names in another process, whatever its hash seed.
    code = f"from pdgrpc.state.prefix_cache import block_hashes; print(block_hashes({ids!r}, {PS}, b'tenant-a'))"
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, timeout=60)
        assert out.stdout.strip() == repr(salted)


def test_second_prompt_reuses_the_prefix_but_computes_its_last_token() -> None:
    log = Log()
    cache = PrefixCache(Pool(16), PS, log)
    prompt = tuple(range(1, 2 * PS + 1))  # exactly two full pages
    first = cache.acquire(prompt, 2)
    assert first is not None and first.cached_pages == 0
    cache.release(first, insert=True)
    assert cache.num_cached_pages == 2 and len(log.live) == 2
    again = cache.acquire(prompt, 2)
    assert again is not None
    assert again.cached_pages == 1 and again.cached_tokens == PS  # the last page holds the last token
    assert again.pages[0] == first.pages[0] and again.pages[1] != first.pages[1]
    longer = cache.acquire(prompt + (7,), 3)
    assert longer is not None and longer.pages[:2] == first.pages and longer.cached_tokens == 2 * PS
    cache.release(again, insert=True)
    cache.release(longer, insert=True)
    assert cache.match(prompt + (7, 8)) == 2


def test_failed_prompt_inserts_nothing_and_double_release_is_refused() -> None:
    pool = Pool(8)
    cache = PrefixCache(pool, PS)
    lease = cache.acquire(tuple(range(1, 3 * PS)), 3)
    assert lease is not None
    cache.release(lease, insert=False)
    assert cache.num_cached_pages == 0 and pool.num_free_pages == 8
    with pytest.raises(SlotError):
        cache.release(lease, insert=False)
    lease = cache.acquire(tuple(range(1, 3 * PS)), 3)
    assert lease is not None
    cache.release(lease, insert=True)
    with pytest.raises(SlotError, match="released twice"):
        cache.release(lease, insert=True)
    assert cache.num_cached_pages == 2


def test_eviction_racing_admission_never_takes_a_held_page() -> None:
    log = Log()
    pool = Pool(6)
    cache = PrefixCache(pool, PS, log)
    a = tuple(range(1, 3 * PS + 1))
    b = tuple(range(100, 100 + 3 * PS))
    for prompt in (a, b):
        lease = cache.acquire(prompt, 3)
        assert lease is not None
        cache.release(lease, insert=True)
    assert pool.num_free_pages == 0 and cache.num_free_pages == 6
    held = cache.acquire(a + (5,), 4)  # holds a's three pages, evicts one of b's
    assert held is not None and held.cached_pages == 3 and cache.evictions == 1
    assert log.gone == [block_hashes(b, PS)[-1]]  # the tail of a chain goes first
    # Two more pages are evictable (b's head); a's pages are held: three do not fit.
    assert cache.acquire(tuple(range(200, 200 + 3 * PS)), 3) is None
    assert cache.num_cached_pages == 5 and cache.evictions == 1  # nothing taken, nothing evicted
    other = cache.acquire(tuple(range(200, 200 + 2 * PS)), 2)
    assert other is not None and not set(other.pages) & set(held.pages)
    assert cache.match(a + (5,)) == 3 and cache.match(b) == 0
    cache.release(held, insert=True)
    cache.release(other, insert=True)
    assert cache.evictions == 3 and set(log.live) == set(block_hashes(a, PS) + block_hashes(tuple(range(200, 200 + 2 * PS)), PS))


def test_clear_forgets_everything_and_held_pages_return_on_release() -> None:
    log = Log()
    pool = Pool(8)
    cache = PrefixCache(pool, PS, log)
    prompt = tuple(range(1, 2 * PS + 2))
    first = cache.acquire(prompt, 3)
    assert first is not None
    cache.release(first, insert=True)
    held = cache.acquire(prompt, 3)
    assert held is not None and held.cached_pages == 2
    cache.clear()
    assert log.live == {} and cache.num_cached_pages == 0 and cache.match(prompt) == 0
    cache.release(held, insert=True)  # its cached pages were dropped: nothing is inserted
    assert pool.num_free_pages == 8 and cache.num_cached_pages == 0


def test_tp_ranks_with_different_caches_settle_on_the_fewest_pages() -> None:
    """Two TP ranks whose caches differ (rank 1 evicted a prefix's tail) agree on the
    fewest cached pages: both compute from there, the rank that held more computes into
    its spare pages, and nothing leaks."""
    prompt = tuple(range(1, 3 * PS + 2))  # three full pages and one token
    pools = [Pool(8), Pool(8)]
    ranks = [PrefixCache(pool, PS) for pool in pools]
    for cache in ranks:
        first = cache.acquire(prompt, 4)
        assert first is not None
        cache.release(first, insert=True)
    ranks[1].reclaim(6)  # rank 1's pool ran short: it evicted the prefix's last page
    leases = [cache.acquire(prompt, 4, spare=True) for cache in ranks]
    assert [lease.cached_pages for lease in leases if lease] == [3, 2]
    assert [len(lease.spare) for lease in leases if lease] == [3, 2]
    # Spare pages come from the pool: as many fresh pages as a cold prompt takes.
    assert [pool.num_free_pages for pool in pools] == [8 - 4 - 3, 8 - 4 - 2]
    keep = min(lease.cached_pages for lease in leases if lease)
    settled = [cache.settle(lease, keep) for cache, lease in zip(ranks, leases) if lease]
    assert [s.cached_tokens for s in settled] == [2 * PS, 2 * PS]
    assert settled[0].pages[:2] == leases[0].pages[:2] and settled[0].pages[2] == leases[0].spare[2]
    assert [pool.num_free_pages for pool in pools] == [8 - 4 - 1, 8 - 4 - 0]  # rank 0's cached third page is unlocked, not freed
    with pytest.raises(ConfigError, match="keep must be"):
        ranks[0].settle(settled[0], 3)
    for cache, lease in zip(ranks, settled):
        cache.release(lease, insert=True)
        assert cache.match(prompt) == 3
    assert [pool.num_free_pages + cache.num_cached_pages for pool, cache in zip(pools, ranks)] == [8, 8]


class CacheMachine(RuleBasedStateMachine):
    """Random leases over a small pool, checked against a model of what each page holds."""

    NUM_PAGES = 10

    def __init__(self) -> None:
        super().__init__()
        self.pool = Pool(self.NUM_PAGES)
        self.log = Log()
        self.cache = PrefixCache(self.pool, PS, self.log)
        self.leases: list[Lease] = []
        self.kv: dict[int, tuple[object, ...]] = {}  # page -> (salt, the prefix whose last page it holds)
        self.orphans: set[int] = set()  # held pages clear() dropped from the cache
        self.salts: dict[int, bytes] = {}  # id(lease) -> its salt

    @rule(
        prompt=st.lists(st.integers(0, 2), min_size=1, max_size=4 * PS),
        extra=st.integers(0, 2),
        salt=st.sampled_from([b"", b"s"]),
        spare=st.booleans(),
    )
    def acquire(self, prompt: list[int], extra: int, salt: bytes, spare: bool) -> None:
        ids = tuple(prompt)
        need = -(-len(ids) // PS) + extra
        before = (self.pool.num_free_pages, self.cache.num_cached_pages, self.cache.evictions)
        lease = self.cache.acquire(ids, need, salt, spare=spare)
        if lease is None:
            assert self.cache.num_free_pages < need if not spare else self.cache.num_free_pages - self.cache.match(ids, salt) < need
            assert (self.pool.num_free_pages, self.cache.num_cached_pages, self.cache.evictions) == before
            return
        assert len(lease.pages) == need and len(set(lease.pages + lease.spare)) == need + len(lease.spare)
        assert len(lease.spare) == (lease.cached_pages if spare else 0)  # a TP rank: as many fresh pages as a cold prompt
        self.salts[id(lease)] = salt
        assert lease.cached_tokens < len(ids)  # the last token is always computed
        for i in range(lease.cached_pages):  # a match holds exactly this prefix's KV
            assert self.kv[lease.pages[i]] == (salt,) + ids[: (i + 1) * PS]
        for i in range(lease.cached_pages, need):  # "compute" the rest
            self.kv[lease.pages[i]] = (salt,) + ids[: (i + 1) * PS]
        self.leases.append(lease)

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 100), insert=st.booleans())
    def release(self, i: int, insert: bool) -> None:
        self.cache.release(self.leases.pop(i % len(self.leases)), insert)

    @precondition(lambda self: any(lease.spare for lease in self.leases))
    @rule(i=st.integers(0, 100), keep=st.integers(0, 100))
    def settle(self, i: int, keep: int) -> None:
        """A TP group agreed on ``keep`` cached pages: the rest are computed into spare pages."""
        with_spare = [lease for lease in self.leases if lease.spare]
        lease = with_spare[i % len(with_spare)]
        keep %= lease.cached_pages + 1
        settled = self.cache.settle(lease, keep)
        assert settled.pages[:keep] == lease.pages[:keep] and settled.pages[lease.cached_pages :] == lease.pages[lease.cached_pages :]
        assert settled.cached_pages == keep and settled.spare == () and len(settled.pages) == len(lease.pages)
        salt = self.salts.pop(id(lease))
        for j in range(keep, lease.cached_pages):  # "compute" what the group did not keep
            self.kv[settled.pages[j]] = (salt,) + lease.token_ids[: (j + 1) * PS]
        self.leases[self.leases.index(lease)] = settled
        self.salts[id(settled)] = salt

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 100))
    def announce(self, i: int) -> None:
        """A lease's compute starts: its pages are published, and still never matched."""
        lease = self.leases[i % len(self.leases)]
        salt = self.salts[id(lease)]
        before = [self.cache.match(lease.token_ids[:n], salt, whole=True) for n in range(0, len(lease.token_ids) + 1, PS)]
        self.cache.announce(lease)
        assert before == [self.cache.match(lease.token_ids[:n], salt, whole=True) for n in range(0, len(lease.token_ids) + 1, PS)]

    @rule()
    def clear(self) -> None:
        self.cache.clear()
        self.orphans = {p for lease in self.leases for p in lease.pages[: lease.cached_pages]}

    @invariant()
    def held_pages_are_never_shared_with_another_lease_or_evicted(self) -> None:
        own = [p for lease in self.leases for p in lease.pages[lease.cached_pages :] + lease.spare]
        assert len(own) == len(set(own))
        shared = {p for lease in self.leases for p in lease.pages[: lease.cached_pages]}
        assert not shared & set(own)
        # Every page is free, a lease's own, cached, or held after clear() dropped it: none is lost.
        self.orphans &= shared
        assert self.pool.num_free_pages + len(own) + self.cache.num_cached_pages + len(self.orphans) == self.NUM_PAGES
        assert self.cache.num_free_pages <= self.NUM_PAGES - len(own) - len(shared)

    @invariant()
    def the_event_log_agrees_with_the_cache(self) -> None:
        assert len(self.log.live) == self.cache.num_cached_pages + self.cache.num_announced_pages

    def teardown(self) -> None:
        for lease in self.leases:
            self.cache.release(lease, insert=False)
        self.cache.clear()
        assert self.pool.num_free_pages == self.NUM_PAGES  # nothing leaked


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None, derandomize=True)


def test_whole_matches_every_full_page_and_reclaim_evicts_only_unheld_pages() -> None:
    """A decode computes none of the prompt: every full page may match, also the last
    token's. ``reclaim`` frees unreferenced pages, least recently used first, for an owner
    that allocates from the pool itself."""
    pool = Pool(8)
    cache = PrefixCache(pool, PS)
    ids = list(range(8))  # two full pages
    lease = cache.acquire(ids, 2)
    assert lease is not None
    cache.release(lease, insert=True)
    assert cache.match(ids) == 1 and cache.match(ids, whole=True) == 2
    held = cache.acquire(ids, 2, whole=True)
    assert held is not None and held.cached_pages == 2 and pool.num_free_pages == 6
    cache.reclaim(8)  # both cached pages are held: nothing to evict
    assert pool.num_free_pages == 6 and cache.num_cached_pages == 2
    cache.release(held, insert=False)
    cache.reclaim(7)  # one page short: the deeper page goes first
    assert pool.num_free_pages == 7 and cache.match(ids, whole=True) == 1


def test_announced_pages_are_published_once_and_withdrawn_when_not_cached() -> None:
    """A prompt's pages are published as its compute starts; inserting them later tells
    nothing new, a failed prompt removes them (children first), and they are never
    matched before they are cached."""
    log = Log()
    cache = PrefixCache(Pool(16), PS, log)
    ids = list(range(3 * PS + 1))  # three full pages
    lease = cache.acquire(ids, 4)
    assert lease is not None
    cache.announce(lease)
    assert log.stored_order == block_hashes(ids, PS) and cache.num_announced_pages == 3
    assert cache.match(ids) == 0  # their KV is not complete
    twin = cache.acquire(ids, 4)  # the same prompt, computing beside it: nothing to publish
    assert twin is not None
    cache.announce(twin)
    assert len(log.stored_order) == 3
    cache.release(twin, insert=True)  # cached by the twin: published already
    assert len(log.stored_order) == 3 and cache.num_cached_pages == 3 and cache.num_announced_pages == 0
    cache.release(lease, insert=False)  # its own pages were not cached, an equal copy is
    assert log.gone == [] and cache.match(ids) == 3

    other = [99] + ids[1:]
    failed = cache.acquire(other, 4)
    assert failed is not None
    cache.announce(failed)
    cache.release(failed, insert=False)
    assert log.gone == block_hashes(other, PS)[::-1] and cache.num_announced_pages == 0
