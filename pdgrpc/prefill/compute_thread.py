"""``--compute-in thread``: a worker's forward pass on one dedicated thread of its process.

The engine is not thread-safe, so one thread computes every room's chunks, first come,
first served: each chunk queues the room's next chunk itself, behind the chunks other
rooms queued meanwhile, and the loop's writes of chunk k overlap the compute of k+1.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from pdgrpc.engine.base import Engine, PrefillRequest, SampledToken
from pdgrpc.prefill.compute import ChunkPost, Compute, ComputeJob, uncancellable
from pdgrpc.prefill.errors import RequestFailed
from pdgrpc.prefill.statuses import Refusal, ending
from pdgrpc.serving.threads import compute_executor
from pdgrpc.state.chunk_posting import ChunkPosting

__all__ = ["SHUTDOWN", "ThreadCompute"]

SHUTDOWN = "prefill worker shutting down"


@dataclasses.dataclass(eq=False)
class _ThreadJob(ComputeJob):
    stopped: "asyncio.Future[None] | None" = None  # resolves once the thread is done with the pages
    closing: bool = False  # the room ended: compute no further chunk


class ThreadCompute(Compute):
    """Chunks of ``chunk_size`` tokens; a chunk is posted per :class:`ChunkPosting`
    (``min_pages`` pages worth a write, pages of ``page_size`` tokens)."""

    def __init__(self, engine: Engine, name: str, nice: int, chunk_size: int, min_pages: int) -> None:
        super().__init__()
        self.engine = engine
        self.chunk_size = chunk_size
        self.min_pages = min_pages
        self.executor = compute_executor(name, nice)

    async def start(self) -> None:
        self.executor.submit(lambda: None)  # the compute thread starts (and is reniced) now

    def compute_chunk(self, room: int, req: PrefillRequest, start: int, end: int) -> tuple[SampledToken | None, float]:
        """Compute thread: tokens ``[start, end)`` of ``req``; the token (last chunk) and seconds."""
        t = time.perf_counter()
        return self.engine.prefill_chunk(req, start, end), time.perf_counter() - t

    def begin(self, room: int, request: PrefillRequest, start: int = 0) -> ComputeJob:
        loop = asyncio.get_running_loop()
        job = _ThreadJob(room, stopped=loop.create_future())
        n = len(request.token_ids)
        rule = ChunkPosting(n, self.engine.kv_layout.page_size, self.min_pages)
        stopped = job.stopped
        assert stopped is not None

        def post(item: ChunkPost) -> None:
            loop.call_soon_threadsafe(job.deliver, item)

        def stop() -> None:
            loop.call_soon_threadsafe(lambda: None if stopped.done() else stopped.set_result(None))

        def step(begin: int) -> None:
            if job.closing:  # the request ended (abort, failure, shutdown): stop here
                return stop()
            end = min(n, begin + self.chunk_size)
            try:
                token, secs = self.compute_chunk(room, request, begin, end)
            except BaseException as exc:
                post(ChunkPost(end, None, rule.failed(), exc))
                return stop()
            if end == n:
                job.computed_all = True
            due = rule.computed(end, secs)
            if due is not None:
                post(ChunkPost(end, token, due, None, self.engine.chunk_ready()))
            if end == n:
                return stop()
            try:
                self.executor.submit(step, end)
            except RuntimeError:  # the executor is shutting down
                stop()

        try:
            self.executor.submit(step, start)
        except RuntimeError:
            stopped.set_result(None)
            raise ending(Refusal.GONE, f"room {room}: {SHUTDOWN}") from None
        return job

    async def finish(self, room: int, job: ComputeJob | None) -> None:
        if isinstance(job, _ThreadJob) and job.stopped is not None:
            job.closing = True
            await uncancellable(job.stopped)

    async def close(self) -> None:
        self.executor.shutdown(wait=True)
