"""The router's feed of the prefills' KV events into its prefix index (``--policy cache_aware``).

One background task per prefill instance subscribes to its merged event stream
(``pdgrpc.v1.PrefillService/SubscribeKvEvents`` on the address the router sends Prefill
to) and applies each batch to the :class:`~pdgrpc.state.prefix_index.PrefixIndex`, in
sequence order (:class:`~pdgrpc.state.prefix_index.SequenceCursor`). A fresh subscription
starts with a snapshot of the instance's live blocks, so any break -- the stream ends or
fails, or a sequence number shows lost batches or a restarted publisher -- drops the
instance from the index at once (routing never trusts blocks whose removal it may have
missed) and subscribes afresh after a backoff that doubles up to :data:`BACKOFF_MAX_S`.
Instances that leave the router's list (the discovery view) are dropped and their tasks
stopped.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Iterable

import grpc

from pdgrpc.metrics import RouterMetrics
from pdgrpc.rpc.channels import ChannelPool
from pdgrpc.serving.kv_events import batch_from_proto
from pdgrpc.state.prefix_index import Batch, PrefixIndex, SequenceCursor
from pdgrpc.v1 import prefill_pb2, prefill_pb2_grpc

__all__ = ["BACKOFF_MAX_S", "KvEventFollower"]

log = logging.getLogger("pdgrpc.router")

BACKOFF_MIN_S = 0.2
BACKOFF_MAX_S = 5.0
REFRESH_S = 1.0  # how often the list of instances is read again


class KvEventFollower:
    """Keeps ``index`` current with the events of every address ``addresses()`` lists."""

    def __init__(
        self, index: PrefixIndex, addresses: Callable[[], Iterable[str]], pool: ChannelPool, metrics: RouterMetrics,
    ) -> None:
        self._index = index
        self._addresses = addresses
        self._pool = pool
        self._metrics = metrics
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._run_task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._run_task = asyncio.ensure_future(self._run())

    async def close(self) -> None:
        tasks = [t for t in (self._run_task, *self._tasks.values()) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for address in self._tasks:
            self._index.cleared(address)
        self._tasks.clear()

    async def _run(self) -> None:
        while True:
            wanted = set(self._addresses())
            for address in [a for a in self._tasks if a not in wanted]:
                self._tasks.pop(address).cancel()
                self._index.cleared(address)
            for address in wanted - self._tasks.keys():
                self._tasks[address] = asyncio.ensure_future(self._follow(address))
            await asyncio.sleep(REFRESH_S)

    async def _follow(self, address: str) -> None:
        delay = BACKOFF_MIN_S
        while True:
            cursor = SequenceCursor()
            reason = "ended"
            stub = prefill_pb2_grpc.PrefillServiceStub(self._pool.get(address))
            call = stub.SubscribeKvEvents(prefill_pb2.SubscribeKvEventsRequest())
            try:
                async for msg in call:
                    verdict = cursor.accept(msg.sequence_number)
                    if verdict is Batch.GAP:
                        reason = "gap"
                        log.warning("KV events of prefill %s went from %s to %d; subscribing again", address, cursor.last, msg.sequence_number)
                        break
                    if verdict is Batch.APPLY:
                        self._index.apply(address, batch_from_proto(msg).events)
                        delay = BACKOFF_MIN_S
            except grpc.RpcError as exc:
                reason = "failed"
                code = exc.code() if callable(getattr(exc, "code", None)) else None
                level = logging.INFO if delay == BACKOFF_MIN_S else logging.DEBUG  # once per outage
                log.log(level, "KV events of prefill %s: %s; subscribing again", address, getattr(code, "name", exc))
            finally:
                call.cancel()
                self._index.cleared(address)
            self._metrics.on_kv_events_resubscribe(reason)
            await asyncio.sleep(delay)
            delay = min(delay * 2, BACKOFF_MAX_S)
