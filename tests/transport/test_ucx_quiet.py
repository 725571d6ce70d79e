"""The quiet window of a sender's UCX worker (pdgrpc.transport.ucx_quiet): while a
large send batch is being read, the sender polls once per loop tick instead of asking
UCX to wake it for every message read, and goes back to sleeping armed in time for the
end of the batch. The policy is pure and tested without a socket; the worker's use of it
with two real UCX workers over shared memory."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import pytest

from pdgrpc.transport.ucx_quiet import MARGIN_S, MIN_BYTES, QuietSends

MiB = 1 << 20


# -- the policy, no socket ---------------------------------------------------------------

def test_the_first_batch_to_an_endpoint_opens_no_window() -> None:
    q = QuietSends()
    q.posted(1, ep=7, nbytes=96 * MiB, now=10.0)
    assert not q.quiet(10.0)  # nothing known yet about how fast this peer reads


def test_a_window_ends_a_margin_before_a_batch_as_fast_as_the_fastest_seen() -> None:
    q = QuietSends()
    q.posted(1, ep=7, nbytes=96 * MiB, now=10.0)
    q.finished(1, ok=True, now=10.006)  # 96 MiB in 6 ms
    q.posted(2, ep=7, nbytes=96 * MiB, now=20.0)
    end = 20.006 - MARGIN_S
    assert q.quiet(20.0) and q.quiet(end - 1e-4) and not q.quiet(end + 1e-4)
    q.posted(3, ep=7, nbytes=48 * MiB, now=30.0)  # half the bytes: half the expected time
    assert q.quiet(30.0) and not q.quiet(30.003 - MARGIN_S + 1e-4)


def test_the_fastest_batch_sets_the_rate_not_the_latest() -> None:
    q = QuietSends()
    q.posted(1, ep=7, nbytes=96 * MiB, now=0.0)
    q.finished(1, ok=True, now=0.006)
    q.posted(2, ep=7, nbytes=96 * MiB, now=1.0)
    q.finished(2, ok=True, now=1.060)  # a slow spell: 10x longer
    q.posted(3, ep=7, nbytes=96 * MiB, now=2.0)
    assert not q.quiet(2.006 - MARGIN_S + 1e-4)  # still the 6 ms batch's window


def test_small_failed_and_other_endpoints_batches_teach_nothing() -> None:
    q = QuietSends()
    q.posted(1, ep=7, nbytes=MIN_BYTES - 1, now=0.0)
    q.finished(1, ok=True, now=0.000001)  # tiny and fast: would make every window huge
    q.posted(2, ep=7, nbytes=96 * MiB, now=1.0)
    q.finished(2, ok=False, now=1.001)  # failed (cancelled, peer lost)
    q.posted(3, ep=8, nbytes=96 * MiB, now=2.0)
    q.finished(3, ok=True, now=2.006)  # another peer
    q.posted(4, ep=7, nbytes=96 * MiB, now=3.0)
    assert not q.quiet(3.0)


def test_a_small_batch_opens_no_window_and_the_window_closes_with_the_last_batch() -> None:
    q = QuietSends()
    q.posted(1, ep=7, nbytes=96 * MiB, now=0.0)
    q.finished(1, ok=True, now=0.006)
    q.posted(2, ep=7, nbytes=MiB, now=1.0)  # expected 62 us: shorter than the margin
    assert not q.quiet(1.0)
    q.posted(3, ep=7, nbytes=96 * MiB, now=2.0)
    assert q.quiet(2.001)
    q.finished(2, ok=True, now=2.001)
    assert q.quiet(2.001)  # batch 3 is still being read
    q.finished(3, ok=True, now=2.002)  # faster than expected: nothing of ours in flight
    assert not q.quiet(2.002)


def test_a_closed_endpoint_is_forgotten() -> None:
    q = QuietSends()
    q.posted(1, ep=7, nbytes=96 * MiB, now=0.0)
    q.finished(1, ok=True, now=0.006)
    q.forget(7)
    q.posted(2, ep=7, nbytes=96 * MiB, now=1.0)  # a new endpoint may reuse the handle
    assert not q.quiet(1.0)
    q.finished(99, ok=True, now=2.0)  # unknown token: ignored


# -- the worker, two real UCX workers ------------------------------------------------------

ucx = pytest.importorskip("pdgrpc.transport.ucx", reason="needs the ucx extra: pip install 'pdgrpc[ucx]'")
pytest.importorskip("libucx", reason="the rdma backend needs the UCX libraries of the ucx extra")
from tests.transport.ucx_pair import CountingApi, Pair, runs_of, until  # noqa: E402  (after the importorskips)


@pytest.fixture
def counting() -> CountingApi:
    return CountingApi(ucx.api())


@pytest.fixture
async def pair(counting: CountingApi) -> AsyncIterator[Pair]:
    async with Pair(tx_functions=counting) as p:
        yield p


def _teach(window: QuietSends | None, ep: int, seconds_per_byte: float) -> None:
    """Make ``window`` believe ``ep`` reads at ``seconds_per_byte`` at best (nothing of
    it in flight), as one finished batch would."""
    assert window is not None
    window.forget(ep)
    window.posted(-1, ep, MIN_BYTES, 0.0)
    window.finished(-1, True, MIN_BYTES * seconds_per_byte)


async def _batch(pair: Pair, n: int, tag0: int, *, received_after: float = 0.0,
                 on_sent: Callable[[], None] = lambda: None) -> tuple[list[Any], list[Any]]:
    """Send ``n`` runs of 2 MiB; the receiver posts its receives ``received_after`` s
    later. ``on_sent`` runs when the send batch completes."""
    src = [np.full(2 * MiB, i + 1, dtype=np.uint8) for i in range(n)]
    dst = [np.zeros(2 * MiB, dtype=np.uint8) for _ in range(n)]
    tags = list(range(tag0, tag0 + n))
    sent: list[Any] = []
    got: list[Any] = []
    pair.tx.send_batch(pair.ep, runs_of(src), tags, lambda r: (sent.append(r), on_sent()), src)
    await asyncio.sleep(received_after)
    pair.rx.recv_batch(runs_of(dst), tags, got.append, dst)
    await until(lambda: bool(sent and got))
    assert all(np.array_equal(a, b) for a, b in zip(src, dst))
    return sent, got


async def test_a_sender_in_its_window_polls_unarmed_and_still_sees_its_batch_end(
        pair: Pair, counting: CountingApi) -> None:
    window = pair.tx.quiet
    await _batch(pair, 8, 0x100)  # learns this endpoint's rate
    assert window is not None and window.learned
    _teach(window, pair.ep, 10.0 / (16 * MiB))  # as if 16 MiB took 10 s: a long window
    counting.arms = 0
    arms_while_read: list[int] = []
    t0 = time.monotonic()
    sent, got = await _batch(pair, 8, 0x200, received_after=0.05, on_sent=lambda: arms_while_read.append(counting.arms))
    assert time.monotonic() - t0 < 5.0  # seen at a tick, not at the end of the 10 s window
    assert sent == [[(ucx.UCS_OK, 0)] * 8] and got == [[(ucx.UCS_OK, 2 * MiB)] * 8]
    assert arms_while_read == [0]  # not once asked to be woken while the batch was read
    assert not window.quiet(time.monotonic())  # nothing in flight: the window closed


async def test_without_a_window_the_sender_sleeps_armed(counting: CountingApi) -> None:
    async with Pair(tx_functions=counting, quiet_sends=False) as pair:
        assert pair.tx.quiet is None
        await _batch(pair, 8, 0x100, received_after=0.05)
    assert counting.arms > 0


async def test_a_receive_posted_in_the_window_is_served_at_once(pair: Pair, counting: CountingApi) -> None:
    """A worker that also receives data must not leave it waiting for ticks: posting a
    receive ends the quiet sleep, and a worker with one pending sleeps armed."""
    await _batch(pair, 4, 0x100)
    window = pair.tx.quiet
    _teach(window, pair.ep, 10.0 / (8 * MiB))
    counting.arms = 0
    src = [np.full(2 * MiB, 9, dtype=np.uint8) for _ in range(4)]
    sent: list[Any] = []
    pair.tx.send_batch(pair.ep, runs_of(src), [0x300 + i for i in range(4)], sent.append, src)
    await asyncio.sleep(0.02)
    assert window is not None and window.quiet(time.monotonic()) and counting.arms == 0  # the window is open
    reply = np.zeros(64, dtype=np.uint8)
    replies: list[Any] = []
    pair.tx.recv([(reply.ctypes.data, reply.nbytes)], 0x999, ucx.FULL_MASK,
                 lambda status, length, tag: replies.append((status, length)), reply)
    await asyncio.sleep(0.02)
    assert counting.arms > 0  # sleeping armed for the reply despite the window
    note = np.full(64, 5, dtype=np.uint8)
    pair.rx.send(pair.back, [(note.ctypes.data, note.nbytes)], 0x999, lambda *a: None, note)
    await until(lambda: bool(replies), timeout=5.0)
    assert replies == [(ucx.UCS_OK, 64)] and bytes(reply) == bytes(note)
    dst = [np.zeros(2 * MiB, dtype=np.uint8) for _ in range(4)]
    got: list[Any] = []
    pair.rx.recv_batch(runs_of(dst), [0x300 + i for i in range(4)], got.append, dst)
    await until(lambda: bool(sent and got))


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_window_polls_once_per_tick_not_in_a_spin(loop: str) -> None:
    """uvloop runs a callback due in under 0.5 ms at once: a tick that short would turn
    the window into a busy-poll. 200 ms of window: about 200 polls, not thousands."""
    factory = None
    if loop == "uvloop":
        # uvloop is optional for pdgrpc (the servers and bench use it when installed); the
        # asyncio case of this test runs either way
        uvloop = pytest.importorskip("uvloop", reason="uvloop is not installed (optional)")
        factory = uvloop.new_event_loop

    async def main() -> int:
        counting = CountingApi(ucx.api())
        async with Pair(tx_functions=counting) as pair:
            await _batch(pair, 4, 0x100)
            window = pair.tx.quiet
            _teach(window, pair.ep, 10.0 / (8 * MiB))
            counting.arms = counting.progress = 0
            src = [np.full(2 * MiB, 3, dtype=np.uint8) for _ in range(4)]
            sent: list[Any] = []
            pair.tx.send_batch(pair.ep, runs_of(src), [0x400 + i for i in range(4)], sent.append, src)
            await asyncio.sleep(0.2)
            polls = counting.progress
            assert counting.arms == 0 and window is not None and window.quiet(time.monotonic())
            dst = [np.zeros(2 * MiB, dtype=np.uint8) for _ in range(4)]
            got: list[Any] = []
            pair.rx.recv_batch(runs_of(dst), [0x400 + i for i in range(4)], got.append, dst)
            await until(lambda: bool(sent and got))
            return polls

    with asyncio.Runner(loop_factory=factory) as runner:
        polls = runner.run(main())
    assert 20 <= polls <= 1000, polls  # a tick of ~1 ms (and the loop's own slack), not a spin


async def test_a_batch_abandoned_in_its_window_closes_the_window(pair: Pair, counting: CountingApi) -> None:
    """A receiver that hangs never reads the batch, and UCX cannot cancel a rendezvous
    send (with error handling off, not even by a forced endpoint close): the transport
    abandons it. The worker then has nothing to poll quietly for, and sleeps armed."""
    await _batch(pair, 4, 0x100)
    window = pair.tx.quiet
    assert window is not None
    _teach(window, pair.ep, 10.0 / (8 * MiB))
    src = [np.full(2 * MiB, 4, dtype=np.uint8) for _ in range(4)]
    sent: list[Any] = []
    token = pair.tx.send_batch(pair.ep, runs_of(src), [0x500 + i for i in range(4)], sent.append, src)
    await asyncio.sleep(0.02)
    assert window.quiet(time.monotonic()) and not sent
    counting.arms = 0
    pair.tx.abandon(token)
    assert not window.quiet(time.monotonic()) and window.batches == 0
    await asyncio.sleep(0.02)
    assert counting.arms > 0 and not sent  # armed again; an abandoned batch calls nobody back
