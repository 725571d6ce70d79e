"""dp-rank resolution on decode (local rules, batched and throttled queries) and dispatch
rules on prefill."""

from __future__ import annotations

import pytest

from pdgrpc.errors import BootstrapError, ConfigError
from pdgrpc.state import DpConfig, DpRankConflict, DpRankResolver, QueryDpRanks, check_prefill_dispatch, resolve_locally


@pytest.mark.parametrize(
    "room, explicit, cfg, expected",
    [
        (10, 2, DpConfig(dp_size=4, follow_bootstrap_room=False), 2),  # explicit rank wins
        (10, None, DpConfig(dp_size=1, follow_bootstrap_room=False), 0),  # dp_size 1
        (10, None, DpConfig(dp_size=4), 2),  # strict follow_bootstrap_room: room % dp_size
        (10, None, DpConfig(dp_size=4, follow_bootstrap_room=False), None),  # must query
        (10, None, DpConfig(dp_size=4, force_query=True), None),  # force-query: always query
    ],
)
def test_resolve_locally(room: int, explicit: int | None, cfg: DpConfig, expected: int | None) -> None:
    assert resolve_locally(room, explicit, cfg) == expected


def test_explicit_rank_out_of_range_names_the_field() -> None:
    with pytest.raises(ConfigError, match=r"dp_rank must be an integer in \[0, 4\)"):
        resolve_locally(1, 4, DpConfig(dp_size=4))


@pytest.mark.parametrize("kwargs, field", [({"dp_size": 0}, "dp_size"), ({"query_interval_s": 0}, "query_interval_s")])
def test_dp_config_validation(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        DpConfig(**kwargs)  # type: ignore[arg-type]


def test_queries_are_batched_per_address_and_throttled() -> None:
    r = DpRankResolver(query_interval_s=1.0)
    for room in (1, 2, 3):
        r.add(room, "a", 4)
    r.add(9, "b", 4)
    assert r.poll(0.0) == [QueryDpRanks("a", (1, 2, 3)), QueryDpRanks("b", (9,))]
    # The decode loop polls every iteration; no address is asked again within the interval.
    for t in (0.0, 0.1, 0.5, 0.999):
        assert r.poll(t) == []
    r.add(4, "a", 4)
    assert r.poll(0.9) == []
    assert r.on_answer("a", {1: 3, 2: None, 3: 0, 77: 1}) == [(1, 3), (3, 0)]  # 2 unknown yet, 77 not ours
    assert r.is_pending(2) and not r.is_pending(1)
    assert r.poll(1.0) == [QueryDpRanks("a", (2, 4)), QueryDpRanks("b", (9,))]
    r.remove(9)
    assert r.poll(2.5) == [QueryDpRanks("a", (2, 4))] and len(r) == 2


def test_bad_answer_is_refused_before_anything_is_applied() -> None:
    r = DpRankResolver()
    r.add(1, "a", 2)
    r.add(2, "a", 2)
    with pytest.raises(BootstrapError, match="room 2 has dp rank 5"):
        r.on_answer("a", {1: 0, 2: 5})
    assert r.is_pending(1) and r.is_pending(2)


@pytest.mark.parametrize(
    "room, actual, follows, cfg, register",
    [
        (6, 0, True, DpConfig(dp_size=1), False),
        (6, 2, True, DpConfig(dp_size=4), False),  # 6 % 4 == 2: decode computes the same rank
        (6, 1, False, DpConfig(dp_size=4, follow_bootstrap_room=False), True),  # round robin etc.
        (6, 1, True, DpConfig(dp_size=4, force_query=True), True),  # override allowed, registered
    ],
)
def test_prefill_dispatch(room: int, actual: int, follows: bool, cfg: DpConfig, register: bool) -> None:
    assert check_prefill_dispatch(room, actual, follows, cfg).register is register


def test_prefill_dispatch_conflict_under_strict_follow() -> None:
    with pytest.raises(DpRankConflict, match=r"room 6: dispatched to dp rank 1 .* rank 2 = room % dp_size"):
        check_prefill_dispatch(6, 1, True, DpConfig(dp_size=4))
