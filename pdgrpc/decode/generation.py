"""The generation loop of the decode: first tokens, decode steps, and how a request ends
(finished or failed).

The scheduler (:class:`~pdgrpc.decode.scheduler.DecodeScheduler`) builds one
:class:`Generation` and hands it each committed request (:meth:`Generation.start`, or
:meth:`Generation.prefill_here` for fake transfers), then calls
:meth:`Generation.compute` once per loop iteration: the chunks of local prefills
(:class:`~pdgrpc.decode.local.LocalPrefills`), then one decode step. Every engine call runs on the one
compute thread, one at a time (the engine is not thread-safe).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from pdgrpc.decode.job import Job, SchedulerConfig, Tokens
from pdgrpc.decode.local import LocalPrefills
from pdgrpc.decode.rank import prefill_chunks, prefill_locally
from pdgrpc.decode.statuses import Refusal, ending
from pdgrpc.decode.tp import TpGroup, TpGroupBroken
from pdgrpc.engine.base import DecodeRequest as EngineDecodeRequest
from pdgrpc.engine.base import Engine, PrefillRequest, SampledToken, stop_reason
from pdgrpc.errors import RequestFailed
from pdgrpc.metrics import DecodeMetrics
from pdgrpc.serving.logs import request_event
from pdgrpc.serving.threads import compute_executor
from pdgrpc.state import AbortReason
from pdgrpc.state.decode_fate import Commit, Fail, Finish

log = logging.getLogger("pdgrpc.decode")

__all__ = ["Generation"]


class Generation:
    """The committed requests and the engine's steps over them. ``release_pages``: hands a
    request's pages back (whether its prompt's KV is complete, so they may be cached); ``ended``: the request sent its last
    message; ``rank_lost``: a TP collective failed (this instance cannot go on); ``local``:
    the local prefills, whose chunks each :meth:`compute` runs first."""

    def __init__(
        self,
        engine: Engine,
        tp: TpGroup | None,
        config: SchedulerConfig,
        metrics: DecodeMetrics,
        release_pages: Callable[[Job, bool], None],
        ended: Callable[[Job], None],
        rank_lost: Callable[[str], None],
        local: LocalPrefills,
    ) -> None:
        self.engine, self.tp, self.config, self.metrics = engine, tp, config, metrics
        self.local = local
        self._release_pages, self._ended, self._rank_lost = release_pages, ended, rank_lost
        self.running: list[Job] = []
        self._prefill_locally: list[Job] = []  # fake transfers: compute the prompt's KV here
        # Every engine call runs here, one at a time (the engine is not thread-safe).
        self._engine_thread = compute_executor("decode-compute", config.compute_nice)

    @property
    def busy(self) -> bool:
        """Something to compute at the next :meth:`compute`."""
        return bool(self._prefill_locally or self.running or self.local.ready)

    def start_thread(self) -> None:
        self._engine_thread.submit(lambda: None)  # the compute thread starts (and is reniced) now

    def shutdown(self) -> None:
        self._engine_thread.shutdown(wait=False)  # a step still running (TP group stuck) must not block the exit

    # -- how a request starts and ends -----------------------------------------------------
    def start(
        self, job: Job, first: SampledToken, nbytes: int, transfer_s: float, data_plane_s: float = 0.0, cached_tokens: int = 0
    ) -> None:
        """Send ``job``'s first token; it runs from the next step unless that token ended it.
        ``cached_tokens``: the prompt tokens the prefill's cache supplied (reported only)."""
        job.output_ids = [first.token_id]
        reason = stop_reason(first.token_id, 1, job.max_new_tokens, job.sampling, self.engine.tokenizer.eos_token_ids)
        job.out.put_nowait(
            Tokens((first.token_id,), (first.logprob,), reason or "", nbytes, transfer_s, _top(first), data_plane_s, cached_tokens)
        )
        if reason is not None:
            self._finish(job, reason)
        else:
            self.running.append(job)

    def prefill_here(self, job: Job) -> None:
        """Fake transfer: the next :meth:`compute` computes the prompt's KV here first."""
        self._prefill_locally.append(job)

    def fail(self, job: Job, failure: RequestFailed) -> None:
        """End ``job`` with ``failure`` (its last message); no-op once it ended."""
        if job.fate.ended:
            return
        self.metrics.on_abort(failure.reason)  # exactly once per request: its fate guards it
        job.fate.handle(Fail(failure))
        self._ended(job)
        job.out.put_nowait(failure)

    def _finish(self, job: Job, reason: str) -> None:
        self.metrics.on_finished()
        job.fate.handle(Finish())
        self._ended(job)
        self._release_pages(job, True)
        request_event(log, job.room, "finished", reason=reason, tokens=job.generated)

    def _cancelled(self, job: Job) -> None:
        self._release_pages(job, True)  # committed: its prompt's KV landed
        self.fail(job, job.fate.outcome(ending(AbortReason.CANCELLED, f"room {job.room}: cancelled")))

    def _cancelled_local(self, job: Job) -> None:
        self._release_pages(job, False)
        self.fail(job, job.fate.outcome(ending(AbortReason.CANCELLED, f"room {job.room}: cancelled")))

    def drop_cancelled(self) -> None:
        """End the running requests and local prefills that were cancelled since the last step."""
        for job in self.local.drop_ending():
            request_event(log, job.room, "cancelled during its local prefill")
            self._cancelled_local(job)
        keep = []
        for job in self.running:
            if job.fate.ending:
                request_event(log, job.room, "cancelled while generating", tokens=job.generated)
                self._cancelled(job)
            else:
                keep.append(job)
        self.running = keep

    def _crash(self, job: Job, exc: BaseException) -> None:
        self._release_pages(job, False)
        self.fail(job, ending(Refusal.INTERNAL, f"room {job.room}: engine failed: {exc}"))

    # -- compute ---------------------------------------------------------------------------
    async def compute(self) -> None:
        """Local prefills (fake transfers), then one decode step over every running request,
        in a worker thread so the loop keeps serving RPCs and transport callbacks."""
        if self.local.ready:
            await self._local_chunks()
        if self._prefill_locally:
            jobs, self._prefill_locally = self._prefill_locally, []
            firsts = await self._in_step_thread(self._prefill_jobs, jobs)
            if firsts is None:
                return
            for job, first in zip(jobs, firsts):
                if isinstance(first, BaseException):
                    self._crash(job, first)
                elif job.fate.ending:
                    self._cancelled(job)
                else:
                    self.start(job, first, 0, time.monotonic() - job.handshake_sent_at)
        batch = [j for j in self.running if not j.fate.ending]
        if not batch:
            return
        await self.await_first_tokens_sent(batch)
        batch = [j for j in batch if not j.fate.ending]
        if not batch:
            return
        reqs = [EngineDecodeRequest(j.last_token, j.position, j.pages, j.sampling) for j in batch]
        try:
            toks = await self._in_step_thread(self._decode_step, reqs)
            if toks is None:
                return
        except Exception as exc:  # an engine bug must not wedge the server: fail the batch
            log.exception("decode step over %d requests failed", len(batch))
            for job in batch:
                self._crash(job, exc)
            self.running = [j for j in self.running if not j.fate.ended]
            return
        self.metrics.on_step(len(batch))
        eos = self.engine.tokenizer.eos_token_ids
        for job, tok in zip(batch, toks):
            if job.fate.ending:
                continue  # dropped (and its pages freed) at the top of the next iteration
            job.output_ids.append(tok.token_id)
            reason = stop_reason(tok.token_id, job.generated, job.max_new_tokens, job.sampling, eos)
            job.out.put_nowait(Tokens((tok.token_id,), (tok.logprob,), reason or "", top=_top(tok)))
            if reason is not None:
                self._finish(job, reason)
        self.running = [j for j in self.running if not j.fate.ended]

    async def _local_chunks(self) -> None:
        """One step's chunks of local prefills; a request whose last chunk this was
        sends its first token and runs from the next decode step."""
        plan = self.local.next_chunks()
        results = await self._in_step_thread(self._compute_chunks, plan)
        if results is None:
            return
        for (job, start, end), res in zip(plan, results):
            if job.fate.ended:  # failed meanwhile (the server is shutting down)
                continue
            if isinstance(res, BaseException):
                log.error("room %d: local prefill of tokens [%d, %d) failed", job.room, start, end, exc_info=res)
                self._crash(job, res)
            elif res is None:
                continue  # more chunks to come (a cancel is taken before the next)
            elif job.fate.ending:
                self._cancelled_local(job)
            else:
                job.fate.handle(Commit())
                cached = job.lease.cached_tokens if job.lease is not None else 0
                self.metrics.on_local_prefill(len(job.input_ids) - cached)
                if cached:
                    self.metrics.on_reused(cached)
                request_event(log, job.room, "prefilled locally", computed=len(job.input_ids) - cached, cached=cached)
                self.start(job, res, 0, time.monotonic() - job.admitted_at, 0.0, cached)

    def _compute_chunks(self, plan: list[tuple[Job, int, int]]) -> list[SampledToken | BaseException | None]:
        chunks = [(PrefillRequest(job.input_ids, job.pages, job.sampling), start, end) for job, start, end in plan]
        if self.tp is not None:  # the other ranks compute the same chunks (the engine all-reduces)
            self.tp.broadcast(("chunks", chunks))
        return prefill_chunks(self.engine, chunks)

    async def await_first_tokens_sent(self, batch: list[Job]) -> None:
        """Hold a step that serves only requests whose first token is still being sent.

        The step's Python holds the GIL for most of a step, and gRPC needs it to send, so a
        step started right after a commit delays the first token's send. Its tokens cannot
        reach these clients before
        their first one anyway; a batch with a request already streaming does not wait (its
        next token would be late). Bounded by ``first_token_wait_s``.
        """
        wait_s = self.config.first_token_wait_s
        if wait_s <= 0 or any(j.first_sent.is_set() for j in batch):
            return
        pending = [asyncio.ensure_future(j.first_sent.wait()) for j in batch]
        try:
            await asyncio.wait(pending, timeout=wait_s)
        finally:
            for f in pending:
                f.cancel()

    async def _in_step_thread(self, fn: Any, arg: Any) -> Any:
        """Run a compute step in a worker thread; None when the TP group broke."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._engine_thread, fn, arg)
        except TpGroupBroken as exc:
            self._rank_lost(str(exc))
            return None

    def _decode_step(self, reqs: list[EngineDecodeRequest]) -> list[SampledToken]:
        if self.tp is not None:  # the other ranks run the same step (the engine all-reduces)
            self.tp.broadcast(("step", reqs))
        return self.engine.decode_step(reqs)

    def _prefill_jobs(self, jobs: list[Job]) -> list[SampledToken | BaseException]:
        reqs = [PrefillRequest(job.input_ids, job.pages, job.sampling) for job in jobs]
        if self.tp is not None:
            self.tp.broadcast(("prefill", reqs))
        return prefill_locally(self.engine, reqs)


def _top(tok: SampledToken) -> tuple[tuple[tuple[int, ...], tuple[float, ...]]]:
    return ((tuple(tok.top_ids), tuple(tok.top_logprobs)),)
