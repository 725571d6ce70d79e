"""A KV event log published in vLLM's ZMQ format, the one Dynamo, llm-d and AIBrix read.

``--kv-events-zmq tcp://HOST:PORT`` binds a PUB socket there; each batch of the
:class:`~pdgrpc.serving.kv_events.KvEventFeed` goes out as the multipart message
``(topic, sequence, payload)``: ``sequence`` an 8-byte big-endian count from 0, one more per
message, and ``payload`` vLLM's ``KVEventBatch`` in msgpack, its structs as arrays and its
events tagged by their first element::

    [ts, [event, ...]]
    ["BlockStored", [block_hash, ...], parent_block_hash | None, [token_id, ...], block_size, None, "GPU"]
    ["BlockRemoved", [block_hash, ...], "GPU"]
    ["AllBlocksCleared"]

One ``BlockStored`` carries one run of parent-linked pages, their token ids concatenated.
``--kv-events-zmq-replay tcp://HOST:PORT`` binds a ROUTER socket: a request
``(b"", start)`` (``start`` 8 bytes big-endian) is answered with every held message
numbered ``start`` or later as ``(b"", sequence, payload)``, then ``(b"", -1, b"")``.
Needs ``pip install 'pdgrpc[zmq]'`` (pyzmq, msgpack).
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import logging
from collections import deque
from typing import Any

from pdgrpc.errors import ConfigError
from pdgrpc.serving.kv_events import KvEventFeed
from pdgrpc.state.kv_event_log import Cleared, EventBatch, Removed, Stored, stored_runs

__all__ = ["REPLAY_MESSAGES", "ZmqKvPublisher", "check_zmq_args", "vllm_batch"]

log = logging.getLogger("pdgrpc.serving")

REPLAY_MESSAGES = 10_000  # messages the replay socket still answers with (vLLM's buffer_steps)
END = (-1).to_bytes(8, "big", signed=True)
MEDIUM = "GPU"  # vLLM's medium for the engine's own KV pool


def check_zmq_args(endpoint: str, replay: str) -> None:
    """Refuse ``--kv-events-zmq-replay`` without ``--kv-events-zmq``, and either without the extra."""
    if replay and not endpoint:
        raise ConfigError("--kv-events-zmq-replay needs --kv-events-zmq")
    if endpoint and not all(importlib.util.find_spec(m) for m in ("zmq", "msgpack")):
        raise ConfigError("--kv-events-zmq needs pyzmq and msgpack: pip install 'pdgrpc[zmq]'")


def vllm_batch(b: EventBatch) -> list[Any]:
    """``b`` as vLLM's ``KVEventBatch`` (see the module doc), ready for msgpack."""
    events: list[list[Any]] = []
    for e in b.events:
        if isinstance(e, Stored):
            for run in stored_runs(e.blocks):
                tokens = [t for x in run for t in x.token_ids]
                events.append(["BlockStored", [x.block_hash for x in run], run[0].parent_hash, tokens,
                               len(run[0].token_ids), None, MEDIUM])
        elif isinstance(e, Removed):
            events.append(["BlockRemoved", list(e.block_hashes), MEDIUM])
        elif isinstance(e, Cleared):
            events.append(["AllBlocksCleared"])
    return [b.timestamp, events]


class ZmqKvPublisher:
    """Publishes ``feed`` on ``endpoint`` from its first batch on, and answers replay
    requests on ``replay_endpoint`` (see the module doc). Build it on the feed's loop."""

    def __init__(self, feed: KvEventFeed, endpoint: str, replay_endpoint: str = "", topic: str = "") -> None:
        import zmq
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = self._ctx.socket(zmq.ROUTER) if replay_endpoint else None
        try:
            self._pub.bind(endpoint)
            if self._replay is not None:
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ConfigError(f"--kv-events-zmq: cannot bind {endpoint} / {replay_endpoint or '-'}: {exc}") from None
        self._topic = topic.encode()
        self._held: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_MESSAGES)
        self._numbers = itertools.count()
        self._tasks = [asyncio.ensure_future(self._publish(feed))]
        if self._replay is not None:
            self._tasks.append(asyncio.ensure_future(self._answer_replays()))

    async def _publish(self, feed: KvEventFeed) -> None:
        import msgpack

        async for batches in feed.follow(0):
            for b in batches:
                seq = next(self._numbers)
                payload = msgpack.packb(vllm_batch(b))
                self._held.append((seq, payload))
                await self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))

    async def _answer_replays(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("KV events replay: ignoring a request of %d frame(s); expected (identity, b'', start)", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._held):
                if seq >= first:
                    await self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            await self._replay.send_multipart((client, b"", END, b""))

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._close_sockets()
