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

The leader alone admits rooms: before a room's first chunk it broadcasts
``("agree", room, cached_pages)``, and only then does a follower take the room's pages
(:meth:`TpFollowerCompute.started`). A follower that took pages in its own order could
fill its pool with rooms the leader has not started while the leader starts one it has
no pages for, and the group would wait on itself.

With the prefix cache each rank matches a room's prompt against its own cache, and the
caches may differ for a moment (a rank inserts a prompt's pages when its own transfer
ends, and evicts when its own pool runs short). So when the leader holds a cached prefix
every rank contributes its own count to an all-gather after the ``agree``: the group
computes from the fewest, which every rank holds, and a rank holding more computes the
rest into its spare pages (:meth:`~pdgrpc.state.prefix_cache.PrefixCache.settle`).

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

from pdgrpc.engine.base import Engine, PrefillRequest, SampledToken
from pdgrpc.metrics import ServerAbortReason
from pdgrpc.prefill.compute import ChunkPost, Compute, ComputeJob, uncancellable
from pdgrpc.prefill.compute_thread import SHUTDOWN, ThreadCompute
from pdgrpc.prefill.errors import RequestFailed
from pdgrpc.prefill.statuses import Refusal, ending
from pdgrpc.serving.threads import lower_thread_priority

__all__ = ["TpFollowerCompute", "TpLeaderCompute", "fewest_cached", "reserve_scratch"]

log = logging.getLogger("pdgrpc.prefill.worker")


def reserve_scratch(engine: Engine) -> tuple[int, ...]:
    """Pages for one whole prompt, kept by every rank of a TP group."""
    scratch = engine.alloc_pages(engine.pages_needed(engine.max_prompt_tokens))
    if scratch is None:
        raise ValueError(f"the KV pool of {engine.num_pages} pages cannot hold the TP scratch pages for "
                         f"{engine.max_prompt_tokens} tokens")
    return tuple(scratch)


def fewest_cached(cached_pages: int) -> int:
    """Compute thread only: the fewest cached pages any rank of the group holds."""
    import torch.distributed as dist

    got: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(got, cached_pages)
    return min(int(x) for x in got)


def _resolve(fut: "asyncio.Future[Any]", value: Any = None, error: BaseException | None = None) -> None:
    """On the future's loop: settle ``fut`` unless its waiter already gave up."""
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)


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
            raise ending(Refusal.GONE, f"room {room}: {self.broken}", ServerAbortReason.PEER_FAILURE)
        t = time.perf_counter()
        self.broadcast(("chunk", room, req.token_ids, req.sampling, start, end))
        return self.engine.prefill_chunk(req, start, end), time.perf_counter() - t

    async def agree(self, room: int, cached_pages: int) -> int:
        if self.broken is not None:
            raise ending(Refusal.GONE, f"room {room}: {self.broken}", ServerAbortReason.PEER_FAILURE)
        try:
            fut = self.executor.submit(self._agree, room, cached_pages)
        except RuntimeError:  # executor shut down
            raise ending(Refusal.GONE, f"room {room}: {SHUTDOWN}") from None
        return await asyncio.wrap_future(fut)

    def _agree(self, room: int, cached_pages: int) -> int:
        """Compute thread: in the command order, so every rank agrees before the room's chunks."""
        self.broadcast(("agree", room, cached_pages))
        if cached_pages == 0:  # nothing to agree on: every rank computes the whole prompt
            return 0
        try:
            return fewest_cached(cached_pages)
        except Exception as exc:
            why = f"TP group broken: agreeing on the cached prefix failed: {exc!r}"
            log.error("tp%d: %s", self.tp_rank, why)
            self._break(why)
            raise ending(Refusal.GONE, f"room {room}: {why}", ServerAbortReason.PEER_FAILURE) from None

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
        self.loop.call_soon_threadsafe(self.deliver, item)


@dataclasses.dataclass(eq=False)
class _Waiting:
    """A follower's room waiting for its compute thread: to be started (``cached_pages``
    unused), or for the group to agree on its cached prefix."""

    cached_pages: int
    loop: asyncio.AbstractEventLoop
    result: "asyncio.Future[Any]"

    def resolve(self, value: Any = None, error: BaseException | None = None) -> None:
        self.loop.call_soon_threadsafe(_resolve, self.result, value, error)


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
        self._starting: dict[int, _Waiting] = {}  # rooms waiting for tp rank 0's ("agree", ...)
        self._agreeing: dict[int, _Waiting] = {}  # rooms started here, with their pages, for the all-gather
        self._agreed: set[int] = set()  # rooms agreed on whose begin() is still to come
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
            raise ending(Refusal.GONE, f"room {room}: {self.broken}", ServerAbortReason.PEER_FAILURE)
        with self._lock:
            why = self._lost.get(room)
            if why is None:
                job = _Followed(room, pages=tuple(request.pages), loop=asyncio.get_running_loop())
                self._followed[room] = job
                self._agreed.discard(room)
                self._lock.notify_all()
        if why is not None:
            raise ending(Refusal.ABORTED, f"room {room}: tp rank {self.tp_rank}: {why}", ServerAbortReason.PEER_FAILURE)
        return job

    async def started(self, room: int) -> None:
        """Wait for tp rank 0's ``("agree", room, ...)``."""
        await self._wait(self._starting, room, 0)

    async def agree(self, room: int, cached_pages: int) -> int:
        """Tell the compute thread, waiting since :meth:`started`, that ``room`` holds its
        pages (``cached_pages`` of them cached), and wait for the group's answer."""
        return int(await self._wait(self._agreeing, room, cached_pages))

    async def _wait(self, waiting: dict[int, _Waiting], room: int, cached_pages: int) -> Any:
        if self.broken is not None:
            raise ending(Refusal.GONE, f"room {room}: {self.broken}", ServerAbortReason.PEER_FAILURE)
        loop = asyncio.get_running_loop()
        w = _Waiting(cached_pages, loop, loop.create_future())
        with self._lock:
            why = self._lost.get(room)
            if why is None:
                waiting[room] = w
                self._lock.notify_all()
        if why is not None:
            raise ending(Refusal.ABORTED, f"room {room}: tp rank {self.tp_rank}: {why}", ServerAbortReason.PEER_FAILURE)
        return await w.result

    async def finish(self, room: int, job: ComputeJob | None) -> None:
        if not isinstance(job, _Followed):
            with self._lock:  # ended before its compute began: later commands go to scratch
                self._starting.pop(room, None)
                self._agreeing.pop(room, None)
                self._agreed.discard(room)
                self._lose(room, "the room ended on this rank")
                self._lock.notify_all()
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
                self._group_broken(f"TP group broken: receiving from tp rank 0 failed: {exc!r}")
                return
            cmd = box[0]
            if cmd[0] == "stop":
                log.info("tp%d: stop command from tp rank 0", self.tp_rank)
                return
            if cmd[0] == "end":
                self._end(cmd[1])
            elif cmd[0] == "agree":
                if not self._agree(cmd[1], cmd[2]):
                    return
            else:
                self._chunk(*cmd[1:])

    def _group_broken(self, why: str) -> None:
        """A collective failed: every room of this rank fails, and the rank with them."""
        log.error("tp%d: %s", self.tp_rank, why)
        self._break(why)
        with self._lock:
            rooms = list(self._followed.values())
            waiting = [*self._starting.items(), *self._agreeing.items()]
            self._starting.clear()
            self._agreeing.clear()
        for fr in rooms:
            fr.post(ChunkPost(0, None, 0.0, ending(Refusal.GONE, f"room {fr.room}: {why}", ServerAbortReason.PEER_FAILURE)))
        for room, w in waiting:
            w.resolve(error=ending(Refusal.GONE, f"room {room}: {why}", ServerAbortReason.PEER_FAILURE))

    def _waited(self, waiting: dict[int, _Waiting], room: int) -> _Waiting | None:
        """Under the lock: ``room``'s entry of ``waiting`` once it comes, within
        ``room_wait_s``; None when the room ended here or did not come."""
        deadline = time.monotonic() + self.room_wait_s
        while room not in waiting and room not in self._lost and not self._stopped:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._lock.wait(left)
        return waiting.pop(room, None) if room not in self._lost else None

    def _agree(self, room: int, leader_pages: int) -> bool:
        """Tp rank 0 starts ``room`` holding ``leader_pages`` cached: let the room take its
        pages here, then add this rank's count (tp rank 0's when the room is not here: it
        fails on this rank anyway) to the group's all-gather. False when the collective
        failed."""
        ag: _Waiting | None = None
        with self._lock:
            st = self._waited(self._starting, room)
            if st is not None:
                st.resolve()
                ag = self._waited(self._agreeing, room)
                if ag is None and room not in self._lost:
                    self._lose(room, f"its KV pages were not free within {self.room_wait_s} s of tp rank 0 starting it")
            elif room not in self._lost:
                self._lose(room, f"tp rank 0 started it before this rank's Prefill RPC arrived (waited {self.room_wait_s} s)")
            if ag is not None:
                self._agreed.add(room)  # its chunks wait for begin()
        try:
            fewest = fewest_cached(ag.cached_pages if ag is not None else leader_pages) if leader_pages else 0
        except Exception as exc:
            if ag is not None:
                with self._lock:
                    self._agreeing[room] = ag  # failed with the others below
            self._group_broken(f"TP group broken: agreeing on the cached prefix failed: {exc!r}")
            return False
        if ag is not None:
            ag.resolve(fewest)
        return True

    def _end(self, room: int) -> None:
        with self._lock:
            fr = self._followed.get(room)
            waiting = [w for w in (self._starting.pop(room, None), self._agreeing.pop(room, None)) if w is not None]
            self._agreed.discard(room)
            if fr is None:
                self._lose(room, "tp rank 0 ended the room")
        for w in waiting:
            w.resolve(error=ending(
                Refusal.ABORTED, f"room {room}: tp rank 0 ended the room before it was computed", ServerAbortReason.PEER_FAILURE))
        if fr is not None:
            fr.post(ChunkPost(0, None, 0.0, ending(
                Refusal.ABORTED, f"room {room}: tp rank 0 ended the room before it was computed", ServerAbortReason.PEER_FAILURE)))

    def _chunk(self, room: int, ids: tuple[int, ...], sampling: Any, start: int, end: int) -> None:
        deadline = time.monotonic() + self.room_wait_s
        with self._lock:
            first = start == 0 or room in self._agreed  # the room's first chunk: its begin() may still come
            while first and room not in self._followed and room not in self._lost and not self._stopped:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._lock.wait(left)
            self._agreed.discard(room)
            fr = self._followed.get(room) if room not in self._lost else None
            if fr is None and room not in self._lost:
                self._lose(room, f"tp rank 0 computed it before this rank's Prefill RPC arrived (waited {self.room_wait_s} s)"
                           if first else "the room ended on this rank")
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
            if fr is not None and err is None and end == len(ids):
                fr.computed_all = True  # its full pages may become cached (set before finish() can return)
            if fut is not None:
                fut.set_result(None)
        if fr is not None:
            fr.post(ChunkPost(end, tok, time.perf_counter() - t, err, self.engine.chunk_ready()))
