"""TP lock-step of the prefill worker, without processes: who may broadcast.

Regression: a follower whose room was ended by tp rank 0 before its own Prefill RPC
registered it (so the room was never followed) used to broadcast ``("end", room)`` from
its compute thread when it finished the room, while its ``_follow`` thread sat in the
group's broadcast. Two receivers on one rank desynchronised gloo ("213 vs 8 ... Is there a
distributed collective mismatch") and killed the follower, and with it the whole group.
"""

from __future__ import annotations

import dataclasses

import pytest

from pdgrpc.engine.reference import ReferenceEngine
from pdgrpc.errors import RequestFailed
from pdgrpc.prefill.compute_thread import ThreadCompute
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
