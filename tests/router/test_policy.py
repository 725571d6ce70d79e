"""The router's choice of prefill: round robin, least load, cache aware with a load margin."""

from __future__ import annotations

import pytest

from pdgrpc.router.policy import Policy
from pdgrpc.state.cache_events import StoredBlock as Block
from pdgrpc.state.prefix_index import PrefixIndex

ADDRS = ["p0:1", "p1:1", "p2:1"]
PREFIX = list(range(100, 116))  # four pages of 4


def cached(index: PrefixIndex, address: str, tokens: list[int]) -> None:
    parent = None
    blocks = []
    for start in range(0, len(tokens) - 3, 4):
        h = hash((address, start))
        blocks.append(Block(h, parent, tuple(tokens[start : start + 4])))
        parent = h
    index.stored(address, blocks)


def busy(policy: Policy, address: str, n: int) -> None:
    for _ in range(n):
        policy.started(address)


def test_round_robin_takes_turns_whatever_the_load() -> None:
    p = Policy("round_robin")
    busy(p, "p0:1", 10)
    assert [p.choose(ADDRS, t, PREFIX) for t in range(4)] == [0, 1, 2, 0]


def test_least_load_counts_calls_in_flight_and_rotates_ties() -> None:
    p = Policy("least_load")
    assert [p.choose(ADDRS, t, []) for t in range(3)] == [0, 1, 2]  # all idle: in turn
    busy(p, "p0:1", 2)
    busy(p, "p1:1", 1)
    assert p.choose(ADDRS, 0, []) == 2
    busy(p, "p2:1", 3)
    assert p.choose(ADDRS, 0, []) == 1
    for _ in range(2):
        p.finished("p0:1")
    assert p.load("p0:1") == 0 and p.choose(ADDRS, 0, []) == 0


def test_cache_aware_goes_to_the_longest_prefix() -> None:
    index = PrefixIndex()
    cached(index, "p1:1", PREFIX[:8])
    cached(index, "p2:1", PREFIX)
    p = Policy("cache_aware", index, margin=2)
    for turn in range(3):
        assert p.choose(ADDRS, turn, PREFIX + [1, 2]) == 2
    busy(p, "p2:1", 2)  # within the margin: still the cache
    assert p.choose(ADDRS, 0, PREFIX + [1]) == 2
    p.started("p2:1")  # 3 more than the idle p0 and p1: of those, the one caching least
    assert p.choose(ADDRS, 0, PREFIX + [1]) == 0
    assert p.choose(ADDRS, 1, PREFIX + [1]) == 0


def test_cache_aware_equal_prefixes_go_to_the_less_loaded_holder() -> None:
    index = PrefixIndex()
    cached(index, "p0:1", PREFIX)
    cached(index, "p1:1", PREFIX)
    p = Policy("cache_aware", index)
    busy(p, "p0:1", 1)
    assert p.choose(ADDRS, 0, PREFIX + [1]) == 1


def test_cache_aware_without_a_match_goes_where_least_is_cached() -> None:
    """New prefixes spread what is cached: the instance caching least within the margin
    of the least load, ties to the less loaded, then in turn."""
    index = PrefixIndex()
    cached(index, "p0:1", PREFIX)
    p = Policy("cache_aware", index, margin=1)
    busy(p, "p1:1", 1)
    assert [p.choose(ADDRS, t, [7] * 20) for t in range(3)] == [2, 2, 2]
    busy(p, "p2:1", 2)  # over the margin: p1 (less cached than p0, within 1 of the least load)
    assert p.choose(ADDRS, 0, [7] * 20) == 1
    index.routed("p1:1", PREFIX + [9] * 8, now=0.0)  # pending prompts count as cached: now p0 holds less
    assert p.choose(ADDRS, 0, [7] * 20) == 0
    empty = Policy("cache_aware", PrefixIndex())
    busy(empty, "p1:1", 1)
    assert [empty.choose(ADDRS, t, [7] * 20) for t in range(3)] == [0, 2, 2]  # nothing cached: least load, in turn


def test_cache_aware_sends_a_prefix_after_its_first_request_before_any_event() -> None:
    """A group's requests arriving while its first still computes go where the first went,
    not wherever the load happens to be lowest."""
    index = PrefixIndex()
    p = Policy("cache_aware", index)
    first = p.choose(ADDRS, 0, PREFIX + [1])
    index.routed(ADDRS[first], PREFIX + [1], now=0.0)
    p.started(ADDRS[first])
    assert [p.choose(ADDRS, t, PREFIX + [2, 3]) for t in range(1, 4)] == [first] * 3
    assert p.choose(ADDRS, 1, [7] * 20) != first  # another prefix: the least loaded


def test_only_candidates_count() -> None:
    """An ejected instance is not among the candidates, however much it holds."""
    index = PrefixIndex()
    cached(index, "p0:1", PREFIX)
    p = Policy("cache_aware", index)
    assert p.choose(["p1:1", "p2:1"], 0, PREFIX + [1]) in (0, 1)
    index.cleared("p0:1")  # a prefill that died: dropped at once
    assert p.choose(ADDRS, 1, PREFIX + [1]) == 1


@pytest.mark.parametrize(
    "args, field",
    [(("fastest",), "--policy"), (("cache_aware", PrefixIndex(), -1), "--cache-aware-margin"), (("cache_aware",), "prefix index")],
)
def test_bad_settings_name_the_flag(args: tuple, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        Policy(*args)


def test_a_retry_picks_another_instance_in_one_turn() -> None:
    """The router's pick for a retry leaves out the failed instance of that side, in one
    call of each policy (no socket: the servicer is only constructed)."""
    from pdgrpc.errors import RequestFailed
    from pdgrpc.router.service import GenerateServicer, PrefillBackend, RouterConfig
    from pdgrpc.state.route_fate import Side

    prefills = tuple(PrefillBackend(a, a) for a in ADDRS)
    router = GenerateServicer(RouterConfig(prefills=prefills, decodes=("d0:1", "d1:1")))
    for _ in range(4):
        p, d = router.pick([1, 2], avoid=(Side.PREFILL, "p1:1"))
        assert p.address != "p1:1"
    assert {router.pick([1, 2], avoid=(Side.DECODE, "d0:1"))[1] for _ in range(3)} == {"d1:1"}
    single = GenerateServicer(RouterConfig(prefills=prefills[:1], decodes=("d0:1",)))
    with pytest.raises(RequestFailed, match="no prefill instance but p0:1"):
        single.pick([1], avoid=(Side.PREFILL, "p0:1"))
    assert single.pick([1])[0].address == "p0:1"
