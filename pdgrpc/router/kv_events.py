"""The router's feed of the prefills' and decodes' KV events into its prefix index (``--policy cache_aware``).

One :class:`KvEventFollower` per role; one background task per instance subscribes to
its event stream (``pdgrpc.v1.PrefillService/SubscribeKvEvents`` on the address the
router sends Prefill to, a prefill's merged stream; ``DecodeService/SubscribeKvEvents``
on a decode's address, its prefix cache's) and applies each batch to the :class:`~pdgrpc.state.prefix_index.PrefixIndex`, in
sequence order (:class:`~pdgrpc.state.prefix_index.SequenceCursor`). A fresh subscription
starts with a snapshot of the instance's live blocks, so any break -- the stream ends or
fails, or a sequence number shows lost batches or a restarted publisher -- drops the
instance from the index at once (routing never trusts blocks whose removal it may have
missed) and subscribes afresh after a backoff that doubles up to :data:`BACKOFF_MAX_S`.
Instances that leave the router's list (the discovery view) are dropped and their tasks
stopped. :meth:`KvEventFollower.capabilities` is what an instance's current stream
advertised in its initial metadata (:func:`pdgrpc.serving.kv_events.capabilities`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Iterable

import grpc

from pdgrpc.metrics import RouterMetrics
from pdgrpc.rpc.channels import ChannelPool
from pdgrpc.serving.kv_events import batch_from_proto, capabilities
from pdgrpc.state.prefix_index import Batch, PrefixIndex, SequenceCursor
from pdgrpc.v1 import decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

__all__ = ["BACKOFF_MAX_S", "KvEventFollower", "SUBSCRIBE"]

log = logging.getLogger("pdgrpc.router")

BACKOFF_MIN_S = 0.2
BACKOFF_MAX_S = 5.0
REFRESH_S = 1.0  # how often the list of instances is read again

# role -> how to open its SubscribeKvEvents stream on a channel to one instance
SUBSCRIBE: dict[str, Callable[[grpc.aio.Channel], Any]] = {
    "prefill": lambda ch: prefill_pb2_grpc.PrefillServiceStub(ch).SubscribeKvEvents(prefill_pb2.SubscribeKvEventsRequest()),
    "decode": lambda ch: decode_pb2_grpc.DecodeServiceStub(ch).SubscribeKvEvents(prefill_pb2.SubscribeKvEventsRequest()),
}


class KvEventFollower:
    """Keeps ``index`` current with the events of every ``role`` instance whose address
    ``addresses()`` lists."""

    def __init__(
        self, index: PrefixIndex, addresses: Callable[[], Iterable[str]], pool: ChannelPool, metrics: RouterMetrics,
        role: str = "prefill",
    ) -> None:
        if role not in SUBSCRIBE:
            raise ValueError(f"role must be one of {', '.join(SUBSCRIBE)}, got {role!r}")
        self._role = role
        self._index = index
        self._addresses = addresses
        self._pool = pool
        self._metrics = metrics
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._capabilities: dict[str, frozenset[str]] = {}  # address -> what its open stream advertised
        self._run_task: asyncio.Task[None] | None = None

    def capabilities(self, address: str) -> frozenset[str]:
        """What ``address``'s open stream advertised; none while it has no stream."""
        return self._capabilities.get(address, frozenset())

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
            capped = False
            call: Any = None
            try:
                call = SUBSCRIBE[self._role](self._pool.get(address))
                self._capabilities[address] = capabilities(await call.initial_metadata())
                async for msg in call:
                    verdict = cursor.accept(msg.sequence_number)
                    if verdict is Batch.GAP:
                        reason = "gap"
                        log.warning("KV events of %s %s went from %s to %d; subscribing again", self._role, address, cursor.last, msg.sequence_number)
                        break
                    if verdict is Batch.APPLY:
                        if self._index.apply(address, batch_from_proto(msg).events) and not capped:
                            capped = True
                            log.warning("KV events of %s %s: more blocks than the index keeps per instance; "
                                        "the rest are not indexed", self._role, address)
                        delay = BACKOFF_MIN_S
            except grpc.RpcError as exc:
                reason = "failed"
                code = exc.code() if callable(getattr(exc, "code", None)) else None
                level = logging.INFO if delay == BACKOFF_MIN_S else logging.DEBUG  # once per outage
                log.log(level, "KV events of %s %s: %s; subscribing again", self._role, address, getattr(code, "name", exc))
            except Exception as exc:  # a batch the index cannot take, a channel not made: follow afresh, as after a gap
                reason = "failed"
                log.warning("KV events of %s %s: %r; dropping what it said and subscribing again", self._role, address, exc)
            finally:
                if call is not None:
                    call.cancel()
                self._capabilities.pop(address, None)
                self._index.cleared(address)
            self._metrics.on_kv_events_resubscribe(reason)
            await asyncio.sleep(delay)
            delay = min(delay * 2, BACKOFF_MAX_S)
