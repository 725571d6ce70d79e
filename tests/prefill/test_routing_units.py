"""The controller's pure parts: dp rank choice, batched registration, the handshake mailbox."""

from __future__ import annotations

import asyncio

import pytest

from pdgrpc.prefill.dispatch import Dispatcher, DpRankConflict, InvalidRoute, NoLiveRank
from pdgrpc.prefill.mailbox import DuplicateHandshake, Mailbox, MailboxFull
from pdgrpc.prefill.registrar import DpRankRegistrar

ALIVE3 = [True, True, True]


def test_round_robin_cycles_skips_dead_ranks_and_registers() -> None:
    d = Dispatcher(3, "round_robin")
    picks = [d.pick(room, None, [0, 0, 0], ALIVE3) for room in range(1, 7)]
    assert [p.rank for p in picks] == [0, 1, 2, 0, 1, 2]
    assert all(p.register for p in picks)  # decode must query under round_robin
    assert [d.pick(9, None, [0, 0, 0], [True, False, True]).rank for _ in range(4)] == [0, 2, 0, 2]
    with pytest.raises(NoLiveRank):
        d.pick(9, None, [0, 0, 0], [False] * 3)


def test_shortest_queue_picks_fewest_in_flight_lowest_rank_on_ties() -> None:
    d = Dispatcher(3, "shortest_queue")
    assert d.pick(5, None, [4, 1, 1], ALIVE3).rank == 1
    assert d.pick(5, None, [0, 1, 0], ALIVE3).rank == 0
    assert d.pick(5, None, [0, 1, 0], [False, True, True]).rank == 2
    assert d.pick(5, None, [0, 0, 0], ALIVE3).register


def test_cache_aware_picks_the_rank_holding_the_longest_prefix_within_the_margin() -> None:
    prompt = list(range(40))
    held = {1: 16, 2: 32}  # rank -> cached tokens of ``prompt`` (a fake of the merged per-rank view)
    asked: list[list[int]] = []

    def prefixes(p):
        asked.append(list(p))
        return held if p[:16] == prompt[:16] else {}

    d = Dispatcher(3, "cache_aware", prefixes=prefixes)
    p = d.pick(5, None, [0, 0, 0], ALIVE3, prompt)
    assert (p.rank, p.register) == (2, True) and asked == [prompt]  # registered with bootstrap, as round robin
    assert d.pick(5, None, [0, 0, 4], ALIVE3, prompt).rank == 2  # 4 more in flight: within the margin
    assert d.pick(5, None, [0, 0, 5], ALIVE3, prompt).rank == 0  # over it: the least busy
    assert d.pick(5, None, [0, 0, 0], [True, True, False], prompt).rank == 1  # a dead rank holds nothing
    assert d.pick(5, 0, [0, 0, 0], ALIVE3, prompt).rank == 0  # routed_dp_rank still wins
    # Nobody holds the prompt: the least busy, in turn on a tie.
    assert sorted(d.pick(5, None, [0, 0, 0], ALIVE3, [99] * 20).rank for _ in range(3)) == [0, 1, 2]
    assert d.pick(5, None, [3, 1, 2], ALIVE3, [99] * 20).rank == 1


def test_cache_aware_without_a_view_is_the_least_busy_rank() -> None:
    d = Dispatcher(2, "cache_aware")
    assert [d.pick(5, None, [0, 0], [True, True], [1, 2]).rank for _ in range(3)] == [0, 1, 0]
    assert d.pick(5, None, [2, 1], [True, True], [1, 2]).rank == 1


def test_follow_bootstrap_room_uses_room_mod_dp_without_registration() -> None:
    d = Dispatcher(3, "follow_bootstrap_room")
    for room in (1, 2, 3, 10**18 + 7):
        p = d.pick(room, None, [9, 0, 0], ALIVE3)
        assert (p.rank, p.register) == (room % 3, False)


def test_routed_rank_wins_and_strict_follow_refuses_a_conflict() -> None:
    rr = Dispatcher(3, "round_robin")
    assert rr.pick(7, 2, [0, 0, 0], ALIVE3).rank == 2
    with pytest.raises(InvalidRoute, match=r"routed_dp_rank must be in \[0, dp_size=3\), got 3"):
        rr.pick(7, 3, [0, 0, 0], ALIVE3)
    strict = Dispatcher(3, "follow_bootstrap_room")
    assert strict.pick(7, 1, [0, 0, 0], ALIVE3) .register is False  # 7 % 3 == 1: no conflict
    with pytest.raises(DpRankConflict, match="follow_bootstrap_room"):
        strict.pick(7, 2, [0, 0, 0], ALIVE3)
    forced = Dispatcher(3, "follow_bootstrap_room", force_query=True)
    p = forced.pick(7, 2, [0, 0, 0], ALIVE3)
    assert (p.rank, p.register) == (2, True)  # force-query: allowed, and registered
    assert forced.pick(8, None, [0, 0, 0], ALIVE3).register  # decode always queries


async def test_registrar_coalesces_a_burst_into_one_call() -> None:
    calls: list[dict[int, int]] = []

    async def register(entries: dict[int, int]) -> None:
        calls.append(dict(entries))

    reg = DpRankRegistrar(register, window_s=0.05)
    await asyncio.wait_for(asyncio.gather(*(reg.register(room, room % 2) for room in range(1, 21))), 5)
    assert calls == [{room: room % 2 for room in range(1, 21)}]
    await asyncio.wait_for(reg.register(99, 1), 5)  # a later one gets its own batch
    assert calls[1] == {99: 1}


async def test_registrar_caps_batches_and_fails_every_caller_of_a_failed_batch() -> None:
    calls: list[int] = []

    async def register(entries: dict[int, int]) -> None:
        calls.append(len(entries))
        if 13 in entries:
            raise RuntimeError("bootstrap says no")

    reg = DpRankRegistrar(register, window_s=0.05, max_batch=4)
    results = await asyncio.wait_for(asyncio.gather(*(reg.register(r, 0) for r in range(10, 20)), return_exceptions=True), 5)
    assert sorted(calls) == [2, 4, 4]
    failed = [room for room, res in zip(range(10, 20), results) if isinstance(res, Exception)]
    assert failed == [10, 11, 12, 13]  # exactly the batch that held room 13


async def test_mailbox_keeps_early_handshakes_bounded_and_refuses_duplicates() -> None:
    now = [0.0]
    box: Mailbox[str] = Mailbox(capacity=2, ttl_s=10.0, clock=lambda: now[0])
    assert box.deliver(1, "early") is False
    assert await box.wait(1, timeout=1) == "early"  # Prefill after its handshake
    with pytest.raises(DuplicateHandshake):
        box.deliver(1, "again")
    waiter = asyncio.ensure_future(box.wait(2, timeout=5))
    await asyncio.sleep(0)
    assert box.deliver(2, "late") is True  # Prefill first, then its handshake
    assert await waiter == "late"
    box.deliver(3, "a")
    box.deliver(4, "b")
    with pytest.raises(MailboxFull):
        box.deliver(5, "c")
    now[0] = 11.0  # both expire: memory is not held for Prefills that never come
    assert len(box) == 0
    box.deliver(5, "c")
    assert box.discard(5) and not box.discard(5)
    with pytest.raises(asyncio.TimeoutError):
        await box.wait(6, timeout=0.05)


async def test_mailbox_sift_drops_unproven_early_handshakes_and_puts_aborts_first() -> None:
    box: Mailbox[str] = Mailbox(capacity=4, ttl_s=10.0)
    # Keys carry the proof, so a forgery never makes the real handshake a duplicate.
    box.deliver(5, "forged", key=(0, b"x"))
    box.deliver(5, "real", key=(0, b"ok"))
    box.deliver(5, "abort", key=("abort", b"ok"))
    assert box.sift(5, lambda h: h != "forged", first=lambda h: h == "abort") == 1
    assert await box.wait(5, 1.0) == "abort"
    assert await box.wait(5, 1.0) == "real"
    assert box.sift(6, lambda h: False) == 0  # nothing held for the room: nothing dropped
    # A dropped forgery's decode TP size binds nothing: a later real handshake says another.
    box.deliver(7, "forged", key=(0, b""), group=2)
    assert box.sift(7, lambda h: h != "forged") == 1
    waiting = asyncio.ensure_future(box.wait(7, 1.0))
    await asyncio.sleep(0)
    box.deliver(7, "real", key=(0, b"ok"), group=1)
    assert await waiting == "real"


async def test_mailbox_caps_early_handshakes_per_peer_and_never_stores_refusals() -> None:
    """Audit: 4,100 junk handshakes filled a worker's mailbox, and refused ones were kept.
    One peer holds at most ``per_peer`` rooms (the refusal names the limit); another peer
    still gets in; a refusal reaches only a Prefill that claims its room, and never takes
    the room's handshake from the real decode."""
    box: Mailbox[str] = Mailbox(capacity=8, ttl_s=10.0, per_peer=2)
    box.deliver(1, "a", peer="10.0.0.9")
    box.deliver(2, "b", peer="10.0.0.9")
    with pytest.raises(MailboxFull, match="limit 2 per peer"):
        box.deliver(3, "c", peer="10.0.0.9")
    assert box.deliver(3, "c", peer="10.0.0.1") is False  # another peer is not affected
    assert await box.wait(1, timeout=1) == "a"  # claimed: no longer counts against its peer
    box.deliver(4, "d", peer="10.0.0.9")
    assert box.refuse(5, "refused") is False and len(box) == 3  # nobody claims room 5: dropped
    assert box.deliver(5, "real") is False  # the refusal took no key
    box.claim(6)
    assert box.refuse(6, "refused") is True
    assert box.refuse(6, "refused again") is False  # one queued refusal per claim, no more
    assert await box.wait(6, timeout=1) == "refused"


def test_mailbox_counts_every_early_handshake_not_every_room() -> None:
    """Keys carry unverified proofs, so one room can take any number of handshakes: each
    counts against the mailbox's capacity and its sender's quota."""
    box: Mailbox[str] = Mailbox(capacity=3, ttl_s=10.0, per_peer=2)
    box.deliver(1, "forged", key=(0, b"a"), peer="mallory")
    box.deliver(1, "forged", key=(0, b"b"), peer="mallory")
    with pytest.raises(MailboxFull, match="limit 2 per peer"):
        box.deliver(1, "forged", key=(0, b"c"), peer="mallory")
    box.deliver(1, "real", key=(0, b"ok"), peer="decode")
    assert len(box) == 3
    with pytest.raises(MailboxFull, match="capacity 3"):
        box.deliver(2, "other", peer="decode-b")
    assert box.sift(1, lambda h: h == "real") == 2  # the forgeries give their places back
    box.deliver(2, "other", peer="decode-b")
    box.deliver(3, "again", key=(0, b"d"), peer="mallory")
    assert len(box) == 3
