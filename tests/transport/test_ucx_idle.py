"""An idle UCX worker sleeps on its event fd alone: no timer wakes it, and a message
sent to it wakes it at once (on a small host every idle wake-up is CPU taken from the
compute)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

ucx = pytest.importorskip("pdgrpc.transport.ucx", reason="needs the ucx extra: pip install 'pdgrpc[ucx]'")
pytest.importorskip("libucx", reason="the rdma backend needs the UCX libraries of the ucx extra")
from tests.transport.ucx_pair import CountingApi, Pair, until  # noqa: E402  (after the importorskips)


async def test_an_idle_worker_does_not_wake_until_a_message_arrives() -> None:
    counting = CountingApi(ucx.api())
    async with Pair(tx_functions=counting) as pair:
        inbox = np.zeros(64, dtype=np.uint8)
        got: list[Any] = []
        # A control receive, always posted: the worker is idle with it.
        pair.tx.recv([(inbox.ctypes.data, inbox.nbytes)], 0x77, ucx.FULL_MASK,
                     lambda status, length, tag: got.append((status, length)), inbox, background=True)
        await asyncio.sleep(0.05)
        counting.progress = 0
        await asyncio.sleep(0.3)
        assert counting.progress == 0  # asleep on the fd the whole time
        note = np.full(64, 7, dtype=np.uint8)
        pair.rx.send(pair.back, [(note.ctypes.data, note.nbytes)], 0x77, lambda *a: None, note)
        await until(lambda: bool(got), timeout=5.0)  # only the fd can wake it: no timer would
        assert got == [(ucx.UCS_OK, 64)] and bytes(inbox) == bytes(note)


async def test_a_worker_waiting_for_data_sleeps_through_the_wait() -> None:
    """A data receive posted ahead of the sender's compute waits as long as the compute
    takes: the worker sleeps on its fd through it, and the data wakes it."""
    counting = CountingApi(ucx.api())
    async with Pair(tx_functions=counting) as pair:
        dst = np.zeros(1 << 16, dtype=np.uint8)
        got: list[Any] = []
        pair.tx.recv([(dst.ctypes.data, dst.nbytes)], 0x78, ucx.FULL_MASK,
                     lambda status, length, tag: got.append((status, length)), dst)
        await asyncio.sleep(0.05)
        counting.progress = 0
        await asyncio.sleep(0.3)
        assert counting.progress == 0
        src = np.full(1 << 16, 3, dtype=np.uint8)
        pair.rx.send(pair.back, [(src.ctypes.data, src.nbytes)], 0x78, lambda *a: None, src)
        await until(lambda: bool(got), timeout=5.0)
        assert got == [(ucx.UCS_OK, 1 << 16)] and bytes(dst) == bytes(src)


async def test_an_idle_rdma_transport_does_not_sweep() -> None:
    """The receiver sweeps stray messages from UCX's queue only after UCX progressed
    (tests/transport/test_rdma_hostile.py: strays are still dropped)."""
    from tests.transport.rdma_pair import paired

    async with paired() as (recv, *_):
        receiver = recv.receiver
        sweep = receiver.sweep
        sweeps: list[int] = []
        receiver.sweep = lambda: sweeps.append(sweep()) or sweeps[-1]
        await asyncio.sleep(0.25)  # the connection's own messages are swept
        sweeps.clear()
        await asyncio.sleep(0.35)
        assert sweeps == []
