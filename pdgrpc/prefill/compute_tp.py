"""A TP group's forward pass: every rank runs the same ``prefill_chunk`` calls in the same
order, over the dp group's ``torch.distributed`` world (rank = tp rank).

Tp rank 0, the *leader* (:class:`TpLeaderCompute`), decides: before each chunk its
compute thread broadcasts ``("chunk", room, ids, sampling, start, end)`` and then computes
it. A *follower* (:class:`TpFollowerCompute`, tp rank > 0) runs a thread that receives a
command, computes it into its pages of that room (or into reserved scratch pages when it
does not hold the room: its Prefill RPC did not arrive within ``room_wait_s``, or the
room already ended here -- the room then fails on this rank), and posts to the room's
driver. ``("end", room)`` tells followers that the leader gave up a room, ``("stop",)``
ends their loop at shutdown. Collectives on a rank run only on its compute thread.

Every rank reserves scratch pages for one whole prompt: the same capacity on every rank.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from typing import Any

import grpc

from pdgrpc.engine.base import Engine, PrefillRequest, SampledToken
from pdgrpc.metrics import ServerAbortReason
from pdgrpc.prefill.compute import ChunkPost, Compute, ComputeJob, uncancellable
from pdgrpc.prefill.compute_thread import ThreadCompute
from pdgrpc.prefill.errors import RequestFailed
from pdgrpc.serving.threads import lower_thread_priority

__all__ = ["TpFollowerCompute", "TpLeaderCompute", "reserve_scratch"]

log = logging.getLogger("pdgrpc.prefill.worker")
C = grpc.StatusCode


def reserve_scratch(engine: Engine) -> tuple[int, ...]:
    """Pages for one whole prompt, kept by every rank of a TP group."""
    scratch = engine.alloc_pages(engine.pages_needed(engine.max_prompt_tokens))
    if scratch is None:
        raise ValueError(f"the KV pool of {engine.num_pages} pages cannot hold the TP scratch pages for "
                         f"{engine.max_prompt_tokens} tokens")
    return tuple(scratch)


class TpLeaderCompute(ThreadCompute):
    """Tp rank 0: a :class:`ThreadCompute` that commands the followers before each chunk."""

    def __init__(self, engine: Engine, name: str, nice: int, chunk_size: int, min_pages: int, tp_rank: int = 0) -> None:
        super().__init__(engine, name, nice, chunk_size, min_pages)
        self.tp_rank = tp_rank
        self.reserved_pages = reserve_scratch(engine)
        self._stopped = False

    def broadcast(self, cmd: tuple) -> None:  # type: ignore[type-arg]
        """Compute thread only: send ``cmd`` to the followers."""
        import torch.distributed as dist

        try:
            dist.broadcast_object_list([cmd], src=0)
        except Exception as exc:
            why = f"TP group broken: broadcast failed: {exc!r}"
            log.error("tp%d: %s", self.tp_rank, why)
            self._break(why)
            raise

    def compute_chunk(self, room: int, req: PrefillRequest, start: int, end: int) -> tuple[SampledToken | None, float]:
        if self.broken is not None:
            raise RequestFailed(C.UNAVAILABLE, f"room {room}: {self.broken}", ServerAbortReason.PEER_FAILURE)
        t = time.perf_counter()
        self.broadcast(("chunk", room, req.token_ids, req.sampling, start, end))
        return self.engine.prefill_chunk(req, start, end), time.perf_counter() - t

    async def finish(self, room: int, job: ComputeJob | None) -> None:
        await super().finish(room, job)
        if (job is None or not job.computed_all) and self.broken is None and not self._stopped:
            # The followers may wait for chunks of this room that will never come.
            try:
                self.executor.submit(self.broadcast, ("end", room))
            except RuntimeError:  # executor shut down
                pass

    async def close(self) -> None:
        if self.broken is None:
            fut = self.executor.submit(self.broadcast, ("stop",))
            try:
                await asyncio.wait_for(asyncio.wrap_future(fut), 10.0)
            except Exception as exc:
                log.error("tp%d: telling the followers to stop failed: %r", self.tp_rank, exc)
                self._stopped = True
                self.executor.shutdown(wait=False)  # the thread may be stuck in a collective
                return
        self._stopped = True
        await super().close()


@dataclasses.dataclass(eq=False)
class _Followed(ComputeJob):
    """A follower's room as its compute thread sees it (guarded by the follower's lock)."""

    pages: tuple[int, ...] = ()
    loop: asyncio.AbstractEventLoop | None = None
    inflight: "concurrent.futures.Future[None] | None" = None  # the chunk computing into our pages

    def post(self, item: ChunkPost) -> None:
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self.posts.put_nowait, item)


class TpFollowerCompute(Compute):
    """Tp rank > 0: computes what tp rank 0 commands, on a thread of its own."""

    def __init__(self, engine: Engine, name: str, nice: int, tp_rank: int, room_wait_s: float, lost_rooms: int) -> None:
        super().__init__()
        self.engine, self.name, self.nice, self.tp_rank = engine, name, nice, tp_rank
        self.room_wait_s = room_wait_s
        self.lost_rooms = lost_rooms
        self.reserved_pages = reserve_scratch(engine)
        self._lock = threading.Condition()
        self._followed: dict[int, _Followed] = {}  # rooms the compute thread may write
        self._lost: collections.OrderedDict[int, str] = collections.OrderedDict()  # rooms failed here (bounded)
        self._thread: threading.Thread | None = None
        self._stopped = False

    async def start(self) -> None:
        self._thread = threading.Thread(target=self._follow, name=self.name.replace("compute", "follow"), daemon=True)
        self._thread.start()

    def begin(self, room: int, request: PrefillRequest, start: int = 0) -> ComputeJob:
        """Let the compute thread write ``room`` into ``request``'s pages (the chunks, and
        where they start, come from tp rank 0's commands)."""
        if self.broken is not None:
            raise RequestFailed(C.UNAVAILABLE, f"room {room}: {self.broken}", ServerAbortReason.PEER_FAILURE)
        with self._lock:
            why = self._lost.get(room)
            if why is None:
                job = _Followed(room, pages=tuple(request.pages), loop=asyncio.get_running_loop())
                self._followed[room] = job
                self._lock.notify_all()
        if why is not None:
            raise RequestFailed(C.ABORTED, f"room {room}: tp rank {self.tp_rank}: {why}", ServerAbortReason.PEER_FAILURE)
        return job

    async def finish(self, room: int, job: ComputeJob | None) -> None:
        if not isinstance(job, _Followed):
            return
        # From here on the compute thread computes this room into scratch; wait for a
        # chunk it may be computing into our pages right now.
        with self._lock:
            self._followed.pop(room, None)
            self._lose(room, "the room ended on this rank")  # later chunks go to scratch at once
            inflight = job.inflight
        if inflight is not None:
            await uncancellable(asyncio.wrap_future(inflight))

    async def close(self) -> None:
        self._stopped = True
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 15.0)
            if self._thread.is_alive():
                log.error("tp%d: the follower thread did not stop (no stop command from tp rank 0)", self.tp_rank)

    def _lose(self, room: int, why: str) -> None:
        """Under the lock: ``room`` is computed without us."""
        self._lost[room] = why
        self._lost.move_to_end(room)
        while len(self._lost) > self.lost_rooms:
            self._lost.popitem(last=False)

    def _follow(self) -> None:
        """Run the leader's commands until ``("stop",)``."""
        import torch.distributed as dist

        lower_thread_priority(self.nice)  # as the leader's: the group computes in lock step
        while True:
            box: list[Any] = [None]
            try:
                dist.broadcast_object_list(box, src=0)
            except Exception as exc:
                if self._stopped:
                    return
                why = f"TP group broken: receiving from tp rank 0 failed: {exc!r}"
                log.error("tp%d: %s", self.tp_rank, why)
                self._break(why)
                with self._lock:
                    rooms = list(self._followed.values())
                for fr in rooms:
                    fr.post(ChunkPost(0, None, 0.0, RequestFailed(C.UNAVAILABLE, f"room {fr.room}: {why}", ServerAbortReason.PEER_FAILURE)))
                return
            cmd = box[0]
            if cmd[0] == "stop":
                log.info("tp%d: stop command from tp rank 0", self.tp_rank)
                return
            if cmd[0] == "end":
                self._end(cmd[1])
            else:
                self._chunk(*cmd[1:])

    def _end(self, room: int) -> None:
        with self._lock:
            fr = self._followed.get(room)
            if fr is None:
                self._lose(room, "tp rank 0 ended the room")
        if fr is not None:
            fr.post(ChunkPost(0, None, 0.0, RequestFailed(
                C.ABORTED, f"room {room}: tp rank 0 ended the room before it was computed", ServerAbortReason.PEER_FAILURE)))

    def _chunk(self, room: int, ids: tuple[int, ...], sampling: Any, start: int, end: int) -> None:
        deadline = time.monotonic() + self.room_wait_s
        with self._lock:
            while start == 0 and room not in self._followed and room not in self._lost and not self._stopped:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._lock.wait(left)
            fr = self._followed.get(room) if room not in self._lost else None
            if fr is None and room not in self._lost:
                self._lose(room, f"tp rank 0 computed it before this rank's Prefill RPC arrived (waited {self.room_wait_s} s)"
                           if start == 0 else "the room ended on this rank")
            fut: concurrent.futures.Future[None] | None = None
            if fr is not None:
                fut = fr.inflight = concurrent.futures.Future()
        pages = fr.pages if fr is not None else self.reserved_pages
        t = time.perf_counter()
        err: BaseException | None = None
        tok: SampledToken | None = None
        try:
            tok = self.engine.prefill_chunk(PrefillRequest(tuple(ids), pages, sampling), start, end)
        except Exception as exc:  # validation fails the same way on every rank
            err = exc
            log.error("tp%d: room=%d chunk [%d, %d) failed: %r", self.tp_rank, room, start, end, exc)
        finally:
            if fut is not None:
                fut.set_result(None)
        if fr is not None:
            fr.post(ChunkPost(end, tok, time.perf_counter() - t, err, self.engine.chunk_ready()))
