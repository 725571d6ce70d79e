"""Where a prefill worker's forward pass runs: one interface, one implementation per mode.

* :class:`~pdgrpc.prefill.compute_thread.ThreadCompute` -- a thread of the worker process
  (``--compute-in thread``, TP 1);
* :class:`~pdgrpc.prefill.compute_process.ProcessCompute` -- a child process over the
  shared KV pool (``--compute-in process``, TP 1);
* :class:`~pdgrpc.prefill.compute_tp.TpLeaderCompute` / :class:`~pdgrpc.prefill.compute_tp.TpFollowerCompute`
  -- a TP group computing in lock step (tp rank 0 decides, the others follow).

The driver begins a room's compute with :meth:`Compute.begin`, reads the chunks the
compute posts (:class:`ChunkPost`, when :class:`~pdgrpc.state.chunk_posting.ChunkPosting`
says so) from the job's queue, and ends it with :meth:`Compute.finish`, which returns only
once nothing computes into the room's pages any more.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import time
from typing import Any, Awaitable, Callable, NamedTuple

from pdgrpc.engine.base import PrefillRequest, SampledToken
from pdgrpc.device import READY, ChunkReady

__all__ = ["ChunkPost", "Compute", "ComputeJob", "uncancellable"]


class ChunkPost(NamedTuple):
    """The prompt is computed up to token ``end``; ``token`` on the last chunk; ``seconds``
    of compute since the previous post; ``error`` when a chunk failed (the job stops);
    ``ready`` resolves once the device finished writing those pages (the engine's
    :meth:`~pdgrpc.engine.base.Engine.chunk_ready`; already resolved on the CPU)."""

    end: int
    token: SampledToken | None
    seconds: float
    error: BaseException | None
    ready: ChunkReady = READY


@dataclasses.dataclass(eq=False)
class ComputeJob:
    """One room's compute as the driver sees it."""

    room: int
    posts: "asyncio.Queue[ChunkPost]" = dataclasses.field(default_factory=asyncio.Queue)
    computed_all: bool = False  # every chunk was computed (set by the compute)
    # Told the sampled token as soon as its post arrives, whatever the driver awaits then
    # (set by the driver right after begin).
    first_token: Callable[[int], None] | None = None
    # When the last post reached the loop (ns since the epoch), before the token was told:
    # where the trace's compute hop ends, and the token's way begins.
    computed_ns: int = 0

    def deliver(self, item: ChunkPost) -> None:
        """On the worker's loop: hand the driver ``item``."""
        if item.token is not None:
            self.computed_ns = time.time_ns()
            if self.first_token is not None:
                told, self.first_token = self.first_token, None
                told(item.token.token_id)
        self.posts.put_nowait(item)


class Compute(abc.ABC):
    """One worker's compute. ``on_broken(why)`` (set by the worker, called on any thread)
    reports that the compute cannot serve any more (a TP collective failed, the compute
    process died): the worker then exits non-zero so its controller sees a dead rank."""

    plans_final_write = False  # the driver plans a prompt's last write while it computes
    reserved_pages: tuple[int, ...] = ()  # KV pages the compute keeps for itself (TP scratch)
    broken: str | None = None

    def __init__(self) -> None:
        self.on_broken: Callable[[str], None] = lambda why: None

    def _break(self, why: str) -> None:
        if self.broken is None:
            self.broken = why
            self.on_broken(why)

    async def start(self) -> None:
        """Called on the worker's running loop before the first :meth:`begin`."""

    @abc.abstractmethod
    def begin(self, room: int, request: PrefillRequest, start: int = 0) -> ComputeJob:
        """Start computing ``request`` (its pages are the room's) chunk by chunk from token
        ``start`` (page-aligned: the KV of the tokens before it is in the pages already, a
        cached prefix). Raises :class:`~pdgrpc.prefill.errors.RequestFailed` when it cannot
        start."""

    async def started(self, room: int) -> None:
        """Return once the group starts ``room``; the worker takes its pages only then.
        One rank: at once. A TP follower waits for tp rank 0, so that it never holds
        pages for rooms the group has not started while the group waits for one it has.
        Raises :class:`~pdgrpc.prefill.errors.RequestFailed` when the group ends the
        room first."""

    async def agree(self, room: int, cached_pages: int) -> int:
        """How many leading pages of ``room``'s prompt every rank of the compute holds
        cached (this rank holds ``cached_pages``): the compute of every rank starts
        there. Raises :class:`~pdgrpc.prefill.errors.RequestFailed` when the group
        cannot agree. One rank: its own count."""
        return cached_pages

    @abc.abstractmethod
    async def finish(self, room: int, job: ComputeJob | None) -> None:
        """The room ended (``job`` is None when :meth:`begin` was never called or failed):
        stop its compute and return once nothing writes into its pages. Completes even
        when the calling task is cancelled meanwhile."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop, after every room finished."""


async def uncancellable(waitable: "Awaitable[Any]") -> None:
    """Wait for ``waitable`` to complete, through any number of cancellations of the
    caller (compute still writing into pages must be waited for, whatever ended the
    request); an exception of ``waitable`` ends the wait."""
    fut = asyncio.ensure_future(waitable)
    while not fut.done():
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            continue
        except Exception:
            break
