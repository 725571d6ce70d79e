"""A prompt waits for the running request that computes its prefix: one cache, no sockets.

The machine drives :class:`PrefixLeaders` over a real :class:`PrefixCache` the way a
prefill worker does: a prompt that has a leader waits for it, else it locks its cached
prefix, computes the rest and is registered; a request that ends is unregistered and
released (its pages inserted when it succeeded) and its followers look again; a follower
whose wait runs out computes without waiting.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdgrpc.state.prefix_cache import Lease, PrefixCache, block_hashes
from pdgrpc.state.prefix_leaders import PrefixLeaders, leader_wait_s
from tests.state.test_state_prefix_cache import Pool

PS = 4
PREFIXES = [tuple(range(100 * k, 100 * k + 3 * PS)) for k in range(3)]  # three families of prompts


def cacheable(ids: tuple[int, ...]) -> list[int]:
    """The names of the pages a request leaves cached: full pages, never the last token's."""
    return block_hashes(ids[: len(ids) - 1], PS)


class LeaderMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache = PrefixCache(Pool(64), PS)
        self.leaders: PrefixLeaders[int] = PrefixLeaders(PS)
        self.running: dict[int, tuple[Lease, set[int]]] = {}  # key -> its lease, the pages it computes
        self.waiting: dict[int, tuple[tuple[int, ...], int]] = {}  # key -> its prompt, its leader
        self.next = 0

    def _look(self, key: int, ids: tuple[int, ...], waited_out: bool = False, after: tuple[int, ...] = ()) -> None:
        """``key`` arrives, or looks again (``after``: its leader's prompt, which succeeded)."""
        leader = self.leaders.leader(ids, self.cache.match(ids) * PS)
        if leader is not None and not waited_out:
            assert leader in self.running, "a follower waits only for a computing request"
            self.waiting[key] = (ids, leader)
            return
        lease = self.cache.acquire(ids, -(-len(ids) // PS))
        assert lease is not None  # the pool holds every request the machine keeps
        names = cacheable(ids)
        computed = set(names[lease.cached_pages :])
        if not waited_out:  # the point: no page is computed by two running requests at once
            for other, (_, theirs) in self.running.items():
                assert not computed & theirs, f"request {key} computes pages request {other} computes"
        if after:  # its leader's pages were inserted: all that the two prompts share is reused
            shared = len(set(names) & set(cacheable(after)))
            assert lease.cached_pages >= shared
        self.running[key] = (lease, computed)
        self.leaders.running(key, ids)

    @precondition(lambda self: len(self.running) + len(self.waiting) < 6)
    @rule(family=st.integers(0, 2), pages=st.integers(0, 3), tail=st.lists(st.integers(0, 3), max_size=2 * PS))
    def arrive(self, family: int, pages: int, tail: list[int]) -> None:
        ids = PREFIXES[family][: pages * PS] + tuple(tail) + (7,)
        self.next += 1
        self._look(self.next, ids)

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data(), ok=st.booleans())
    def end(self, data: st.DataObject, ok: bool) -> None:
        key = data.draw(st.sampled_from(sorted(self.running)))
        lease, _ = self.running.pop(key)
        self.leaders.ended(key)
        self.cache.release(lease, insert=ok)
        for follower in [k for k, (_, leader) in self.waiting.items() if leader == key]:
            ids, _ = self.waiting.pop(follower)
            self._look(follower, ids, after=lease.token_ids if ok else ())

    @precondition(lambda self: bool(self.waiting))
    @rule(data=st.data())
    def wait_runs_out(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.waiting)))
        ids, _ = self.waiting.pop(key)
        self._look(key, ids, waited_out=True)

    @invariant()
    def leaders_are_the_running_requests(self) -> None:
        assert len(self.leaders) == len(self.running)
        assert all(leader in self.running for _, leader in self.waiting.values())


TestLeaderMachine = LeaderMachine.TestCase
TestLeaderMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_a_follower_waits_for_the_longest_running_share_beyond_the_cache() -> None:
    leaders: PrefixLeaders[str] = PrefixLeaders(PS)
    base = tuple(range(2 * PS))
    leaders.running("a", base + (9,))  # leaves two pages cached
    assert leaders.leader(base + (5, 6)) == "a"
    assert leaders.leader(base + (5, 6), cached_tokens=2 * PS) is None  # the cache holds what a computes
    assert leaders.leader(base[:PS] + (5,) * PS + (1,), cached_tokens=PS) is None
    assert leaders.leader(base) == "a"  # its own last token is never cached: one page to share
    assert leaders.leader(base[:PS]) is None  # a one-page prompt leaves nothing cached
    leaders.running("b", base + tuple(range(50, 50 + PS)) + (9,))
    assert leaders.leader(base + tuple(range(50, 50 + PS)) + (1,)) == "b"  # the longer share
    leaders.ended("b")
    leaders.ended("b")  # unknown keys are ignored
    assert leaders.leader(base + tuple(range(50, 50 + PS)) + (1,)) == "a"
    leaders.ended("a")
    assert leaders.leader(base + (5, 6)) is None and len(leaders) == 0


def test_a_wait_takes_at_most_half_of_the_budget() -> None:
    assert leader_wait_s(30.0) == 15.0 and leader_wait_s(-1.0) == 0.0
