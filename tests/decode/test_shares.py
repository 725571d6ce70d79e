"""A client's share of the decode pool: past it a call waits for that client's own calls,
not for anyone else's, and gives up naming the flag."""

from __future__ import annotations

import asyncio

import pytest

from pdgrpc.decode.shares import PoolShares
from pdgrpc.rpc.open_calls import TooManyOpenCalls


async def test_a_call_past_its_clients_share_waits_for_that_client_only() -> None:
    shares = PoolShares(0.5, num_pages=100, num_slots=8)  # 50 pages, 4 calls each
    await shares.take("a", 30, 1.0)
    await shares.take("b", 50, 1.0)  # another client: not held up by a
    waiting = asyncio.ensure_future(shares.take("a", 30, 10.0))  # 60 > 50
    await asyncio.sleep(0.05)
    assert not waiting.done()
    shares.give_back("a", 30)  # a's first call got its first token
    await asyncio.wait_for(waiting, 5)
    assert shares.pages["a"] == 30 and shares.calls["a"] == 1


async def test_a_call_bigger_than_the_share_runs_alone_and_a_wait_ends_naming_the_flag() -> None:
    shares = PoolShares(0.25, num_pages=100, num_slots=8)
    await shares.take("a", 80, 1.0)  # alone: admitted whatever it needs
    with pytest.raises(TooManyOpenCalls, match="--max-decode-share"):
        await shares.take("a", 1, 0.05)


@pytest.mark.parametrize("share", [0.0, 1.5])
def test_a_share_outside_0_1_is_refused(share: float) -> None:
    with pytest.raises(ValueError, match="--max-decode-share"):
        PoolShares(share, 10, 4)
