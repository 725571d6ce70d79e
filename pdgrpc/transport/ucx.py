"""A UCX worker driven from an asyncio loop, with scatter/gather tag messages.

Why not ucxx's own asyncio layer: it keeps one process-wide context whose progress
tasks outlive ``ucxx.reset()`` and are bound to the first event loop, and its requests
are awaited by spinning ``asyncio.sleep(0)`` per request, which costs one loop round
per pending request (256 concurrent rooms would spin 256 coroutines). It also has no
scatter/gather: a scattered page list would need one tag message per page, each with
its own rendezvous, where one IOV message carries them all.

So this module takes only the UCX libraries from the ucxx distribution (the
``libucx`` wheel's loader, which honours ``RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY``) and
calls UCX's C API with :mod:`ctypes`: context and worker, progress / arm / epoll fd,
endpoints from worker addresses (non-blocking ``ucp_ep_close_nbx``: ucxx's close waits
for a hung peer forever), tag sends and receives (``ucp_dt_make_iov()`` for several
pieces). It loads nothing but UCX itself (no C++ runtime, no second wrapper).

A receive's iov entries point straight into the destination tensors, so payload lands
where it belongs with no copy made by pdgrpc (UCX itself moves sub-8 KiB messages
through its shared-memory eager buffers and zero-copies larger ones with cma).

Progress ("blocking" mode, driven by the loop): one task per worker calls
``worker.progress()``, yielding to the loop between rounds, while progress finds work;
then it arms the worker and sleeps on UCX's epoll file descriptor. An idle worker (no
send or data receive pending) sleeps on the fd alone, with no timer: on a small host
every wake-up costs CPU taken from the compute. While a transfer is pending a bounded
safety timeout backs the fd up, long enough that a receive posted ahead of the sender's
compute sleeps through most of it. While a large send batch is being
read it polls once per loop tick instead, unarmed, so the receiver need not wake it per
message (:mod:`pdgrpc.transport.ucx_quiet`). Optionally (``spin_s`` > 0) it busy-polls
up to ``spin_s`` after the last completion while a send or data receive is pending. The
default is no spin: on a small host a spin starves the peer that has the real work.
Completions are recorded by a C callback and handed
to Python callbacks after ``progress()`` returns, never from inside UCX.

Every request is posted with ``UCP_OP_ATTR_FLAG_NO_IMM_CMPL`` so it always completes
through that one path, and can be cancelled (``ucp_request_cancel``) until it does.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import time
from typing import Any, Callable, Sequence

from pdgrpc.errors import TransportUnavailable
from pdgrpc.transport.ucx_api import (
    EP_CLOSE_FLAG_FORCE, EP_PARAM_FIELD_ERR_HANDLING_MODE,
    EP_PARAM_FIELD_REMOTE_ADDRESS, ERR_HANDLING_MODE_NONE, OP_ATTR_FIELD_CALLBACK, OP_ATTR_FIELD_DATATYPE,
    OP_ATTR_FIELD_FLAGS, OP_ATTR_FIELD_USER_DATA, OP_ATTR_FLAG_NO_IMM_CMPL, PARKED, RECV_CB, SEND_CB,
    FULL_MASK, INSTALL_HINT, UCS_ERR_CANCELED, UCS_ERR_MESSAGE_TRUNCATED, UCS_INPROGRESS, UCS_OK, Completion,
    Api, Pieces, UcxError, check, create_worker, destroy_worker, EpParams, Param, status_of, TagRecvInfo, api,
    destroy_off_loop, message_buffer,
)
from pdgrpc.transport.ucx_batch import Batch, BatchCompletion
from pdgrpc.transport.ucx_quiet import TICK_S as QUIET_TICK_S, QuietSends
from pdgrpc.transport.rooms import after_acks

__all__ = [
    "BatchCompletion", "FULL_MASK", "INSTALL_HINT", "UCS_ERR_CANCELED", "UCS_ERR_MESSAGE_TRUNCATED", "UCS_OK", "Completion", "Pieces",
    "UcxError", "UcxWorker", "api",
]

log = logging.getLogger("pdgrpc.transport.rdma")

_PENDING_TIMEOUT_S = 0.5  # the safety timer while a transfer is pending


class UcxWorker:
    """One UCX context + worker, progressed by a task on the running loop.

    Buffers are given as ``(address, nbytes)`` pieces; the caller keeps the memory
    alive (``keep``) until the completion callback ran — this class holds ``keep``
    for exactly that long.
    """

    def __init__(self, *, spin_s: float = 0.0, quiet_sends: bool = True,
                 functions: Api | None = None, on_progress: Callable[[], None] | None = None) -> None:
        self._api = functions if functions is not None else api()  # the libucp calls (tests count them)
        self._context: int | None
        self._worker: int | None
        self._context, self._worker = create_worker(self._api)
        try:
            fd = ctypes.c_int(-1)
            check(self._api.worker_get_efd(self._worker, ctypes.byref(fd)), "ucp_worker_get_efd")
            self._fd: int = fd.value
            addr, n = ctypes.c_void_p(), ctypes.c_size_t()
            check(self._api.worker_get_address(self._worker, ctypes.byref(addr), ctypes.byref(n)), "ucp_worker_get_address")
            self.address: bytes = ctypes.string_at(addr.value or 0, n.value)
            self._api.worker_release_address(self._worker, addr)
        except TransportUnavailable:
            destroy_worker(self._api, self._context, self._worker)
            raise
        self.handle: int = self._worker  # type: ignore[assignment]  # set just above
        self._spin_s = spin_s
        self._on_progress = on_progress  # called after each progress round in which UCX did something
        self._quiet = QuietSends() if quiet_sends else None  # see pdgrpc.transport.ucx_quiet
        self._receiving: set[int] = set()  # tokens of data receives (not background ones) in flight
        # token -> (request pointer, callback, keepalive)
        self._inflight: dict[int, tuple[int, Completion, Any]] = {}
        self._next_token = 1
        self._done: list[tuple[int, int, int, int]] = []  # (token, status, length, tag)
        self._send_cb = SEND_CB(self._on_send)
        self._recv_cb = RECV_CB(self._on_recv)
        self._send_cb_ptr = ctypes.cast(self._send_cb, ctypes.c_void_p).value
        self._recv_cb_ptr = ctypes.cast(self._recv_cb, ctypes.c_void_p).value
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Future[None] | None = None
        self._reader_on = False
        self._last_activity = 0.0
        self._closed = False
        self._endpoints: list[int] = []
        self._closing: set[int] = set()  # tokens of endpoint-close requests
        self._background: set[int] = set()  # always-posted receives: never a reason to spin
        self._abandoned: dict[int, tuple[int, Completion, Any]] = {}
        self._batches: dict[int, Batch] = {}  # token -> batch, until every request of it is complete
        self._polling: dict[int, Batch] = {}  # batches whose last request completed before the others
        self._settled: list[Batch] = []  # batches over, whose requests are freed after the ACKs (_release_settled)
        self._batch_param = ctypes.pointer(Param())  # reused by every batch's posts
        self._test_info = TagRecvInfo()

    # -- lifecycle ------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._loop = asyncio.get_running_loop()
            self._task = self._loop.create_task(self._progress_loop(), name="pdgrpc-ucx-progress")

    @property
    def quiet(self) -> QuietSends | None:
        """The quiet window of this worker's send batches (None with ``quiet_sends`` off)."""
        return self._quiet

    def batch_requests(self, token: int) -> list[int]:
        """The UCX requests of batch ``token`` not freed yet (a diagnostic)."""
        batch = self._batches.get(token)
        return [] if batch is None else [p for p in batch.ptrs if p is not None]

    @property
    def inflight(self) -> int:
        """Everything UCX still owes a completion for (requests, batches and endpoint
        closes)."""
        return len(self._inflight) + len(self._polling)

    @property
    def inflight_requests(self) -> int:
        """Tag sends and receives in flight, a batch counted once (endpoint closes not
        counted)."""
        return len(self._inflight) + len(self._polling) - len(self._closing)

    async def close(self, timeout: float = 5.0, destroy_timeout: float = 5.0) -> None:
        """Cancel everything in flight, wait (bounded) for the cancellations, stop the
        progress task, close endpoints and release the worker. ``timeout`` is generous:
        a send to a live but busy peer completes only when that peer progresses, and a
        worker closed before its sends end stays parked with its fds."""
        if self._closed:
            return
        for token in [*self._inflight, *self._polling, *self._abandoned]:
            if token not in self._closing:
                self.cancel(token)
        for ep in list(self._endpoints):
            self.drop_endpoint(ep)
        deadline = time.monotonic() + timeout
        while (self._inflight or self._abandoned or self._polling) and time.monotonic() < deadline:
            self._progress_once()
            if self._inflight or self._abandoned or self._polling:
                await asyncio.sleep(0.001)
        self._closed = True
        self._release_settled()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        self._set_reader(False)
        if self._closing or self._abandoned or self._inflight or self._polling:
            # UCX still owes completions (an endpoint close a hung peer never
            # confirms, a rendezvous send it never answered). Destroying the worker
            # now can block inside UCX waiting for them, so it is parked instead: a
            # bounded leak (one worker and its buffers) in a pathological case,
            # never a hung event loop.
            logging.getLogger("pdgrpc.transport.rdma").warning(
                "UCX worker parked at close: %d endpoint closes and %d requests still pending",
                len(self._closing), len(self._inflight) + len(self._abandoned) + len(self._polling) - len(self._closing))
            PARKED.append((self._worker, self._context, self._inflight, self._abandoned, self._batches, self._send_cb,
                            self._recv_cb))
            self._worker = self._context = None
            return
        context, worker = self._context, self._worker
        self._worker = self._context = None
        await destroy_off_loop(self._api, context, worker, destroy_timeout)

    # -- endpoints ------------------------------------------------------------------
    def endpoint(self, address: bytes) -> int:
        """An endpoint (``ucp_ep_h``) to the worker at ``address``, error handling off
        (the fast shared-memory path; the liveness side channel notices a dead peer).
        Not ucxx's ``UCXEndpoint``, whose close waits for a hung peer forever."""
        if self._closed or self._worker is None:
            raise UcxError("UCX worker is closed")
        raw = ctypes.create_string_buffer(bytes(address), len(address))
        params = EpParams()
        params.field_mask = EP_PARAM_FIELD_REMOTE_ADDRESS | EP_PARAM_FIELD_ERR_HANDLING_MODE
        params.address = ctypes.addressof(raw)
        params.err_mode = ERR_HANDLING_MODE_NONE
        ep = ctypes.c_void_p()
        status = self._api.ep_create(self.handle, ctypes.byref(params), ctypes.byref(ep))
        if status != UCS_OK or not ep.value:
            raise UcxError(f"cannot create a UCX endpoint to the peer's worker address (status {status})", status)
        self._endpoints.append(ep.value)
        self.kick()
        return ep.value

    def drop_endpoint(self, ep: int | None, *, force: bool = False) -> None:
        """Start closing ``ep``, non-blocking. ``force``: for a peer declared dead or
        hung — UCX completes every request still pending on the endpoint with
        UCS_ERR_CANCELED (the only way to cancel a rendezvous send whose receiver
        stopped answering) and releases it without asking the peer. Otherwise flush
        mode; a flush that a hung peer never confirms is abandoned when the worker is
        destroyed."""
        if ep is None or ep not in self._endpoints or self._worker is None:
            return
        self._endpoints.remove(ep)
        if self._quiet is not None:
            self._quiet.forget(ep)
        token = self._next_token
        self._next_token += 1
        param = Param()
        param.op_attr_mask = OP_ATTR_FIELD_CALLBACK | OP_ATTR_FIELD_USER_DATA | OP_ATTR_FIELD_FLAGS
        param.flags = EP_CLOSE_FLAG_FORCE if force else 0
        param.user_data = token
        param.cb = self._send_cb_ptr
        ptr = self._api.ep_close_nbx(ep, ctypes.byref(param))
        if status_of(ptr) == UCS_INPROGRESS and ptr is not None:
            self._inflight[token] = (ptr, lambda status, length, tag: None, None)
            self._closing.add(token)
        self.kick()

    # -- messages -------------------------------------------------------------------
    def send(self, ep: int, pieces: Pieces, tag: int, cb: Completion, keep: Any) -> int:
        """Post a tag send of ``pieces`` (one message) on endpoint ``ep``; returns a
        token for cancel()."""
        if ep not in self._endpoints:
            raise UcxError("UCX endpoint is closed")
        return self._post(True, ep, pieces, tag, FULL_MASK, cb, keep)

    def recv(self, pieces: Pieces, tag: int, mask: int, cb: Completion, keep: Any, *,
             background: bool = False) -> int:
        """Post a tag receive into ``pieces`` on the worker (any sender). ``background``:
        kept posted for whatever comes (control messages): never a reason to spin."""
        token = self._post(False, self.handle, pieces, tag, mask, cb, keep)
        (self._background if background else self._receiving).add(token)
        return token

    def send_batch(self, ep: int, runs: Sequence[Sequence[int]], tags: list[int], cb: BatchCompletion,
                   keep: Any) -> int:
        """One tag send per ``(address, nbytes)`` run, run ``i`` tagged ``tags[i]``, as one
        batch (:mod:`pdgrpc.transport.ucx_batch`): ``cb`` runs once, with every message's
        ``(status, 0)``. Returns one token for cancel()."""
        if ep not in self._endpoints:
            raise UcxError("UCX endpoint is closed")
        token = self._post_batch(True, ep, runs, tags, cb, keep)
        if self._quiet is not None:
            self._quiet.posted(token, ep, sum(n for _, n in runs), time.monotonic())
        return token

    def recv_batch(self, runs: Sequence[Sequence[int]], tags: list[int], cb: BatchCompletion, keep: Any) -> int:
        """:meth:`send_batch` for receives (exact tags); lengths are the received ones."""
        token = self._post_batch(False, self.handle, runs, tags, cb, keep)
        self._receiving.add(token)
        return token

    def _post_batch(self, is_send: bool, target: int, runs: Sequence[Sequence[int]], tags: list[int],
                    cb: BatchCompletion, keep: Any) -> int:
        if self._closed or self._worker is None:
            raise UcxError("UCX worker is closed")
        if not runs or len(runs) != len(tags):
            raise ValueError("a batch needs one tag per run, and at least one run")
        token = self._next_token
        self._next_token += 1
        batch = Batch(not is_send, cb, keep)
        status = batch.post(self._api, target, runs, tags, FULL_MASK, self._batch_param, token,
                            self._send_cb_ptr if is_send else self._recv_cb_ptr)
        if status != UCS_INPROGRESS:
            # Those already posted are cancelled where UCX can (receives) and freed once
            # complete; nobody is called back for them.
            batch.abandoned = True
            self._batches[token] = self._polling[token] = batch
            self.cancel(token)
            raise UcxError(f"UCX {'send' if is_send else 'receive'} failed with status {status}", status)
        ptr = batch.ptrs[-1]
        assert ptr is not None
        self._batches[token] = batch
        self._inflight[token] = (ptr, functools.partial(self._on_batch_last, token), keep)
        self.kick()
        return token

    def _on_batch_last(self, token: int, status: int, length: int, _tag: int) -> None:
        batch = self._batches.get(token)
        if batch is not None:
            batch.done(len(batch.ptrs) - 1, status, length)
            self._settle(token, batch)

    def _settle(self, token: int, batch: Batch) -> bool:
        """Test the batch's other requests; once all are complete, forget it and call its
        owner back (unless abandoned). True when it is over."""
        if not batch.settle(self._api, self._test_info):
            self._polling[token] = batch
            return False
        self._polling.pop(token, None)
        self._batches.pop(token, None)
        self._receiving.discard(token)
        if self._quiet is not None and not batch.recv:
            self._quiet.finished(token, not batch.abandoned and all(st == UCS_OK for st, _ in batch.results),
                                 time.monotonic())
        if not batch.abandoned:
            try:
                batch.cb(batch.results)
            except Exception:  # a callback bug must not stop progress for everyone
                log.exception("batch completion callback failed")
        self._settled.append(batch)
        if len(self._settled) == 1:
            after_acks(self._release_settled)
        return True

    def _release_settled(self) -> None:
        """Free the requests of the batches settled since the last call: after the ACKs
        their completions led to (:func:`~pdgrpc.transport.rooms.after_acks`), which
        these ~50 ctypes calls would otherwise delay."""
        if self._worker is not None:  # a parked worker keeps them
            for batch in self._settled:
                batch.release(self._api)
        self._settled.clear()

    def probe(self, tag: int, mask: int) -> int | None:
        """The sender tag of the first unexpected message matching ``tag``/``mask`` (left
        in the queue), or None."""
        found = self._worker is not None and self._api.tag_probe_nb(self.handle, tag, mask, 0, self._test_info)
        return int(self._test_info.sender_tag) if found else None

    def cancel(self, token: int) -> None:
        """Cancel a pending request (or every pending request of a batch); its callback
        then runs with UCS_ERR_CANCELED (or UCS_OK if it had already completed)."""
        batch = self._batches.get(token) if self._worker is not None else None
        if batch is not None:
            for ptr in batch.pending():
                self._api.request_cancel(self.handle, ptr)
            self.kick()
            return
        entry = self._inflight.get(token) or self._abandoned.get(token)
        if entry is not None and self._worker is not None:
            self._api.request_cancel(self.handle, entry[0])
            self.kick()

    def abandon(self, token: int) -> None:
        """Stop waiting for a request UCX cannot cancel (with error handling off, a
        rendezvous send to a hung peer stays pending even after a forced endpoint close,
        and so does a receive matched to a message its sender died sending). Its
        callback is never run; if UCX ever completes it, the request is freed then, and
        its buffers stay referenced until that or :meth:`close`."""
        entry = self._inflight.pop(token, None)
        self._receiving.discard(token)
        if entry is not None:
            self._abandoned[token] = entry
        if (batch := self._batches.get(token)) is not None:
            batch.abandoned = True
            if self._quiet is not None and not batch.recv:  # nothing to wait quietly for
                self._quiet.finished(token, False, time.monotonic())

    def _post(self, is_send: bool, target: int, pieces: Pieces, tag: int, mask: int,
              cb: Completion, keep: Any) -> int:
        if self._closed or self._worker is None:
            raise UcxError("UCX worker is closed")
        token = self._next_token
        self._next_token += 1
        param = Param()
        param.op_attr_mask = OP_ATTR_FIELD_CALLBACK | OP_ATTR_FIELD_USER_DATA | OP_ATTR_FIELD_DATATYPE \
            | OP_ATTR_FLAG_NO_IMM_CMPL
        param.user_data = token
        param.datatype, buf, count, iov = message_buffer(pieces)
        if is_send:
            param.cb = self._send_cb_ptr
            ptr = self._api.tag_send_nbx(target, buf, count, tag, ctypes.byref(param))
        else:
            param.cb = self._recv_cb_ptr
            ptr = self._api.tag_recv_nbx(target, buf, count, tag, mask, ctypes.byref(param))
        status = status_of(ptr)
        if status != UCS_INPROGRESS:
            # NO_IMM_CMPL: anything but a request pointer is an error.
            raise UcxError(f"UCX {'send' if is_send else 'receive'} failed with status {status}", status)
        assert ptr is not None
        self._inflight[token] = (ptr, cb, (keep, iov))
        self.kick()
        return token

    # C callbacks: record only; Python callbacks run from _dispatch, outside UCX.
    def _on_send(self, request: int, status: int, user_data: int) -> None:
        self._done.append((user_data or 0, status, 0, 0))

    def _on_recv(self, request: int, status: int, info: Any, user_data: int) -> None:
        length = tag = 0
        if status == UCS_OK and info:
            length, tag = info.contents.length, info.contents.sender_tag
        self._done.append((user_data or 0, status, length, tag))

    def _dispatch(self) -> bool:
        settled = False
        if self._polling:
            for token, batch in list(self._polling.items()):
                settled |= self._settle(token, batch)
        if not self._done:
            return settled
        done, self._done = self._done, []
        for token, status, length, tag in done:
            entry = self._inflight.pop(token, None)
            self._closing.discard(token)
            self._background.discard(token)
            if token not in self._batches:  # a batch is receiving until all its requests are settled
                self._receiving.discard(token)
            if entry is None:
                gone = self._abandoned.pop(token, None)
                if gone is not None:
                    self._api.request_free(gone[0])
                    left = self._batches.get(token)
                    if left is not None:  # abandoned: free the rest once complete, call nobody
                        left.done(len(left.ptrs) - 1, status, length)
                        self._settle(token, left)
                continue
            ptr, cb, _keep = entry
            self._api.request_free(ptr)
            try:
                cb(status, length, tag)
            except Exception:  # a callback bug must not stop progress for everyone
                log.exception("completion callback failed")
        return True

    # -- progress -------------------------------------------------------------------
    def kick(self) -> None:
        """Make the progress task run a round soon (new work was posted)."""
        self._last_activity = time.monotonic()
        w = self._wake
        if w is not None and not w.done():
            w.set_result(None)

    def _on_timer(self) -> None:
        # Safety net against a missed wakeup while a transfer is pending; not counted as
        # activity, so the worker goes straight back to sleep after one progress round.
        w = self._wake
        if w is not None and not w.done():
            w.set_result(None)

    def _progress_once(self) -> bool:
        if self._worker is None:
            return False
        # Completions are handed over after each progress call that made some: a row
        # that came with a write's data is then handled before the data's copies flush
        # the caches, not after them.
        progress, worker, dispatched, moved = self._api.worker_progress, self._worker, False, False
        while progress(worker):
            moved = True
            if self._done:
                dispatched |= self._dispatch()
                if self._worker is None:
                    return dispatched
        if moved and self._on_progress is not None:
            self._on_progress()
        return self._dispatch() or dispatched

    def _busy(self) -> bool:
        """A transfer is pending: a send or data receive (not an always-posted
        control receive, not an endpoint close)."""
        return len(self._inflight) + len(self._polling) > len(self._closing) + len(self._background)

    def _set_reader(self, on: bool) -> None:
        if self._loop is None or on == self._reader_on:
            return
        if on:
            self._loop.add_reader(self._fd, self.kick)
        else:
            self._loop.remove_reader(self._fd)
        self._reader_on = on

    async def _sleep(self, timeout: float | None, *, armed: bool) -> None:
        """Until ``timeout`` (None: no timer), kick(), or (``armed``) UCX's epoll fd fires."""
        assert self._loop is not None
        fut: asyncio.Future[None] = self._loop.create_future()
        self._wake = fut
        self._set_reader(armed)
        timer = self._loop.call_later(timeout, self._on_timer) if timeout is not None else None
        try:
            await fut
        finally:
            if timer is not None:
                timer.cancel()
            self._wake = None
            self._set_reader(False)

    async def _progress_loop(self) -> None:
        while not self._closed:
            if self._progress_once():
                self._last_activity = time.monotonic()
            elif self._worker is not None and (
                    not self._busy() or time.monotonic() - self._last_activity > self._spin_s):
                if self._quiet is not None and not self._receiving and self._quiet.quiet(time.monotonic()):
                    # a large send batch is being read: poll next tick, unarmed (ucx_quiet)
                    await self._sleep(QUIET_TICK_S, armed=False)
                    continue
                # Arm the worker and sleep until its epoll fd fires (or kick()); with a
                # transfer pending, at most the safety timeout. arm() is not UCS_OK
                # when events are pending, in which case we progress again.
                if self._api.worker_arm(self._worker) == UCS_OK:  # else UCS_ERR_BUSY: events pending
                    await self._sleep(_PENDING_TIMEOUT_S if self._busy() else None, armed=True)
                    continue
            await asyncio.sleep(0)
