"""One ``grpc.aio`` channel per address, reused by every call and every client.

A fresh channel per call costs a TCP (and HTTP/2) handshake each time and, at scale,
exhausts ephemeral ports; a channel multiplexes any number of concurrent calls over one
connection. Clients therefore take their channel from a :class:`ChannelPool`::

    pool = shared_pool()                    # the running event loop's pool
    stub = BootstrapServiceStub(pool.get("10.0.0.5:8998"))

``grpc.aio`` channels belong to the event loop they were created on, so
:func:`shared_pool` keeps one pool per loop (and forgets it with the loop).
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Sequence

import grpc

from pdgrpc.rpc.limits import MAX_MESSAGE_BYTES
from pdgrpc.rpc.security import Security, current

# Reconnect quickly after a peer (re)starts: the default first backoff is 1 s growing to
# 120 s, which would make a client that started before its server wait for minutes.
DEFAULT_OPTIONS: tuple[tuple[str, int | str], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    # The servers' limit (pdgrpc.rpc.limits): batched replies are about 1 MB.
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Notice a dead peer on an idle connection.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
)


class ChannelPool:
    """``grpc.aio`` channels keyed by target (``host:port``), with ``security``'s
    credentials (default: the process's, :func:`pdgrpc.rpc.security.current`, read at
    each channel's creation)."""

    def __init__(
        self, options: Sequence[tuple[str, int | str]] = DEFAULT_OPTIONS, interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
        security: Security | None = None,
    ) -> None:
        self._security = security
        self._options = tuple(options)
        self._interceptors = list(interceptors)  # e.g. metrics, tracing (and tests)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.created = 0  # channels ever created (tests and metrics)

    def get(self, target: str) -> grpc.aio.Channel:
        """The channel for ``target``, created on first use."""
        channel = self._channels.get(target)
        if channel is None:
            channel = (self._security or current()).channel(target, self._options, self._interceptors)
            self._channels[target] = channel
            self.created += 1
        return channel

    def __contains__(self, target: str) -> bool:
        return target in self._channels

    def __len__(self) -> int:
        return len(self._channels)

    async def discard(self, target: str) -> None:
        """Close and forget the channel for ``target`` (e.g. the peer moved)."""
        channel = self._channels.pop(target, None)
        if channel is not None:
            await channel.close()

    async def close(self) -> None:
        """Close every channel; the pool stays usable and reopens on demand."""
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()


_POOLS: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, ChannelPool]" = weakref.WeakKeyDictionary()


def shared_pool() -> ChannelPool:
    """The running event loop's process-wide pool (created on first use)."""
    loop = asyncio.get_running_loop()
    pool = _POOLS.get(loop)
    if pool is None:
        pool = _POOLS[loop] = ChannelPool()
    return pool
