"""Per-client caps on open calls: no one caller holds what every caller shares.

An open ``Decode`` holds a decode slot and pages; an open ``Prefill`` holds a room on the
prefill (waiting for its handshake and pages, then computing and transferring). Without a
cap, one client -- or an attacker with a valid token -- could hold all of them (a handful
of calls can pin every page of a decode's pool). :class:`OpenCalls` counts each client's
open calls; one past the limit is refused with RESOURCE_EXHAUSTED naming the limit and
the flag that sets it. A client is who it proved to be: its mTLS certificate's name, else
its host (:func:`pdgrpc.rpc.security.peer_identity`). A router is one client, so its
limit must stay above its own requests in flight.
"""

from __future__ import annotations

import collections
import contextlib
from typing import AsyncIterator, Callable

import grpc

from pdgrpc.argtypes import whole_number
from pdgrpc.errors import PdgrpcError
from pdgrpc.rpc.security import peer_identity

__all__ = ["DEFAULT_PER_CLIENT", "OpenCalls", "TooManyOpenCalls", "limit_arg"]

DEFAULT_PER_CLIENT = 512  # open calls per client, the default of each server's flag


limit_arg = whole_number(1, "calls")  # argparse type of the per-client limit flags


class TooManyOpenCalls(PdgrpcError):
    """A client (or, for calls a server holds open, the server) is at its limit of open
    calls; the message names the limit (and its flag). Servers answer RESOURCE_EXHAUSTED."""


class OpenCalls:
    """``limit`` open ``rpc`` calls per client, set by ``flag`` (for the refusal)."""

    def __init__(self, limit: int, rpc: str, flag: str) -> None:
        if limit < 1:
            raise ValueError(f"{flag} must be at least 1, got {limit}")
        self.limit = limit
        self.rpc = rpc
        self.flag = flag
        self.open: collections.Counter[str] = collections.Counter()  # client -> calls open

    def acquire(self, client: str) -> None:
        """Count one more open call of ``client``; :class:`TooManyOpenCalls` (nothing
        counted) when it already has ``limit`` open. Each acquire is paired with one
        :meth:`release` when the call ends, however it ends."""
        if self.open[client] >= self.limit:
            raise TooManyOpenCalls(
                f"client {client} already has {self.open[client]} {self.rpc} calls open "
                f"(limit {self.limit} per client, {self.flag})"
            )
        self.open[client] += 1

    @contextlib.asynccontextmanager
    async def held(
        self, context: grpc.aio.ServicerContext, on_refused: Callable[[TooManyOpenCalls], None] | None = None,
    ) -> AsyncIterator[None]:
        """One open call of ``context``'s caller (:func:`~pdgrpc.rpc.security.peer_identity`)
        for the block. A caller at its limit is aborted RESOURCE_EXHAUSTED naming the limit,
        after ``on_refused`` (``context.abort`` raises: the block never runs)."""
        client = peer_identity(context)
        try:
            self.acquire(client)
        except TooManyOpenCalls as exc:
            if on_refused is not None:
                on_refused(exc)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            raise
        try:
            yield
        finally:
            self.release(client)

    def release(self, client: str) -> None:
        self.open[client] -= 1
        if self.open[client] <= 0:
            del self.open[client]
