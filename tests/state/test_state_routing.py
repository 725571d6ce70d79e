"""The load and prefix rules the router and a prefill's dp dispatch pick by."""

from __future__ import annotations

from pdgrpc.state.routing import cache_aware_choice, candidates, least_loaded


def test_least_loaded_rotates_ties_from_the_turn() -> None:
    assert [least_loaded([0, 0, 0], turn) for turn in range(4)] == [0, 1, 2, 0]
    assert least_loaded([2, 1, 1], 0) == 1
    assert least_loaded([2, 1, 1], 2) == 2


def test_cache_aware_takes_the_longest_prefix_within_the_margin() -> None:
    assert cache_aware_choice([0, 64, 32], [0, 3, 0], turn=0, margin=4) == 1
    # the holder of the longest prefix is over the margin: the least loaded instead
    assert cache_aware_choice([0, 64, 32], [0, 5, 0], turn=1, margin=4) == 2
    # nobody holds any of the prompt: least loaded, ties in turn
    assert cache_aware_choice([0, 0, 0], [1, 0, 0], turn=2, margin=4) == 2
    # equal prefixes: the less loaded holder
    assert cache_aware_choice([16, 16], [3, 1], turn=0, margin=4) == 1


def test_candidates_leave_out_the_excluded_and_the_ejected_unless_nothing_else_remains() -> None:
    addrs = ["a:1", "b:2", "c:3"]
    assert candidates(addrs, ejected=set()) == [0, 1, 2]
    assert candidates(addrs, ejected={"b:2"}, exclude={"a:1"}) == [2]
    # every one left is ejected: all of them, rather than a certain refusal
    assert candidates(addrs, ejected={"b:2", "c:3"}, exclude={"a:1"}) == [1, 2]
    assert candidates(["a:1"], ejected={"a:1"}, exclude={"a:1"}) == []


def test_cache_aware_spreads_new_prefixes_by_what_is_cached() -> None:
    # nobody holds the prompt: the candidate caching least within the margin of the least load
    assert cache_aware_choice([0, 0, 0], [0, 2, 1], turn=0, margin=4, sizes=[900, 100, 500]) == 1
    assert cache_aware_choice([0, 0, 0], [0, 5, 1], turn=0, margin=4, sizes=[900, 100, 500]) == 2  # 1 is over the margin
    # equal sizes: the less loaded, then in turn
    assert cache_aware_choice([0, 0, 0], [1, 0, 0], turn=2, margin=4, sizes=[0, 0, 0]) == 2
    # a holder within the margin still wins whatever it caches
    assert cache_aware_choice([0, 64, 0], [0, 3, 0], turn=0, margin=4, sizes=[0, 5000, 0]) == 1
    # the holder is over the margin: the rest by size
    assert cache_aware_choice([0, 64, 0], [1, 6, 0], turn=0, margin=4, sizes=[0, 5000, 300]) == 0
