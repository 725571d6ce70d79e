"""One ``grpc.aio`` channel per address, reused by every call and every client.

A fresh channel per call costs a TCP (and HTTP/2) handshake each time and, at scale,
exhausts ephemeral ports; a channel multiplexes any number of concurrent calls over one
connection. Clients therefore take their channel from a :class:`ChannelPool`::

    pool = shared_pool()                    # the running event loop's pool
    stub = BootstrapServiceStub(pool.get("10.0.0.5:8998"))

``grpc.aio`` channels belong to the event loop they were created on, so
:func:`shared_pool` keeps one pool per loop (and forgets it with the loop).

A pool holds at most ``max_channels`` channels. The addresses a server dials come partly
from its callers (a decode dials every ``prefill_bootstrap_address`` it is sent, and the
workers those bootstraps list), so past the bound the least recently used channel is
closed: its calls still in flight get :data:`EVICT_GRACE_S` to finish.

A channel whose connection failed (``TRANSIENT_FAILURE``) waits out a reconnect backoff,
up to ``grpc.max_reconnect_backoff_ms``, and fails every call meanwhile, even once its
server serves again: a process restarted on its port would fail the first requests sent
to it. :meth:`ChannelPool.get` therefore hands out a fresh channel in place of one in
``TRANSIENT_FAILURE``, which connects at its first call. The old one may still carry calls
(a server that drains refuses new connections while it finishes the calls it runs), so
it is closed once they end, within :data:`REPLACED_GRACE_S`. A peer that drops connection
attempts (a host that is down) then costs each call a fresh channel's first connect
attempt, which ``grpc.min_reconnect_backoff_ms`` bounds, rather than a fast failure.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import weakref
from typing import Callable, Sequence

import grpc

from pdgrpc.rpc.limits import MAX_MESSAGE_BYTES
from pdgrpc.rpc.security import Security, current
from pdgrpc.v1 import generate_pb2

# Reconnect quickly after a peer (re)starts: the default first backoff is 1 s growing to
# 120 s, which would make a client that started before its server wait for minutes.
DEFAULT_OPTIONS: tuple[tuple[str, int | str], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    # Also the shortest connect timeout: a fresh channel to a host that drops connection
    # attempts fails its calls this soon, not after gRPC's default 20 s.
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    # Each channel its own subchannels: gRPC's process-wide subchannel pool would hand a
    # replacement channel the old one's subchannel, still waiting out its backoff.
    ("grpc.use_local_subchannel_pool", 1),
    # The servers' limit (pdgrpc.rpc.limits): batched replies are about 1 MB.
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Notice a dead peer on an idle connection.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
)

# A client of the router that rides through the router's restart (it drains, refusing new
# calls UNAVAILABLE, then a new process listens on its port): a Generate refused
# UNAVAILABLE (or CANCELLED, as the router stops) before any reply goes again with
# backoff, and a call waits for the router to accept a connection instead of failing
# while nothing listens. No reply reached the caller before such a refusal, so nothing
# is repeated; the call's deadline bounds it all. The router refuses for as long as its
# longest stream still runs: gRPC's 5 attempts, 1 s apart growing 2.5-fold (each within
# 20 %), outlast 20 s of refusals.
ROUTER_CLIENT_OPTIONS: tuple[tuple[str, int | str], ...] = DEFAULT_OPTIONS + (
    ("grpc.enable_retries", 1),
    ("grpc.service_config", json.dumps({"methodConfig": [{
        "name": [{"service": generate_pb2.DESCRIPTOR.services_by_name["GenerateService"].full_name}],
        "waitForReady": True,
        "retryPolicy": {
            "maxAttempts": 5, "initialBackoff": "1s", "maxBackoff": "20s", "backoffMultiplier": 2.5,
            # CANCELLED: a call the router took in as it stopped (a locally cancelled call
            # is never retried).
            "retryableStatusCodes": ["UNAVAILABLE", "CANCELLED"],
        },
    }]})),
)

# Channels one pool keeps (count): far above the bootstraps and workers of a large
# deployment, small enough that a caller naming new addresses cannot exhaust the process.
DEFAULT_MAX_CHANNELS = 4096
# Seconds an evicted channel's calls in flight get before it is closed under them.
EVICT_GRACE_S = 10.0
# Seconds the calls of a channel replaced after its connection failed get to finish: they
# run on a connection to a server that drains, bounded by its drain timeout and grace.
REPLACED_GRACE_S = 600.0


@dataclasses.dataclass(frozen=True)
class _Open:
    """A pool's channel to one target, and the TLS name its server must show (None: its host)."""

    channel: grpc.aio.Channel
    server_name: str | None


class ChannelPool:
    """``grpc.aio`` channels keyed by target (``host:port``), with ``security``'s
    credentials (default: the process's, :func:`pdgrpc.rpc.security.current`, read at
    each channel's creation); at most ``max_channels``, least recently used evicted.
    ``server_names``: the TLS name a target's server must show (None: its host, as
    usual), read at every :meth:`get`; a target's channel is replaced when its name
    changes."""

    def __init__(
        self, options: Sequence[tuple[str, int | str]] = DEFAULT_OPTIONS, interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
        security: Security | None = None, max_channels: int = DEFAULT_MAX_CHANNELS,
        server_names: Callable[[str], str | None] | None = None,
    ) -> None:
        if max_channels < 1:
            raise ValueError(f"max_channels must be at least 1, got {max_channels}")
        self._security = security
        self._server_names = server_names
        self._options = tuple(options)
        self._interceptors = list(interceptors)  # e.g. metrics, tracing (and tests)
        self.max_channels = max_channels
        self._channels: collections.OrderedDict[str, _Open] = collections.OrderedDict()  # least recently used first
        self._closing: dict[grpc.aio.Channel, asyncio.Task[None]] = {}  # evicted or replaced channels being closed
        self.created = 0  # channels ever created (tests and metrics)

    def get(self, target: str) -> grpc.aio.Channel:
        """The channel for ``target``: created on first use, and afresh in place of one
        whose connection failed (module doc)."""
        name = None if self._server_names is None else self._server_names(target)
        known = self._channels.get(target)
        if known is not None:
            if known.channel.get_state() != grpc.ChannelConnectivity.TRANSIENT_FAILURE and known.server_name == name:
                self._channels.move_to_end(target)
                return known.channel
            del self._channels[target]
            self._close_later(known.channel, REPLACED_GRACE_S)
        options = self._options if name is None else (*self._options, ("grpc.ssl_target_name_override", name))
        channel = (self._security or current()).channel(target, options, self._interceptors)
        self._channels[target] = _Open(channel, name)
        self.created += 1
        if len(self._channels) > self.max_channels:
            _, evicted = self._channels.popitem(last=False)
            self._close_later(evicted.channel, EVICT_GRACE_S)
        return channel

    def _close_later(self, channel: grpc.aio.Channel, grace: float) -> None:
        """Close ``channel`` once its calls in flight end, cancelling those left after ``grace`` seconds."""
        task = self._closing[channel] = asyncio.ensure_future(channel.close(grace=grace))
        task.add_done_callback(lambda _: self._closing.pop(channel, None))

    def __contains__(self, target: str) -> bool:
        return target in self._channels

    def __len__(self) -> int:
        return len(self._channels)

    async def discard(self, target: str) -> None:
        """Close and forget the channel for ``target`` (e.g. the peer moved)."""
        known = self._channels.pop(target, None)
        if known is not None:
            await known.channel.close()

    async def close(self) -> None:
        """Close every channel, evicted and replaced ones still in their grace included;
        the pool stays usable and reopens on demand."""
        channels, self._channels = [o.channel for o in self._channels.values()], collections.OrderedDict()
        closing, self._closing = self._closing, {}
        for task in closing.values():
            task.cancel()
        for channel in [*channels, *closing]:
            await channel.close()


_POOLS: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, ChannelPool]" = weakref.WeakKeyDictionary()


def shared_pool() -> ChannelPool:
    """The running event loop's process-wide pool (created on first use)."""
    loop = asyncio.get_running_loop()
    pool = _POOLS.get(loop)
    if pool is None:
        pool = _POOLS[loop] = ChannelPool()
    return pool
