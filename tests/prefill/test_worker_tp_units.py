"""TP lock-step of the prefill worker, without processes: who may broadcast, and when a
follower's room takes its pages (tp rank 0's commands from a queue, not gloo).

Regression: a follower whose room was ended by tp rank 0 before its own Prefill RPC
registered it (so the room was never followed) used to broadcast ``("end", room)`` from
its compute thread when it finished the room, while its ``_follow`` thread sat in the
group's broadcast. Two receivers on one rank desynchronised gloo ("213 vs 8 ... Is there a
distributed collective mismatch") and killed the follower, and with it the whole group.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import queue
import unittest.mock
from typing import AsyncIterator

import pytest
import torch
import torch.distributed

from pdgrpc.engine.reference import ReferenceEngine
from pdgrpc.errors import RequestFailed
from pdgrpc.prefill.compute_thread import ThreadCompute
from pdgrpc.prefill.compute_tp import TpFollowerCompute
from pdgrpc.prefill.worker import PrefillWorker, WorkerConfig
from pdgrpc.transport import registry
from pdgrpc.v1 import prefill_pb2
from tests.prefill.harness import CONFIG


async def _broadcasts_when_a_room_ends_uncomputed(tp_rank: int) -> list[tuple]:
    # this rank's shard of the model; nothing is computed, so no real collective is needed
    # A pool that holds the TP scratch pages for one prompt and a few more: a whole prompt
    # is refused on every rank before its compute.
    pages = ReferenceEngine(CONFIG).pages_needed(CONFIG.max_prompt_tokens) + 4
    engine = ReferenceEngine(dataclasses.replace(CONFIG, tp_rank=tp_rank, tp_size=2, num_pages=pages), all_reduce=lambda t: t)
    worker = PrefillWorker(engine, registry.create("fake"), WorkerConfig(tp_rank=tp_rank, tp_size=2))
    sent: list[tuple] = []
    worker.compute.broadcast = sent.append  # type: ignore[attr-defined]  # record instead of a collective
    req = prefill_pb2.PrefillRequest(bootstrap_room=7, input_ids=[1] * CONFIG.max_prompt_tokens)  # on a follower: never followed
    with pytest.raises(RequestFailed, match="the pool has"):
        await worker.prefill(req)
    if isinstance(worker.compute, ThreadCompute):
        worker.compute.executor.shutdown(wait=True)  # whatever the room's end queued for the compute thread has run
    return sent


async def test_only_the_leader_tells_the_group_a_room_ended() -> None:
    assert await _broadcasts_when_a_room_ends_uncomputed(0) == [("end", 7)]
    assert await _broadcasts_when_a_room_ends_uncomputed(1) == []


class _Commands:
    """Tp rank 0's broadcasts as a follower's compute thread receives them: a queue the
    test fills, standing in for the gloo collective."""

    def __init__(self) -> None:
        self.queue: queue.Queue[tuple] = queue.Queue()

    def broadcast_object_list(self, box: list, src: int = 0) -> None:
        box[0] = self.queue.get()


@contextlib.asynccontextmanager
async def _follower(room_wait_s: float) -> AsyncIterator[tuple[TpFollowerCompute, _Commands]]:
    engine = ReferenceEngine(dataclasses.replace(CONFIG, tp_rank=1, tp_size=2), all_reduce=lambda t: t)
    cmds = _Commands()
    with unittest.mock.patch.object(torch.distributed, "broadcast_object_list", cmds.broadcast_object_list):
        c = TpFollowerCompute(engine, "prefill0.1-compute", 0, tp_rank=1, room_wait_s=room_wait_s, lost_rooms=16)
        await c.start()
        try:
            yield c, cmds
        finally:
            cmds.queue.put(("stop",))
            await c.close()


async def test_a_follower_room_takes_its_pages_only_once_rank_0_starts_it() -> None:
    """No room of a follower takes pages before tp rank 0 starts it; one started that holds
    its pages joins the group's count; one whose pages do not come within the wait fails on
    this rank, naming why, and the follower goes on with the next command."""
    async with _follower(room_wait_s=0.5) as (c, cmds):
        started = asyncio.ensure_future(c.started(7))
        await asyncio.sleep(0.1)
        assert not started.done()  # rank 0 has not started it
        cmds.queue.put(("agree", 7, 0))
        await asyncio.wait_for(started, 10)
        assert await asyncio.wait_for(c.agree(7, 0), 10) == 0
        await c.finish(7, None)

        slow = asyncio.ensure_future(c.started(8))
        cmds.queue.put(("agree", 8, 0))
        await asyncio.wait_for(slow, 10)
        await asyncio.sleep(2.0)  # its pages take longer than the follower waits
        with pytest.raises(RequestFailed, match="tp rank 1: its KV pages were not free within 0.5 s of tp rank 0 starting it"):
            await c.agree(8, 0)
        await c.finish(8, None)

        after = asyncio.ensure_future(c.started(9))
        cmds.queue.put(("agree", 9, 0))
        await asyncio.wait_for(after, 10)
        await c.finish(9, None)


async def test_a_follower_room_that_ends_before_rank_0_starts_it_holds_nothing_up() -> None:
    """A room that ended here before rank 0 started it is computed without this rank at
    once (no wait); one rank 0 ends before starting it fails here at once."""
    async with _follower(room_wait_s=60.0) as (c, cmds):
        gone = asyncio.ensure_future(c.started(7))
        await asyncio.sleep(0.05)
        gone.cancel()
        await c.finish(7, None)  # its RPC ended here (cancelled by the controller)
        cmds.queue.put(("agree", 7, 0))  # rank 0 starts it anyway: no 60 s wait for it
        nxt = asyncio.ensure_future(c.started(8))
        cmds.queue.put(("agree", 8, 0))
        await asyncio.wait_for(nxt, 10)
        await c.finish(8, None)

        ended = asyncio.ensure_future(c.started(9))
        await asyncio.sleep(0.05)
        cmds.queue.put(("end", 9))
        with pytest.raises(RequestFailed, match="tp rank 0 ended the room before it was computed"):
            await asyncio.wait_for(ended, 10)
        await c.finish(9, None)
