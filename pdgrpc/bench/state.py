"""``python -m pdgrpc.bench state`` — the decode queues under 10k and 20k in-flight requests.

Each round, the ``--batch`` oldest transfers finish (KV SUCCESS reported, the metadata
row's room lands), one poll commits them, the engine returns their pages, and as many new
requests are admitted, preallocated and moved to TRANSFERRING (two more reports and a
poll). The number in flight stays constant, so the per-event cost at 20k vs 10k shows
whether anything scales with the queue length (target: ratio <= 1.2, i.e. O(1) per event;
throughput target >= 200k events/s on one core).

Events counted per request and round: add, handshake (prealloc), three transport reports,
commit, page release = 7. Metadata writes (a transport's job) are timed but not counted.
Torch is pinned to one thread and throughput is computed from this process's CPU time
(wall-clock events/s is reported too; on a shared machine it is lower and noisier).
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from pdgrpc.bench.report import Result
from pdgrpc.kvpoll import KVPoll
from pdgrpc.state import Committed, DecodeDeadlines, DecodeQueues, MetadataBuffers, NewRequest
from pdgrpc.state.room import Room

DESCRIPTION = "decode queues (pdgrpc.state) at 10k/20k in flight: events/s and per-event cost ratio"
EVENTS_PER_REQUEST = 7
PAGES_PER_REQUEST = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default="10000,20000", help="in-flight sizes; the first is the baseline (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=512, help="requests completed and admitted per round (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=60, help="timed rounds per size (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="repeat each size, keep the fastest (default: %(default)s)")


def measure(in_flight: int, batch: int, rounds: int) -> tuple[float, float]:
    """(CPU seconds, wall seconds) per event with ``in_flight`` transfers in the queues."""
    slots = in_flight + batch
    bufs = MetadataBuffers(slots)
    q = DecodeQueues(bufs, slots * PAGES_PER_REQUEST, deadlines=DecodeDeadlines(transferring_s=1e9, bootstrap_s=1e9))
    fifo: collections.deque[tuple[int, int]] = collections.deque()
    next_room = 1
    now = 0.0

    def admit(n: int) -> None:
        nonlocal next_room
        for _ in range(n):
            q.add(NewRequest(Room(next_room), "prefill:1", PAGES_PER_REQUEST, dp_rank=0), now)
            next_room += 1
        for hs in q.prealloc(now):
            q.on_local_status(hs.room, KVPoll.WAITING_FOR_INPUT)
            q.on_local_status(hs.room, KVPoll.TRANSFERRING)
            fifo.append((hs.room, hs.slot))
        q.poll_transfers(now)

    admit(in_flight)
    assert q.num_requests == in_flight

    def one_round() -> int:
        done = 0
        for _ in range(batch):
            room, slot = fifo.popleft()
            q.on_local_status(room, KVPoll.SUCCESS)
            bufs.write_room(slot, room)  # the row lands (transport)
        for out in q.poll_transfers(now):
            assert isinstance(out, Committed)
            q.release_pages(out.pages)
            done += 1
        admit(done)
        return done * EVENTS_PER_REQUEST

    for _ in range(3):  # warm-up
        one_round()
    events = 0
    # CPU time of this process (torch runs single-threaded): other jobs on a shared
    # machine inflate wall time, not this.
    t0, w0 = time.process_time(), time.perf_counter()
    for _ in range(rounds):
        events += one_round()
    cpu, wall = time.process_time() - t0, time.perf_counter() - w0
    assert q.num_requests == in_flight
    return cpu / events, wall / events


def run(args: argparse.Namespace) -> list[Result]:
    torch.set_num_threads(1)
    sizes = [int(s) for s in args.sizes.split(",")]
    runs = {n: [measure(n, args.batch, args.rounds) for _ in range(args.repeats)] for n in sizes}
    cost = {n: min(c for c, _ in r) for n, r in runs.items()}
    wall = {n: min(w for _, w in r) for n, r in runs.items()}
    base = sizes[0]
    results: list[Result] = []
    for n in sizes:
        case = f"{n // 1000}k in flight" if n % 1000 == 0 else f"{n} in flight"
        results.append(Result(case, "events/s (CPU time, 1 core)", 1.0 / cost[n], "1/s"))
        results.append(Result(case, "events/s (wall)", 1.0 / wall[n], "1/s"))
        if n == base:
            results.append(Result(case, "CPU cost per event", cost[n] * 1e9, "ns"))
        else:
            results.append(Result(case, "CPU cost per event", cost[n] * 1e9, "ns", cost[base] * 1e9, cost[n] / cost[base]))
    return results
