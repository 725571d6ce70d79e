"""Local prefill: requests whose prompt this decode computes itself
(``DecodeRequest.local_prefill``), with no prefill call and no transfer.

The router asks for it when the part of the prompt this decode's prefix cache lacks is
short, or every prefill is busy (:mod:`pdgrpc.state.local_prefill`). At admission the
request locks the longest cached run of its prompt's full pages, leaving at least the
last token to compute (its logits give the first generated token); if the cache holds
less than the router thought (a page was evicted since its events), the request still
computes here, from wherever the cache ends: the output is the same, only slower. A
refusal would cost a round trip and a second admission for a case that is rare and
never wrong.

:class:`LocalPrefills` keeps these requests from admission to their first token: it
allocates each one's pages (every page it can need, as a transferred request gets, in
arrival order: none overtakes another), and plans the chunks. Each scheduler iteration
computes at most ``chunk_tokens`` prompt tokens before its decode step
(:meth:`~pdgrpc.decode.generation.Generation.compute`), so the running streams keep their
inter-token latency while a prompt is computed. Only the scheduler's loop touches it.
"""

from __future__ import annotations

import collections
import dataclasses

from pdgrpc.decode.job import Job
from pdgrpc.decode.prefills import PrefillInfo
from pdgrpc.decode.statuses import ending
from pdgrpc.errors import RequestFailed
from pdgrpc.state import AbortReason, DecodeQueues, DpConfig
from pdgrpc.v1 import bootstrap_pb2 as bpb

__all__ = ["LocalPrefills", "NO_PREFILL"]

# The prefill of a local prefill: none. Nothing calls it (the request never handshakes).
NO_PREFILL = PrefillInfo("", bpb.ParallelInfo(dp_size=1), DpConfig())


@dataclasses.dataclass(eq=False)
class _Local:
    job: Job
    need: int  # pages still to allocate (0 once it has them)
    done: int  # prompt tokens whose KV is in its pages: the cached prefix, then each chunk
    since: float  # when it was admitted (the allocation deadline runs from it)


class LocalPrefills:
    """The local prefills of one decode, over ``queues``' page allocator; ``allocate_s``:
    how long one may wait for its pages (DEADLINE_EXCEEDED after)."""

    def __init__(self, queues: DecodeQueues, chunk_tokens: int, allocate_s: float) -> None:
        if chunk_tokens < 1:
            raise ValueError(f"--local-prefill-chunk must be >= 1, got {chunk_tokens}")
        self._queues = queues
        self.chunk_tokens = chunk_tokens
        self._allocate_s = allocate_s
        self._waiting: collections.deque[_Local] = collections.deque()  # for pages, in arrival order
        self._computing: list[_Local] = []  # with their pages, in arrival order

    @property
    def pending(self) -> bool:
        """Requests wait for pages or compute."""
        return bool(self._waiting or self._computing)

    @property
    def ready(self) -> bool:
        """A chunk can be computed now."""
        return bool(self._computing)

    @property
    def pages_wanted(self) -> int:
        """Pages the waiting requests still need (cached pages no request holds may be
        evicted for them)."""
        return sum(w.need for w in self._waiting)

    def add(self, job: Job, own_pages: int, now: float) -> None:
        """``job`` (its cached prefix locked by its lease) needs ``own_pages`` more pages."""
        cached = job.lease.cached_tokens if job.lease is not None else 0
        self._waiting.append(_Local(job, own_pages, cached, now))

    def allocate(self, now: float) -> list[tuple[Job, RequestFailed]]:
        """Give the waiting requests their pages, first come first served; those waiting
        past the deadline come back with their failure (they hold no page of their own)."""
        late: list[tuple[Job, RequestFailed]] = []
        while self._waiting:
            w = self._waiting[0]
            got = self._queues.alloc_pages(w.need)  # a call TP ranks replay
            if got is None:
                break
            self._waiting.popleft()
            w.job.pages = w.job.pages + tuple(got)
            w.need = 0
            self._computing.append(w)
        for w in [w for w in self._waiting if now - w.since > self._allocate_s]:
            self._waiting.remove(w)
            message = f"room {w.job.room}: phase waiting for free KV pages (local prefill)"
            late.append((w.job, ending(AbortReason.ALLOCATE_TIMEOUT, message)))
        return late

    def drop_ending(self) -> list[Job]:
        """Take out the requests whose end was decided (a cancel); the caller frees
        their pages and ends them."""
        out = [w.job for w in (*self._waiting, *self._computing) if w.job.fate.ending]
        if out:
            self._waiting = collections.deque(w for w in self._waiting if not w.job.fate.ending)
            self._computing = [w for w in self._computing if not w.job.fate.ending]
        return out

    def next_chunks(self) -> list[tuple[Job, int, int]]:
        """The chunks of the next step, ``(job, start, end)`` in prompt tokens: at most
        :attr:`chunk_tokens` in all, oldest request first. A request whose last chunk is
        among them leaves (its first token comes from that chunk)."""
        budget = self.chunk_tokens
        out: list[tuple[Job, int, int]] = []
        self._computing = [w for w in self._computing if not w.job.fate.ended]  # an earlier chunk failed
        for w in self._computing:
            if budget <= 0:
                break
            end = min(len(w.job.input_ids), w.done + budget)
            out.append((w.job, w.done, end))
            budget -= end - w.done
            w.done = end
        self._computing = [w for w in self._computing if w.done < len(w.job.input_ids)]
        return out
