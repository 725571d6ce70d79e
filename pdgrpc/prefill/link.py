"""The link between the DP controller and one of its workers: Prefill calls over a socketpair.

The controller starts each worker and hands it one end of a Unix ``socketpair`` (``--link-fd``);
every ``Prefill`` it dispatches travels that socket instead of a gRPC call to the worker's
server. Why: this hop is private to two processes of one instance, and on it a ``grpc.aio``
unary round trip costs several times what the same two protobuf messages framed on a Unix
socket cost (``python -m pdgrpc.bench link`` compares them). A request crosses it
before its compute starts, and the reply crosses it while the decode sends the first token.
The worker's KV events travel the link too, for the same reason: a prompt's batch goes
out while its compute runs. The worker still serves ``PrefillService`` (its
``SubscribeKvEvents`` included) over gRPC for anyone who calls it directly, and the
controller still reads its stats that way.

Frames (:mod:`pdgrpc.rpc.frames`), both ways:

========  ======================  ==================================================
kind      direction               payload
========  ======================  ==================================================
CALL      controller -> worker    ``PrefillRequest``
TRACED    controller -> worker    a CALL with its trace: the controller's span
                                  context (:data:`~pdgrpc.rpc.tracing.CONTEXT_BYTES`
                                  bytes, :func:`~pdgrpc.rpc.tracing.unpack`), then
                                  the ``PrefillRequest``
CANCEL    controller -> worker    empty: the caller gave up (cancel, deadline); the
                                  worker cancels the call as a cancelled RPC would
FIRST     worker -> controller    u32: the first output token, sent once it is
                                  sampled, to a call whose kind had the
                                  :data:`ASK_FIRST` bit (a CALL or TRACED for
                                  ``PrefillStream``)
REPLY     worker -> controller    ``PrefillResponse``
FAIL      worker -> controller    status code (u8, ``grpc.StatusCode`` value), then
                                  the status message in UTF-8
EVENTS    worker -> controller    call id 0: a ``KvEventBatch`` of the worker's prefix
                                  cache, each batch once, in order, from the link's
                                  first (:meth:`WorkerLinkServer.send_events`)
========  ======================  ==================================================

No deadline travels: the controller's own RPC deadline cancels its handler, which sends
CANCEL. When the socket closes, each side knows the other is gone: the controller fails
the calls in flight with :class:`~pdgrpc.prefill.errors.WorkerLinkLost` (the worker died),
the worker cancels every call it runs and stops (its controller died). A frame that breaks
these rules closes the link, logged, with the same effect.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
import time
from typing import Awaitable, Callable

from pdgrpc.prefill.errors import RequestFailed, WorkerLinkLost
from pdgrpc.prefill.statuses import Refusal, ending, from_wire
from pdgrpc.rpc import tracing
from pdgrpc.rpc.frames import Framed, frame
from pdgrpc.v1 import prefill_pb2

__all__ = ["ControllerLink", "FirstToken", "LinkPrefill", "WorkerLinkServer", "LinkCallFailed"]

log = logging.getLogger("pdgrpc.prefill.link")

CALL, CANCEL, REPLY, FAIL, TRACED, FIRST, EVENTS = 1, 2, 3, 4, 6, 7, 8
# Or'ed into a CALL's or TRACED's kind: the caller wants the first token ahead (FIRST).
ASK_FIRST = 0x10
_TOKEN = struct.Struct("<I")

# Called with the first output token as soon as it is sampled.
FirstToken = Callable[[int], None]
# What serves a call on the worker: the request, and whom to tell its first token (or None).
LinkPrefill = Callable[[prefill_pb2.PrefillRequest, "FirstToken | None"], Awaitable[prefill_pb2.PrefillResponse]]


class LinkCallFailed(RequestFailed):
    """The worker answered a call with a status (its ``RequestFailed``, carried over)."""


class ControllerLink(Framed):
    """The controller's end: :meth:`prefill` sends a call and waits for its answer;
    ``on_events`` is called with each KV event batch the worker sends (serialized
    ``KvEventBatch``), or they are dropped when it is None."""

    def __init__(self, name: str, on_events: Callable[[bytes], None] | None = None) -> None:
        super().__init__(name)
        self._on_events = on_events
        self._calls: dict[int, asyncio.Future[prefill_pb2.PrefillResponse]] = {}
        self._firsts: dict[int, FirstToken] = {}
        self._next_id = 0
        self.lost = asyncio.Event()  # set once the socket closed (the worker is gone)

    @classmethod
    async def open(cls, sock: socket.socket, name: str, on_events: Callable[[bytes], None] | None = None) -> ControllerLink:
        loop = asyncio.get_running_loop()
        _, link = await loop.connect_accepted_socket(lambda: cls(name, on_events), sock)
        return link

    @property
    def in_flight(self) -> int:
        return len(self._calls)

    async def prefill(
        self, request: prefill_pb2.PrefillRequest, trace: bytes = b"", first_token: FirstToken | None = None
    ) -> prefill_pb2.PrefillResponse:
        """The worker's answer; raises :class:`LinkCallFailed` with the worker's status, or
        :class:`WorkerLinkLost` if the link closes first. Cancelling the caller cancels the
        worker's call. ``trace``: the caller's packed span context (a TRACED frame);
        ``first_token``: called with the first output token once the worker sampled it."""
        if self._closed:
            raise WorkerLinkLost(f"the link to prefill worker {self.name} is closed")
        self._next_id += 1
        call_id = self._next_id
        fut: asyncio.Future[prefill_pb2.PrefillResponse] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        ask = 0
        if first_token is not None:
            self._firsts[call_id] = first_token
            ask = ASK_FIRST
        if trace:
            self._send(frame(TRACED | ask, call_id, trace + request.SerializeToString()))
        else:
            self._send(frame(CALL | ask, call_id, request.SerializeToString()))
        try:
            return await fut
        except asyncio.CancelledError:
            if self._calls.pop(call_id, None) is not None:
                self._send(frame(CANCEL, call_id))
            raise
        finally:
            self._calls.pop(call_id, None)
            self._firsts.pop(call_id, None)

    def _frame(self, kind: int, call_id: int, payload: bytes) -> None:
        if kind == EVENTS:
            if self._on_events is not None:
                self._on_events(payload)
            return
        if kind == FIRST:
            (token,) = _TOKEN.unpack(payload)
            told = self._firsts.pop(call_id, None)  # once per call; none for a call given up on
            if told is not None:
                told(token)
            return
        if kind not in (REPLY, FAIL):
            raise ValueError(f"kind {kind} is not one a worker sends")
        if kind == REPLY:
            answer: prefill_pb2.PrefillResponse | LinkCallFailed = prefill_pb2.PrefillResponse.FromString(payload)
        else:
            code = from_wire(payload[0] if payload else None)
            answer = LinkCallFailed(code, payload[1:].decode(errors="replace"))
        fut = self._calls.pop(call_id, None)
        if fut is None or fut.done():
            return  # an answer to a call the caller already gave up on
        if isinstance(answer, LinkCallFailed):
            fut.set_exception(answer)
        else:
            fut.set_result(answer)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        calls, self._calls = self._calls, {}
        for fut in calls.values():
            if not fut.done():
                fut.set_exception(WorkerLinkLost(f"the link to prefill worker {self.name} closed"))
        self.lost.set()


class WorkerLinkServer(Framed):
    """The worker's end: runs each call as a task of ``prefill`` and answers it."""

    def __init__(
        self,
        name: str,
        prefill: LinkPrefill,
        on_lost: Callable[[], None] = lambda: None,
    ) -> None:
        super().__init__(name)
        self._prefill = prefill
        self._on_lost = on_lost
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._accepting = True

    @classmethod
    async def open(
        cls,
        sock: socket.socket,
        name: str,
        prefill: LinkPrefill,
        on_lost: Callable[[], None] = lambda: None,
    ) -> WorkerLinkServer:
        loop = asyncio.get_running_loop()
        _, server = await loop.connect_accepted_socket(lambda: cls(name, prefill, on_lost), sock)
        return server

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    async def close(self, grace: float = 0.0, cancel: bool = True) -> None:
        """Answer new calls UNAVAILABLE from now on, let the calls in flight finish for
        ``grace`` s, then (``cancel``) cancel the rest and close the socket."""
        self._accepting = False
        if self._tasks and grace > 0:
            await asyncio.wait(list(self._tasks.values()), timeout=grace)
        if not cancel:
            return
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self.close_socket()

    def send_events(self, batch: bytes) -> None:
        """Send a serialized ``KvEventBatch`` of this worker's prefix cache (an EVENTS frame)."""
        self._send(frame(EVENTS, 0, batch))

    def _frame(self, kind: int, call_id: int, payload: bytes) -> None:
        asks, kind = bool(kind & ASK_FIRST), kind & ~ASK_FIRST
        if kind == CALL or kind == TRACED:
            trace = payload[: tracing.CONTEXT_BYTES] if kind == TRACED else b""
            request = prefill_pb2.PrefillRequest.FromString(payload[len(trace) :] if trace else payload)
            if call_id in self._tasks:
                raise ValueError(f"call id {call_id} is already in flight")
            if not self._accepting:
                self._send(_fail(call_id, ending(Refusal.GONE, f"room {request.bootstrap_room}: prefill worker {self.name} is stopping")))
                return
            self._tasks[call_id] = asyncio.ensure_future(self._serve(call_id, request, trace, time.time_ns() if trace else 0, asks))
        elif kind == CANCEL and not asks:
            task = self._tasks.get(call_id)
            if task is not None:
                task.cancel()
        else:
            raise ValueError(f"kind {kind} is not one a controller sends")

    async def _serve(
        self, call_id: int, request: prefill_pb2.PrefillRequest, trace: bytes = b"", arrived_ns: int = 0, asks: bool = False
    ) -> None:
        # Its own task: the span is the current one of everything this call runs.
        hops = tracing.serve("worker", tracing.unpack(trace), arrived_ns) if trace and tracing.enabled else None
        first: FirstToken | None = None
        if asks:
            def first(token: int) -> None:
                self._send(frame(FIRST, call_id, _TOKEN.pack(token)))
                # Linux wakes the reader of a Unix socket on the writer's core, behind it;
                # the worker goes on writing the KV, so it steps aside for the token first.
                os.sched_yield()
        try:
            resp = await self._prefill(request, first)
            self._send(frame(REPLY, call_id, resp.SerializeToString()))
        except RequestFailed as exc:
            self._send(_fail(call_id, exc))
        except asyncio.CancelledError:
            pass  # the controller cancelled it (or is gone): nobody waits for an answer
        except Exception as exc:  # prefill maps its own failures; this is a bug, answered anyway
            log.exception("%s: room=%d: the link call failed", self.name, request.bootstrap_room)
            self._send(_fail(call_id, ending(Refusal.INTERNAL, f"room {request.bootstrap_room}: prefill failed: {exc!r}")))
        finally:
            self._tasks.pop(call_id, None)
            if hops is not None:
                hops.end()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        for task in self._tasks.values():
            task.cancel()
        self._on_lost()


def _fail(call_id: int, failure: RequestFailed) -> bytes:
    return frame(FAIL, call_id, bytes([failure.code.value[0]]) + failure.message.encode())
