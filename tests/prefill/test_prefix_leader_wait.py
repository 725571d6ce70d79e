"""A real prefill computes a shared prefix once: a prompt whose prefix another request is
computing waits for it, then reuses its pages, bit-exactly; a leader that never ends
holds it only for a bounded time (half of ``--page-wait-timeout``).

The leader is held in flight by withholding its decode's handshake: its prompt is
computed, but its pages become cached only when its request ends.
"""

from __future__ import annotations

import asyncio
import time
from typing import Iterator

import pytest

from pdgrpc.engine.base import SamplingParams
from pdgrpc.v1 import prefill_pb2
from tests.eventually import eventually_async
from tests.prefill.fake_decode import FakeDecode, KVPoll
from tests.prefill.harness import CONFIG, active_requests, assert_landed_bit_exact, new_room, prefill_stub, prompt, request
from tests.prefill.procs import ENGINE_FLAGS, PrefillProc

pytestmark = pytest.mark.timeout(120)

PAGE_WAIT_S = 12.0  # a follower waits at most half of it


@pytest.fixture(scope="module")
def prefill(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefillProc]:
    flags = [*ENGINE_FLAGS, "--transport", "tcp", "--page-wait-timeout", str(PAGE_WAIT_S)]
    p = PrefillProc(flags, tmp_path_factory.mktemp("leader_wait"), "leader")
    try:
        yield p
    finally:
        assert p.stop() == 0, p.log()[-3000:]


async def _pair(p: PrefillProc, leader_ids: list[int], follower_ids: list[int], release_leader: bool) -> tuple[
        prefill_pb2.PrefillResponse, prefill_pb2.PrefillResponse, float]:
    """The leader's Prefill is held (no handshake) while the follower's arrives with its
    handshake; then the leader's handshake is sent (``release_leader``) or, after the
    follower is done, the leader is cancelled. Returns both responses (the leader's None
    when cancelled) and the follower's seconds from its Prefill to its response."""
    d = FakeDecode(CONFIG)
    await d.start()
    ch, stub = await prefill_stub(p)
    try:
        lroom, froom = new_room(), new_room()
        lr, fr = d.allocate(lroom, len(leader_ids)), d.allocate(froom, len(follower_ids))
        worker = await d.worker_for(p.bootstrap, lroom, query=False, dp_size=1)
        leader = asyncio.ensure_future(stub.Prefill(request(lroom, leader_ids), timeout=60))
        await eventually_async(lambda: active_requests(stub), 15, what="the leader reached the worker")
        t0 = time.monotonic()
        follower = asyncio.ensure_future(stub.Prefill(request(froom, follower_ids), timeout=60))
        await d.handshake(worker, fr)

        async def in_worker() -> bool:
            return follower.done() or await active_requests(stub) == 2

        await eventually_async(in_worker, 15, what="the follower reached the worker")
        if release_leader:
            await d.handshake(worker, lr)
            lresp = await leader
            assert (await d.wait(lr)).state is KVPoll.SUCCESS
        fresp = await follower
        took = time.monotonic() - t0
        assert (await d.wait(fr)).state is KVPoll.SUCCESS
        assert_landed_bit_exact(d, fr, follower_ids, SamplingParams())
        if not release_leader:
            leader.cancel()
            lresp = None
        return lresp, fresp, took
    finally:
        await ch.close()
        await d.close()


async def test_a_follower_waits_for_its_leader_and_reuses_its_pages(prefill: PrefillProc) -> None:
    leader_ids = prompt(41, seed=21)  # 10 full pages it leaves cached
    follower_ids = leader_ids[:36] + prompt(9, seed=22)[1:]  # 9 of them shared
    lresp, fresp, _ = await _pair(prefill, leader_ids, follower_ids, release_leader=True)
    assert lresp is not None and lresp.cached_tokens == 0
    assert fresp.cached_tokens == 36  # computed once, by the leader


async def test_a_leader_that_does_not_end_holds_its_follower_a_bounded_time(prefill: PrefillProc) -> None:
    leader_ids = prompt(41, seed=31)
    follower_ids = leader_ids[:36] + prompt(9, seed=32)[1:]
    _, fresp, took = await _pair(prefill, leader_ids, follower_ids, release_leader=False)
    assert fresp.cached_tokens == 0  # it computed the prefix itself
    assert PAGE_WAIT_S / 2 <= took < PAGE_WAIT_S / 2 + 30
