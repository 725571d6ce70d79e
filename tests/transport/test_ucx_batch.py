"""UCX batches (pdgrpc.transport.ucx_batch through UcxWorker.send_batch/recv_batch):
one completion per batch, in posting order, whatever order the messages land in; a
truncated or cancelled message is reported at its own index; a cancelled or closed
batch leaves nothing pending. Two real UCX workers in this process, talking over
UCX's shared-memory transports."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest

pytest.importorskip("libucx", reason="the rdma backend needs the UCX libraries of the ucx extra: pip install 'pdgrpc[ucx]'")

from pdgrpc.transport.ucx import (  # noqa: E402  (after the importorskip)
    UCS_ERR_CANCELED, UCS_ERR_MESSAGE_TRUNCATED, UCS_OK, api as ucx_api,
)
from tests.transport.ucx_pair import Pair, runs_of, until  # noqa: E402

SIZES = [100, 1 << 20, 7, 300_000]  # eager and rendezvous messages mixed
TAGS = [0x51, 0x52, 0x53, 0x54]


@pytest.fixture
async def pair() -> AsyncIterator[Pair]:
    async with Pair() as p:
        yield p


async def test_a_batch_completes_once_with_every_message_in_order(pair: Pair) -> None:
    rng = np.random.default_rng(1)
    src = [rng.integers(0, 256, n, dtype=np.uint8) for n in SIZES]
    dst = [np.zeros(n, dtype=np.uint8) for n in SIZES]
    got: list[list[tuple[int, int]]] = []
    sent: list[list[tuple[int, int]]] = []
    pair.rx.recv_batch(runs_of(dst), TAGS, got.append, dst)
    pair.tx.send_batch(pair.ep, runs_of(src), TAGS, sent.append, src)
    await until(lambda: bool(got and sent))
    await asyncio.sleep(0.05)  # a second completion would come now
    assert got == [[(UCS_OK, n) for n in SIZES]]
    assert sent == [[(UCS_OK, 0)] * len(SIZES)]
    assert all(np.array_equal(a, b) for a, b in zip(src, dst))
    assert pair.rx.inflight_requests == 0 and pair.tx.inflight_requests == 0


async def test_a_batch_whose_last_message_lands_first_waits_for_the_others(pair: Pair) -> None:
    """Only the last request calls back; the others are tested then and, when still
    pending, after each progress round until they land."""
    src = [np.full(n, i + 1, dtype=np.uint8) for i, n in enumerate(SIZES)]
    dst = [np.zeros(n, dtype=np.uint8) for n in SIZES]
    got: list[list[tuple[int, int]]] = []
    pair.rx.recv_batch(runs_of(dst), TAGS, got.append, dst)
    pair.tx.send(pair.ep, runs_of(src[-1:]), TAGS[-1], lambda *a: None, src)
    await until(lambda: bool(dst[-1].all()))
    await asyncio.sleep(0.05)
    assert got == [], "the batch completed before its other messages landed"
    assert pair.rx.inflight_requests == 1
    for i in range(len(SIZES) - 1):
        pair.tx.send(pair.ep, runs_of(src[i : i + 1]), TAGS[i], lambda *a: None, src)
    await until(lambda: bool(got))
    assert got == [[(UCS_OK, n) for n in SIZES]]
    assert all(np.array_equal(a, b) for a, b in zip(src, dst))
    assert pair.rx.inflight_requests == 0


async def test_a_batch_frees_each_request_once_after_calling_its_owner_back(
        pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """The owner (a receiver about to ACK) hears first; the requests tested complete are
    freed after it, each exactly once."""
    src = [np.full(n, 7, dtype=np.uint8) for n in SIZES]
    dst = [np.zeros(n, dtype=np.uint8) for n in SIZES]
    events: list[tuple[str, int]] = []
    api = ucx_api()  # the one table of libucp calls every worker makes
    real_free = api.request_free

    def free(ptr: int) -> None:
        events.append(("free", ptr))
        real_free(ptr)

    monkeypatch.setattr(api, "request_free", free)
    token = pair.rx.recv_batch(runs_of(dst), TAGS, lambda results: events.append(("owner", 0)), dst)
    ptrs = pair.rx.batch_requests(token)
    pair.tx.send_batch(pair.ep, runs_of(src), TAGS, lambda r: None, src)
    await until(lambda: ("owner", 0) in events and sum(e[1] in ptrs for e in events) == len(ptrs))
    await asyncio.sleep(0.05)  # a second free would come now
    mine = [e for e in events if e == ("owner", 0) or e[1] in ptrs]
    assert sorted(p for what, p in mine if what == "free") == sorted(ptrs)  # each once, none left
    assert mine.index(("owner", 0)) <= 1  # only the request whose completion called back, before
    assert all(np.array_equal(a, b) for a, b in zip(src, dst))


async def test_a_truncated_message_is_reported_at_its_index(pair: Pair) -> None:
    dst = [np.zeros(64, dtype=np.uint8), np.zeros(64, dtype=np.uint8)]
    src = [np.ones(64, dtype=np.uint8), np.ones(128, dtype=np.uint8)]  # the second is too long
    got: list[list[tuple[int, int]]] = []
    pair.rx.recv_batch(runs_of(dst), TAGS[:2], got.append, dst)
    pair.tx.send_batch(pair.ep, runs_of(src), TAGS[:2], lambda r: None, src)
    await until(lambda: bool(got))
    [[first, second]] = got
    assert first == (UCS_OK, 64)
    assert second[0] == UCS_ERR_MESSAGE_TRUNCATED


async def test_a_cancelled_batch_completes_once_and_leaves_nothing_pending(pair: Pair) -> None:
    dst = [np.zeros(n, dtype=np.uint8) for n in SIZES]
    got: list[list[tuple[int, int]]] = []
    token = pair.rx.recv_batch(runs_of(dst), TAGS, got.append, dst)
    await asyncio.sleep(0.01)
    pair.rx.cancel(token)
    await until(lambda: bool(got))
    await asyncio.sleep(0.05)
    assert got == [[(UCS_ERR_CANCELED, 0)] * len(SIZES)]
    assert pair.rx.inflight == 0


async def test_closing_a_worker_with_a_pending_batch_frees_it() -> None:
    from pdgrpc.transport.ucx_api import PARKED

    parked = len(PARKED)
    async with Pair() as p:
        dst = [np.zeros(n, dtype=np.uint8) for n in SIZES]
        got: list[list[tuple[int, int]]] = []
        p.rx.recv_batch(runs_of(dst), TAGS, got.append, dst)
        await asyncio.sleep(0.01)
    assert got == [[(UCS_ERR_CANCELED, 0)] * len(SIZES)]
    assert len(PARKED) == parked, "the worker was parked with the batch still pending"


async def test_a_batch_needs_one_tag_per_run(pair: Pair) -> None:
    buf = np.zeros(8, dtype=np.uint8)
    with pytest.raises(ValueError, match="one tag per run"):
        pair.rx.recv_batch(runs_of([buf]), [], lambda r: None, buf)
    with pytest.raises(ValueError, match="one tag per run"):
        pair.rx.recv_batch([], [], lambda r: None, buf)
    assert pair.rx.inflight == 0
