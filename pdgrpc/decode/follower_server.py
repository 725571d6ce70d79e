"""``python -m pdgrpc.decode.follower``: TP rank r >= 1 of a decode instance.

Started by rank 0 (``python -m pdgrpc.decode --tp-size N``), never by hand: it gets the
same engine, transport and scheduling flags plus ``--tp-rank``/``--tp-size``/
``--dist-init``. It holds this rank's engine shard (its KV heads), transport endpoint and
metadata rows, and replays rank 0's queue calls (see :mod:`pdgrpc.decode.tp`):

    sync  -> apply the logged calls; advertise this rank's grants for new transfers,
             release the rooms that ended; local poll + metadata gate -> MIN all-reduce
             -> commit / abort exactly what every other rank commits / aborts
    step  -> the same decode step as rank 0 (the engine all-reduces inside)
    stop  -> leave, close the transport, exit 0

It exits 1 when the TP group breaks (rank 0 died), and with rank 0 (parent-death signal).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from typing import Any

from pdgrpc.argtypes import check_rank
from pdgrpc.decode.cli import build_parser as decode_parser
from pdgrpc.decode.cli import scheduler_config_from_args
from pdgrpc.decode.job import SchedulerConfig
from pdgrpc.decode.rank import RankTransfers, make_buffers, make_queues, prefill_chunks, prefill_locally
from pdgrpc.decode.tp import EVICTABLE, REPLAYED, ROOM_BIND, ROOM_INFO, ROOM_WRITERS, TpGroup, TpGroupBroken
from pdgrpc.engine.tp import torch_distributed_all_reduce
from pdgrpc.errors import PdgrpcError
from pdgrpc.kvpoll import KVPoll
from pdgrpc.metrics import DecodeMetrics, start_metrics_from_args
from pdgrpc.serving.children import die_with_parent
from pdgrpc.serving.engines import build_engine
from pdgrpc.serving.launch import Role
from pdgrpc.serving.flags import create_transport, tune_malloc_from_args
from pdgrpc.serving.logs import request_event
from pdgrpc.serving.rendezvous import check_dist_init
from pdgrpc.serving.threads import compute_executor
from pdgrpc.state import AbortReason, Aborted, Committed, SendHandshake

log = logging.getLogger("pdgrpc.decode")


class Follower:
    def __init__(self, ns: argparse.Namespace, config: SchedulerConfig, tp: TpGroup) -> None:
        self.tp = tp
        self.rank = tp.rank
        self.engine = build_engine(ns, tp_rank=tp.rank, tp_size=tp.size, all_reduce=torch_distributed_all_reduce())
        self.transport = create_transport(ns, tp_rank=tp.rank)
        self.queues = make_queues(make_buffers(ns.num_slots), self.engine.num_pages, config, self.engine.tokenizer.vocab_size)
        self.transfers = RankTransfers(self.transport, self.engine, self.queues, tp.rank, tp.size)
        self.metrics = DecodeMetrics(transport=self.transport.name)
        self.metrics.set_info(tp_rank=tp.rank, tp_size=tp.size)
        self.evictable = 0  # rank 0's cached pages no request holds (EVICTABLE)
        self.info: dict[int, tuple[int, int]] = {}  # room -> (pages the prefill writes, prefill tp size)
        self.committed: list[int] = []  # rooms in commit order (the TP fault test reads the log)
        # The engine's steps, niced as rank 0's (the group computes in lock step).
        self._engine_thread = compute_executor("decode-compute", config.compute_nice)

    def stats(self) -> dict[str, int]:
        return self.transfers.stats(self.queues.num_requests, self.evictable)

    async def start(self) -> None:
        descriptor = await self.transfers.register()
        # With its data-plane key: rank 0 issues this rank's credentials in the handshakes
        # it sends on its behalf (the key stays inside the decode instance).
        await asyncio.to_thread(self.tp.all_gather, (descriptor, self.transport.auth_key))

    # -- replay -------------------------------------------------------------------------
    def _advertise(self, hs: SendHandshake) -> None:
        written, prefill_tp = self.info.get(hs.room, (len(hs.pages), 1))
        self.transfers.track(hs.room, prefill_tp)
        try:
            self.transfers.advertise(hs.room, hs.pages[:written], hs.slot)
        except PdgrpcError as exc:  # the local poll then reports it FAILED: all ranks abort it
            log.error("room=%d: transport refused the grant on TP rank %d: %s", hs.room, self.rank, exc)
            self.queues.on_local_status(hs.room, KVPoll.FAILED)

    def _ended(self, room: int, abort_message: str | None = None) -> None:
        self.info.pop(room, None)
        self.transfers.release(room, abort_message)

    def _local_poll(self, room: int) -> tuple[KVPoll, AbortReason]:
        state, _, why = self.transfers.status(room)
        return state, why

    def sync(self, entries: list[tuple[str, tuple[Any, ...]]], now: float) -> None:
        for name, args in entries:
            if name == ROOM_INFO:
                room, written, prefill_tp = args
                self.info[room] = (written, prefill_tp)
                continue
            if name == EVICTABLE:
                (self.evictable,) = args
                continue
            if name == ROOM_WRITERS:
                room, per_rank = args
                self.transfers.watch_writers(room, per_rank[self.rank])
                continue
            if name == ROOM_BIND:
                room, rank, prefill_tp_rank, writer = args
                if rank == self.rank:
                    self.transfers.bind_writer(room, prefill_tp_rank, writer)
                continue
            if name not in REPLAYED:
                raise PdgrpcError(f"TP replay: {name!r} is not a replayed call")
            result = getattr(self.queues, name)(*args)
            if name == "prealloc":
                for hs in result:
                    self._advertise(hs)
            elif name in ("tick", "cancel"):
                for a in [result] if isinstance(result, Aborted) else (result or []):
                    if isinstance(a, Aborted):
                        self._ended(a.room, a.message)
        self.transfers.check_writers()
        t = self.queues.prepare_poll(now, self._local_poll)
        reduced = self.tp.all_reduce_min(t)
        for outcome in self.queues.finish_poll(reduced, now):
            self._ended(outcome.room, outcome.message if isinstance(outcome, Aborted) else None)
            if isinstance(outcome, Committed):
                self.committed.append(outcome.room)
                request_event(log, outcome.room, "committed", tp_rank=self.rank, slot=outcome.slot, seq=len(self.committed))
            else:
                self.metrics.on_abort(outcome.reason)
                request_event(
                    log, outcome.room, "aborted", level=logging.WARNING, tp_rank=self.rank, reason=outcome.reason.name,
                    message=outcome.message,
                )

    async def run(self) -> int:
        while True:
            kind, arg = await asyncio.to_thread(self.tp.broadcast)
            if kind == "sync":
                entries, now = arg
                self.sync(entries, now)
            elif kind == "step":
                await asyncio.get_running_loop().run_in_executor(self._engine_thread, self.engine.decode_step, arg)
            elif kind == "prefill":
                await asyncio.get_running_loop().run_in_executor(self._engine_thread, prefill_locally, self.engine, arg)
            elif kind == "chunks":
                await asyncio.get_running_loop().run_in_executor(self._engine_thread, prefill_chunks, self.engine, arg)
            elif kind == "stop":
                log.info("decode TP rank %d: stop from rank 0", self.rank)
                return 0
            else:
                raise PdgrpcError(f"TP rank {self.rank}: unknown command {kind!r} from rank 0")


def build_parser() -> argparse.ArgumentParser:
    p = decode_parser()
    p.prog = "python -m pdgrpc.decode.follower"
    p.description = __doc__
    p.add_argument("--tp-rank", type=int, required=True, help="this process's TP rank, in [1, --tp-size)")
    return p


async def _main(ns: argparse.Namespace) -> int:
    tp = await TpGroup.join(ns.tp_rank, ns.tp_size, ns.dist_init, ns.dist_timeout)
    follower = Follower(ns, scheduler_config_from_args(ns), tp)
    stop_metrics = start_metrics_from_args(ns, follower.metrics.registry, f"decode tp{ns.tp_rank}")
    follower.metrics.bind(follower.stats)
    loop = asyncio.get_running_loop()
    # SIGTERM: rank 0 stops the ranks itself (a "stop" command); a signal alone must not
    # break the collectives it is about to issue, so it is ignored here.
    for sig in (signal.SIGTERM, signal.SIGINT):  # (a terminal's Ctrl-C reaches the whole group)
        loop.add_signal_handler(sig, lambda: log.info("decode TP rank %d: signal received, waiting for rank 0 to stop it", ns.tp_rank))
    try:
        await follower.start()
        log.info(
            "decode TP rank %d/%d ready: transport=%s pages=%d heads=[%d, %d)", ns.tp_rank, ns.tp_size, follower.transport.name,
            follower.engine.num_pages, follower.engine.kv_layout.head_start, follower.engine.kv_layout.head_end,
        )
        return await follower.run()
    except TpGroupBroken as exc:
        log.error("%s; exiting", exc)
        return 1
    finally:
        follower.metrics.unbind()
        stop_metrics()
        await follower.transport.close()
        tp.close()


def serve(ns: argparse.Namespace) -> int:
    tune_malloc_from_args(ns)
    die_with_parent()
    try:
        return asyncio.run(_main(ns))
    except PdgrpcError as exc:
        log.error("%s", exc)
        return 2


def check(ns: argparse.Namespace) -> None:
    """Refuse a rank that is no follower's before anything starts: rank 0 is the decode
    itself, and any rank outside the group waits on a TP group that never forms."""
    check_rank(ns.tp_rank, ns.tp_size, "--tp-rank", "--tp-size", first=1)
    check_dist_init(ns.dist_init, ns.tp_size)


ROLE = Role(build_parser=build_parser, serve=serve, log_name=lambda ns: f"decode.tp{ns.tp_rank}", check=check)
