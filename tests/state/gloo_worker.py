"""One TP rank of a decode, run in its own OS process by test_state_gloo.py.

Every rank admits the same requests in the same order (as the decode server broadcasts
its scheduling input), but each rank's KV completion, metadata landing and transport
failures arrive at random moments drawn from a per-rank RNG, with real sleeps in between,
and each rank reads its own clock. The poll's all-reduce MIN is a real
``torch.distributed.all_reduce`` over a gloo group. The rank records what it popped.
"""

from __future__ import annotations

import datetime
import json
import os
import random
import time

import torch
import torch.distributed as dist

from pdgrpc.kvpoll import KVPoll
from pdgrpc.state import Committed, DecodeDeadlines, DecodeQueues, MetadataBuffers, MetadataRow, NewRequest


def run_rank(rank: int, world: int, store: str, seed: int, n_requests: int, out_path: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    try:
        _loop(rank, seed, n_requests, out_path)
    finally:
        dist.destroy_process_group()


def _loop(rank: int, seed: int, n_requests: int, out_path: str) -> None:
    shared = random.Random(seed)  # identical on every rank: what the scheduler admits
    local = random.Random(seed * 7919 + rank)  # per rank: when things land
    bufs = MetadataBuffers(8)
    q = DecodeQueues(bufs, 24, deadlines=DecodeDeadlines(transferring_s=0.6, bootstrap_s=5, waiting_for_input_s=5))
    rooms = [shared.randrange(1, 1 << 63) for _ in range(n_requests)]
    kv_at: dict[int, int] = {}
    meta_at: dict[int, int] = {}
    pops: list[list[object]] = []
    collectives = 0

    def all_reduce_min(t: torch.Tensor) -> torch.Tensor:
        nonlocal collectives
        collectives += 1
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return t

    t0 = time.monotonic()
    it = next_room = 0
    while len(pops) < n_requests:  # identical on every rank iff the pops are
        now = time.monotonic() - t0  # each rank's own clock
        for _ in range(shared.randint(0, 2)):
            if next_room < n_requests:
                q.add(NewRequest(rooms[next_room], "prefill:1", shared.randint(1, 3), dp_rank=0), now)
                next_room += 1
        for hs in q.prealloc(now):
            kv_at[hs.room] = it + local.randint(0, 6)
            # ~3% of rows never land on this rank: the transfer deadline must end them everywhere
            meta_at[hs.room] = it + local.randint(0, 10) if local.random() > 0.03 else 1 << 60
        for room, when in list(kv_at.items()):
            if when <= it:
                # ~2% transport failures on this rank only
                q.on_local_status(room, KVPoll.FAILED if local.random() < 0.02 else KVPoll.SUCCESS)
                del kv_at[room]
        for room, when in list(meta_at.items()):
            if when <= it:
                slot = q.slot_of(room)
                if slot is not None and not q.is_quarantined(room):
                    bufs.write_row(slot, MetadataRow(room % 50021 + 1), room)
                del meta_at[room]
        if local.random() < 0.3:
            time.sleep(local.random() * 0.003)
        for out in q.poll_transfers(now, all_reduce_min):
            if isinstance(out, Committed):
                assert out.row is not None and out.row.output_id == out.room % 50021 + 1
                q.release_pages(out.pages)
                pops.append(["commit", out.room])
            else:
                q.on_abort_ack(out.room)  # the prefill acknowledges at once
                kv_at.pop(out.room, None)
                meta_at.pop(out.room, None)
                pops.append(["abort", out.room, out.reason.name])
        it += 1
    with open(out_path, "w") as f:
        json.dump({"rank": rank, "pops": pops, "collectives": collectives}, f)
