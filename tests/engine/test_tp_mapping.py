"""pdgrpc.serving.tp: who sends which heads to whom, for every pair of TP sizes where one
divides the other (the e2e tests run 2->2, 2->1 and 1->2 with real processes)."""

from __future__ import annotations

import itertools

import pytest

from pdgrpc.errors import ConfigError
from pdgrpc.serving.tp import check_tp_sizes, designated_sender, heads_of, receivers_of, senders_of, transfer_room

SIZES = [(p, d) for p, d in itertools.product((1, 2, 4, 8), repeat=2)]
H = 8  # KV heads


@pytest.mark.parametrize("tp_p, tp_d", SIZES, ids=[f"{p}->{d}" for p, d in SIZES])
def test_every_decode_head_comes_from_exactly_one_prefill_rank(tp_p: int, tp_d: int) -> None:
    for d in range(tp_d):
        ds, de = heads_of(d, tp_d, H)
        got: list[int] = []
        for p in senders_of(d, tp_d, tp_p):
            ps, pe = heads_of(p, tp_p, H)
            lo, hi = max(ps, ds), min(pe, de)
            assert lo < hi, f"prefill rank {p} is listed as a sender of decode rank {d} but shares no head"
            assert d in receivers_of(p, tp_p, tp_d)  # both sides agree on the pair
            got += range(lo, hi)
        assert sorted(got) == list(range(ds, de))  # every head once, none twice
        assert designated_sender(d, tp_d, tp_p) in senders_of(d, tp_d, tp_p)
    # Pairs seen from the prefill side are exactly those seen from the decode side.
    pairs_p = {(p, d) for p in range(tp_p) for d in receivers_of(p, tp_p, tp_d)}
    pairs_d = {(p, d) for d in range(tp_d) for p in senders_of(d, tp_d, tp_p)}
    assert pairs_p == pairs_d
    assert len(senders_of(0, tp_d, tp_p)) == max(1, tp_p // tp_d)
    assert len(receivers_of(0, tp_p, tp_d)) == max(1, tp_d // tp_p)


@pytest.mark.parametrize("tp_p, tp_d", SIZES, ids=[f"{p}->{d}" for p, d in SIZES])
def test_transfer_rooms_are_distinct_on_each_process_and_the_room_itself_one_to_one(tp_p: int, tp_d: int) -> None:
    room = 0x1234_5678_9ABC_DEF0
    for p in range(tp_p):  # one sender process: one key per destination
        keys = [transfer_room(room, p, d) for d in receivers_of(p, tp_p, tp_d)]
        assert len(set(keys)) == len(keys) and all(0 < k < 2**63 for k in keys)
    for d in range(tp_d):  # one receiver process: one key per sender
        keys = [transfer_room(room, p, d) for p in senders_of(d, tp_d, tp_p)]
        assert len(set(keys)) == len(keys)
    assert transfer_room(room, 0, 0) == room
    if tp_p == tp_d:
        assert all(transfer_room(room, r, r) == room for r in range(tp_p))


def test_sizes_that_do_not_divide_are_refused_with_both_named() -> None:
    with pytest.raises(ConfigError, match="prefill tp_size 2 and decode tp_size 3"):
        check_tp_sizes(2, 3)
    with pytest.raises(ConfigError):
        senders_of(0, 3, 2)
    with pytest.raises(ConfigError):
        heads_of(0, 3, H)  # 8 heads do not split 3 ways
