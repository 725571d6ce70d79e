"""Batched room -> dp rank registration with bootstrap.

Under every method but strict ``follow_bootstrap_room`` decode must *query* a room's
prefill dp rank, so the controller registers each room before its worker starts waiting
for the handshake. One RPC per request would be a call storm at high request rates;
:class:`DpRankRegistrar` coalesces registrations that arrive within ``window_s`` into one
``RegisterDpRanks`` (at most ``max_batch`` rooms), and every caller learns the outcome of
the batch its room was in.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Awaitable, Callable, Mapping

if TYPE_CHECKING:
    from pdgrpc.metrics import PrefillMetrics

__all__ = ["DpRankRegistrar", "counted"]

RegisterFn = Callable[[Mapping[int, int]], Awaitable[object]]


class DpRankRegistrar:
    def __init__(self, register: RegisterFn, window_s: float = 0.002, max_batch: int = 4096) -> None:
        self._register = register
        self.window_s = window_s
        self.max_batch = max_batch
        self._pending: dict[int, tuple[int, asyncio.Future[None]]] = {}
        self._flusher: asyncio.Task[None] | None = None
        self.batch_sizes: list[int] = []  # sizes of the RegisterDpRanks calls made (last 1000)

    async def register(self, room: int, rank: int) -> None:
        """Return once ``room -> rank`` is registered (raises what the batch raised)."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending[room] = (rank, fut)
        if len(self._pending) >= self.max_batch:
            self._flush_now()
        elif self._flusher is None:
            self._flusher = asyncio.ensure_future(self._flush_later())
        await asyncio.shield(fut)  # a cancelled caller must not cancel the whole batch

    async def _flush_later(self) -> None:
        await asyncio.sleep(self.window_s)
        self._flusher = None
        self._flush_now()

    def _flush_now(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            self._flusher = None
        batch, self._pending = self._pending, {}
        if batch:
            asyncio.ensure_future(self._send(batch))

    async def _send(self, batch: dict[int, tuple[int, asyncio.Future[None]]]) -> None:
        self.batch_sizes = (self.batch_sizes + [len(batch)])[-1000:]
        try:
            await self._register({room: rank for room, (rank, _) in batch.items()})
        except Exception as exc:
            for _, fut in batch.values():
                if not fut.done():
                    fut.set_exception(exc)
                    fut.exception()  # the caller may be gone; don't warn about it
            return
        for _, fut in batch.values():
            if not fut.done():
                fut.set_result(None)

    async def close(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            self._flusher = None
        self._flush_now()


def counted(register: Callable[[Mapping[int, int]], Awaitable[object]], metrics: PrefillMetrics) -> Callable[[Mapping[int, int]], Awaitable[object]]:
    """``register`` (one batched RegisterDpRanks), counted by outcome and batch size."""

    async def counted_register(rooms: Mapping[int, int]) -> object:
        try:
            result = await register(rooms)
        except Exception:
            metrics.on_dp_rank_registration_failed(len(rooms))
            raise
        metrics.on_dp_rank_registration(len(rooms))
        return result

    return counted_register
