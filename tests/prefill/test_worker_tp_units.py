"""TP lock-step of the prefill worker, without processes: who may broadcast.

Regression: a follower whose room was ended by tp rank 0 before its own Prefill RPC
registered it (so the room was never followed) used to broadcast ``("end", room)`` from
its compute thread when it finished the room, while its ``_follow`` thread sat in the
group's broadcast. Two receivers on one rank desynchronised gloo ("213 vs 8 ... Is there a
distributed collective mismatch") and killed the follower, and with it the whole group.
"""

from __future__ import annotations

import asyncio
import dataclasses

from pdgrpc.engine.reference import ReferenceEngine
from pdgrpc.prefill.compute_thread import ThreadCompute
from pdgrpc.prefill.worker import PrefillWorker, WorkerConfig, _Active
from pdgrpc.transport import registry
from tests.prefill.harness import CONFIG


async def _broadcasts_when_finishing_an_uncomputed_room(tp_rank: int) -> list[tuple]:
    # this rank's shard of the model; nothing is computed, so no real collective is needed
    engine = ReferenceEngine(dataclasses.replace(CONFIG, tp_rank=tp_rank, tp_size=2), all_reduce=lambda t: t)
    worker = PrefillWorker(engine, registry.create("fake"), WorkerConfig(tp_rank=tp_rank, tp_size=2))
    sent: list[tuple] = []
    worker.compute.broadcast = sent.append  # type: ignore[attr-defined]  # record instead of a collective
    task = asyncio.current_task()
    assert task is not None
    entry = _Active(room=7, task=task)  # never computed here; on a follower: never followed
    await worker._finish(entry)
    if isinstance(worker.compute, ThreadCompute):
        worker.compute.executor.shutdown(wait=True)  # whatever _finish queued for the compute thread has run
    return sent


async def test_only_the_leader_tells_the_group_a_room_ended() -> None:
    assert await _broadcasts_when_finishing_an_uncomputed_room(0) == [("end", 7)]
    assert await _broadcasts_when_finishing_an_uncomputed_room(1) == []
