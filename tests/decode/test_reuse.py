"""pdgrpc.decode.reuse: the decode's prefix cache over its queues' pages.

A prompt's matched pages stay locked until the request ends, however hard eviction is
pushed; a request's generated tokens' full pages join the cache, its partial last page
does not; and with TP, rank 0's cache changes the pages only through calls the other ranks
replay, so every rank's allocator holds the same pages."""

from __future__ import annotations

import dataclasses
import pickle
import random

import pytest

from pdgrpc.decode.job import SchedulerConfig
from pdgrpc.decode.rank import make_buffers, make_queues
from pdgrpc.decode.reuse import DecodeReuse
from pdgrpc.decode.tp import REPLAYED, ReplicatedQueues
from pdgrpc.errors import SlotError
from pdgrpc.kvpoll import KVPoll
from pdgrpc.state import Aborted, DecodeQueues, NewRequest
from pdgrpc.state.prefix_cache import Lease
from pdgrpc.state.room import Room

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



# -- every way a request ends, over the queues and the cache together ----------------------


@dataclasses.dataclass
class _Req:
    ids: tuple[int, ...]
    max_new: int
    n_pages: int  # every page it can need (prompt + max_new_tokens), as the scheduler counts them
    lease: Lease
    phase: str  # queued | transfer | running | local_wait | local_compute
    need: int = 0  # a local prefill's pages still to allocate
    own: tuple[int, ...] = ()  # its pages after the cached prefix
    out: list[int] = dataclasses.field(default_factory=list)  # generated tokens


class _Decode:
    """One decode's pure machines as the scheduler drives them: the queues, the prefix
    cache over their pages, and local prefills allocating from the same pool. Each ending
    hands pages back the way the scheduler does (its ``_release_pages`` and ``_unlock``),
    and :meth:`check` holds the pool's accounting after every step."""

    NUM_PAGES = 12

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.q = make_queues(make_buffers(3), self.NUM_PAGES, SchedulerConfig())
        self.reuse = DecodeReuse(self.q, PAGE)
        self.now = 0.0
        self.next_room = 1
        self.reqs: dict[int, _Req] = {}  # room -> the request, until it ended
        self.quarantined: dict[int, tuple[int, ...]] = {}  # an aborted room's own pages, until released

    def admit(self, local: bool) -> None:
        # A few chats, so prompts share prefixes (and hold each other whole) often.
        chat = self.rng.randrange(3)
        ids = tuple(range(chat * 100, chat * 100 + self.rng.randint(1, 13)))
        max_new = self.rng.randint(1, 6)
        n_pages = max(-(-len(ids) // PAGE), -(-(len(ids) + max_new - 1) // PAGE))
        most = min(n_pages - 1, (len(ids) - 1) // PAGE) if local else n_pages - 1
        lease = self.reuse.hold(ids, most)
        room, self.next_room = self.next_room, self.next_room + 1
        if local:
            self.reqs[room] = _Req(ids, max_new, n_pages, lease, "local_wait", need=n_pages - lease.cached_pages)
        else:
            self.reqs[room] = _Req(ids, max_new, n_pages, lease, "queued")
            self.q.add(NewRequest(Room(room), "p:1", n_pages - lease.cached_pages, 0, fake=True), self.now)

    def iteration(self) -> None:
        """The scheduler's: deadlines, reclaim for those waiting, local pages, prealloc, poll."""
        for a in self.q.tick(self.now):
            self._aborted(a)
        waiting = sum(r.n_pages - r.lease.cached_pages for r in self.reqs.values() if r.phase == "queued")
        self.reuse.reclaim(waiting + sum(r.need for r in self.reqs.values() if r.phase == "local_wait"))
        for r in (r for _, r in sorted(self.reqs.items()) if r.phase == "local_wait"):
            got = self.q.alloc_pages(r.need)
            if got is None:
                break
            r.own, r.phase = got, "local_compute"
        for hs in self.q.prealloc(self.now):
            self.reqs[hs.room].own, self.reqs[hs.room].phase = hs.pages, "transfer"
        self.poll()

    def poll(self, room: int | None = None, status: KVPoll = KVPoll.SUCCESS) -> None:
        if room is not None:
            self.q.on_local_status(room, status)
        for out in self.q.poll_transfers(self.now):
            if isinstance(out, Aborted):
                self._aborted(out)
            else:
                self._first_token(out.room)

    def _aborted(self, a: Aborted) -> None:
        r = self.reqs.pop(a.room)
        if a.awaiting_ack:
            self.quarantined[a.room] = r.own
        self.reuse.release(r.lease, (), None)  # the scheduler's _unlock

    def _first_token(self, room: int) -> None:
        r = self.reqs[room]
        r.phase, r.out = "running", [50]
        if r.max_new == 1:
            self.release(room, True)

    def release(self, room: int, complete: bool) -> None:
        """The scheduler's _release_pages: ``complete`` when its prompt's KV is in its pages."""
        r = self.reqs.pop(room)
        kv_ids = r.ids + tuple(r.out[:-1]) if complete else None
        split = -(-len(kv_ids) // PAGE) - r.lease.cached_pages if kv_ids is not None else 0
        self.reuse.release(r.lease, r.own[:split], kv_ids)
        if r.own[split:]:
            self.q.release_pages(r.own[split:])

    def step(self) -> None:
        """A decode step: each running request gets a token; local prefills may finish."""
        for room, r in list(self.reqs.items()):
            if r.phase == "local_compute" and self.rng.random() < 0.5:
                self._first_token(room)
            elif r.phase == "running":
                r.out.append(50 + self.rng.randrange(2))  # answers repeat: their pages are cached again
                if len(r.out) >= r.max_new:
                    self.release(room, True)

    def cancel(self, room: int) -> None:
        r = self.reqs[room]
        if r.phase in ("queued", "transfer"):
            a = self.q.cancel(room, self.now)
            if a is not None:
                self._aborted(a)
            self.poll()
        else:  # running: its KV is complete; a local prefill's is not
            self.release(room, r.phase == "running")

    def check(self) -> None:
        pages, cache = self.q.pages, self.reuse.cache
        for room in [room for room in self.quarantined if not self.q.is_quarantined(room)]:
            del self.quarantined[room]
        own = [p for r in self.reqs.values() for p in r.own]
        held = {p for r in self.reqs.values() for p in r.lease.pages}
        assert len(own) == len(set(own)) and not held & set(own), "a page has two owners"
        assert not any(pages.is_free(p) or pages.is_quarantined(p) for p in held | set(own)), "a page in use went back"
        quarantined = sum(len(p) for p in self.quarantined.values())
        assert pages.num_quarantined == quarantined
        # Every page is free, quarantined, cached (held or not) or a request's own: none lost.
        assert pages.num_free + quarantined + cache.num_cached_pages + len(own) == self.NUM_PAGES
        for r in self.reqs.values():  # eviction never took a page a request reads
            assert cache.match(r.ids, whole=True) >= r.lease.cached_pages

    def drain(self) -> None:
        for room in list(self.reqs):
            if room in self.reqs:
                self.cancel(room)
        for room in list(self.quarantined):
            self.q.on_abort_ack(room)
        self.iteration()
        self.check()
        self.reuse.reclaim(self.NUM_PAGES)
        assert self.q.is_idle() and self.reuse.cache.num_cached_pages == 0


@pytest.mark.parametrize("seed", range(40))
def test_every_ending_gives_each_page_back_once(seed: int) -> None:
    """Requests, transferred and local, through random endings -- finished, cancelled
    before or during the transfer or while running, a failed transfer, a deadline, an
    engine crash, a prompt the cache holds whole -- with eviction pressed by a small pool:
    after every step each page is free, quarantined, cached or one request's own."""
    rng = random.Random(seed)
    d = _Decode(rng)
    for _ in range(200):
        act, live = rng.randrange(10), sorted(d.reqs)
        transfers = [room for room in live if d.reqs[room].phase == "transfer"]
        busy = [room for room in live if d.reqs[room].phase in ("running", "local_compute")]
        if act == 0 or not live:
            d.admit(local=rng.random() < 0.3)
        elif act == 1:
            d.iteration()
        elif act in (2, 3) and transfers:  # a transfer lands, or fails
            d.poll(rng.choice(transfers), KVPoll.SUCCESS if act == 2 else KVPoll.FAILED)
        elif act == 4:
            d.cancel(rng.choice(live))
        elif act == 5 and busy:  # the engine fails it
            d.release(rng.choice(busy), False)
        elif act == 6 and d.quarantined:
            d.q.on_abort_ack(rng.choice(sorted(d.quarantined)))
            d.poll()
        elif act == 7:  # past deadlines and quarantine leases, now and then
            d.now += rng.choice([0.5, 40.0, 700.0])
            d.iteration()
        else:
            d.step()
        d.check()
    d.drain()
