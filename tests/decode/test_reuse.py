"""pdgrpc.decode.reuse: the decode's prefix cache over its queues' pages.

A prompt's matched pages stay locked until the request ends, however hard eviction is
pushed; a request's generated tokens' full pages join the cache, its partial last page
does not; and with TP, rank 0's cache changes the pages only through calls the other ranks
replay, so every rank's allocator holds the same pages."""

from __future__ import annotations

import pickle
import random

import pytest

from pdgrpc.decode.job import SchedulerConfig
from pdgrpc.decode.rank import make_buffers, make_queues
from pdgrpc.decode.reuse import DecodeReuse
from pdgrpc.decode.tp import REPLAYED, ReplicatedQueues
from pdgrpc.errors import SlotError
from pdgrpc.kvpoll import KVPoll
from pdgrpc.state import DecodeQueues, NewRequest

PAGE = 4
NUM_PAGES = 8


def _free(q: DecodeQueues) -> list[int]:
    return [p for p in range(q.pages.num_pages) if q.pages.is_free(p)]


def _cached(reuse: DecodeReuse, ids: tuple[int, ...], pages: tuple[int, ...]) -> None:
    """Put ``ids``' KV, held in ``pages``, into the cache the way a finished request does."""
    lease = reuse.hold(ids, 0)
    reuse.release(lease, pages, ids)


def test_a_matched_page_stays_locked_until_its_request_ends_while_eviction_makes_room() -> None:
    q = make_queues(make_buffers(4), NUM_PAGES, SchedulerConfig())
    reuse = DecodeReuse(q, PAGE)
    prompt = tuple(range(1, 13))  # 3 full pages
    _cached(reuse, prompt, q.pages.alloc(3))
    assert q.pages.num_free == 5 and reuse.evictable == 3
    lease = reuse.hold(prompt + (99, 98), 10)  # admitted: locks the 3 pages until it ends
    assert lease.cached_pages == 3 and reuse.evictable == 0
    reuse.reclaim(NUM_PAGES)  # another request needs every page: nothing locked goes
    assert q.pages.num_free == 5
    taken = q.pages.alloc(5)
    assert taken is not None and not set(taken) & set(lease.pages)
    assert q.pages.alloc(1) is None
    q.release_pages(taken)
    reuse.release(lease, (), None)  # it ended before its KV landed: the prefix stays cached
    assert reuse.evictable == 3 and reuse.hold(prompt, 10).cached_pages == 3


def test_generated_pages_join_the_cache_and_the_partial_last_page_goes_back() -> None:
    q = make_queues(make_buffers(4), NUM_PAGES, SchedulerConfig())
    reuse = DecodeReuse(q, PAGE)
    prompt = tuple(range(1, 7))  # one full page and 2 tokens
    answer = (40, 41, 42, 43, 44)  # fed back: all but the last, so the KV covers 10 tokens
    lease = reuse.hold(prompt, 10)
    own = q.pages.alloc(3)
    kv_ids = prompt + answer[:-1]
    reuse.release(lease, own, kv_ids)
    assert reuse.cache.num_cached_pages == 2 and q.pages.is_free(own[2])  # 10 tokens: 2 full pages
    next_turn = prompt + answer + (7, 8, 9)
    assert reuse.hold(next_turn, 10).cached_pages == 2  # the answer's page matches too


def test_kv_ids_that_do_not_begin_with_the_prompt_are_refused_and_nothing_changes() -> None:
    q = make_queues(make_buffers(4), NUM_PAGES, SchedulerConfig())
    reuse = DecodeReuse(q, PAGE)
    prompt = tuple(range(1, 9))
    lease = reuse.hold(prompt, 10)
    own = q.pages.alloc(2)
    with pytest.raises(SlotError, match="kv_ids"):
        reuse.release(lease, own, (0,) + prompt[1:])
    assert reuse.cache.num_cached_pages == 0 and q.pages.num_free == NUM_PAGES - 2


def test_with_tp_every_rank_replays_the_same_pages() -> None:
    config = SchedulerConfig()
    lead = ReplicatedQueues(make_buffers(4), NUM_PAGES, config.deadlines, config.query_interval_s)
    follower = make_queues(make_buffers(4), NUM_PAGES, config)
    reuse = DecodeReuse(lead, PAGE)
    rng = random.Random(3)
    history: tuple[int, ...] = ()
    hits = 0
    for room in range(1, 13):
        now = room * 0.1
        # Chat turns: each prompt begins with the last one's, now and then a new chat.
        history = (history if room % 4 else ()) + tuple(rng.randrange(1, 50) for _ in range(rng.randint(1, 5)))
        history = history[-14:]
        lease = reuse.hold(history, 3)
        hits += lease.cached_pages
        n_pages = -(-(len(history) + 2) // PAGE)
        reuse.reclaim(n_pages - lease.cached_pages)  # as the scheduler does before prealloc
        lead.add(NewRequest(room, "p:1", n_pages - lease.cached_pages, 0, fake=True), now)
        (hs,) = lead.prealloc(now)
        for name, args in pickle.loads(pickle.dumps(lead.take_log())):
            assert name in REPLAYED
            getattr(follower, name)(*args)
        for q in (lead, follower):  # the KV landed on both ranks: committed, slot freed
            assert [o.room for o in q.poll_transfers(now, local_poll=lambda r: KVPoll.SUCCESS)] == [room]
        kv_ids = history + (7,)  # one generated token fed back
        split = -(-len(kv_ids) // PAGE) - lease.cached_pages
        reuse.release(lease, hs.pages[:split], kv_ids)
        lead.release_pages(hs.pages[split:])
        for name, args in pickle.loads(pickle.dumps(lead.take_log())):
            getattr(follower, name)(*args)
        assert _free(follower) == _free(lead), room
    assert hits and reuse.cache.evictions  # prompts matched, and the pool was small enough to evict
