"""A UCX worker driven from an asyncio loop, with scatter/gather tag messages.

Why not ucxx's own asyncio layer: it keeps one process-wide context whose progress
tasks outlive ``ucxx.reset()`` and are bound to the first event loop, and its requests
are awaited by spinning ``asyncio.sleep(0)`` per request, which costs one loop round
per pending request (256 concurrent rooms would spin 256 coroutines). It also has no
scatter/gather: a scattered page list would need one tag message per page, and
measured here that is 0.25–0.9 GB/s against ~10 GB/s for one IOV message.

So this module takes only the UCX libraries from the ucxx distribution (the
``libucx`` wheel's loader, which also honours ``RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY``)
and does everything through UCX's C API, called with :mod:`ctypes` on that
``libucp``: context and worker (``ucp_init_version`` / ``ucp_worker_create``, the
worker address, ``ucp_worker_progress`` / ``ucp_worker_arm`` / its epoll fd), endpoints
from worker addresses (``ucp_ep_create`` / non-blocking ``ucp_ep_close_nbx``; ucxx's
endpoint close progresses until the peer confirms, which never ends when the peer is
hung) and tag sends and receives (``ucp_tag_send_nbx`` / ``ucp_tag_recv_nbx``),
with ``ucp_dt_make_iov()`` when a message has several pieces. It used to create the
context and worker through ucxx's Cython module (``ucxx._lib.libucxx``); a prefill
worker that imported it measured ~20% more CPU per prompt, but a later standalone check
(the reference prefill in a thread, with and without the module) showed no difference:
that spread was most likely glibc malloc's, see :mod:`pdgrpc.engine.malloc`. The C API
path stays because it loads nothing but UCX itself (no C++ runtime, no second worker
wrapper to keep in step).

A receive's iov entries point straight into the destination tensors, so payload lands
where it belongs with no copy made by pdgrpc (UCX itself moves sub-8 KiB messages
through its shared-memory eager buffers and zero-copies larger ones with cma).

Progress ("blocking" mode, driven by the loop): one task per worker calls
``worker.progress()``, yielding to the loop between rounds, for as long as progress
keeps finding work; once a round finds nothing it arms the worker and sleeps on UCX's
epoll file descriptor (with a bounded safety timeout), so an idle transport costs ~no
CPU. Optionally (``spin_s`` > 0) it keeps busy-polling up to ``spin_s`` after the last
completion, but only while a send or data receive is pending — never because of the
always-posted control receives. The default is no spin, measured here on 2 cores: a
50 ms spin after *every* completion (the earlier default) made both processes of a
transfer burn a core each between steps, which on a 2-core host starved the peer
that had the real work (the receiver doing UCX's cma copies) and the prefill's
compute thread: 8k scattered pages took 430 ms with it and 21 ms without; e2e TTFT
overhead went from +51..62 ms to ~+12 ms. Spinning only while a transfer is pending
measured the same as no spin for the transfer bench, so it stays available as an
option for hosts with cores to spare. Completions are recorded
by a C callback and handed to Python callbacks after ``progress()`` returns, never from
inside UCX.

Every request is posted with ``UCP_OP_ATTR_FLAG_NO_IMM_CMPL`` so it always completes
through that one path, and can be cancelled (``ucp_request_cancel``) until it does.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import threading
import time
from typing import Any, Callable, Sequence, Union

import numpy as np

from pdgrpc.errors import TransportError, TransportUnavailable

INSTALL_HINT = "pip install 'pdgrpc[ucx]'"

UCS_OK = 0
UCS_INPROGRESS = 1
UCS_ERR_MESSAGE_TRUNCATED = -9
UCS_ERR_CANCELED = -16
_ERR_LAST = -100
_OP_ATTR_FIELD_CALLBACK = 1 << 1
_OP_ATTR_FIELD_USER_DATA = 1 << 2
_OP_ATTR_FIELD_DATATYPE = 1 << 3
_OP_ATTR_FIELD_FLAGS = 1 << 4
_EP_CLOSE_FLAG_FORCE = 1 << 0
_OP_ATTR_FLAG_NO_IMM_CMPL = 1 << 16
_DATATYPE_IOV = 2  # ucp_dt_make_iov()
_DATATYPE_CONTIG_BYTES = (1 << 3) | 0  # ucp_dt_make_contig(1)
FULL_MASK = (1 << 64) - 1

# (status, received length, sender tag) -> None; length/tag are 0 for sends.
Completion = Callable[[int, int, int], None]
# A message's memory: (address, nbytes) pieces, or an (n, 2) uint64 array of them.
Pieces = Union[Sequence[tuple[int, int]], "np.ndarray[Any, Any]"]


class UcxError(TransportError):
    """A UCX call failed (mapped into pdgrpc's tree; carries the UCX status)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class _Param(ctypes.Structure):
    # ucp_request_param_t (ucp.h, UCX >= 1.10); layout checked against the 1.21 header.
    _fields_ = [
        ("op_attr_mask", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("request", ctypes.c_void_p),
        ("cb", ctypes.c_void_p),
        ("datatype", ctypes.c_uint64),
        ("user_data", ctypes.c_void_p),
        ("reply_buffer", ctypes.c_void_p),
        ("memory_type", ctypes.c_int),
        ("recv_info", ctypes.c_void_p),
        ("memh", ctypes.c_void_p),
    ]


class _SockAddr(ctypes.Structure):
    _fields_ = [("addr", ctypes.c_void_p), ("addrlen", ctypes.c_uint32)]


class _EpParams(ctypes.Structure):
    # ucp_ep_params_t (ucp_def.h, UCX 1.21)
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("address", ctypes.c_void_p),
        ("err_mode", ctypes.c_int),
        ("err_handler_cb", ctypes.c_void_p),
        ("err_handler_arg", ctypes.c_void_p),
        ("user_data", ctypes.c_void_p),
        ("flags", ctypes.c_uint),
        ("sockaddr", _SockAddr),
        ("conn_request", ctypes.c_void_p),
        ("name", ctypes.c_char_p),
        ("local_sockaddr", _SockAddr),
    ]


_EP_PARAM_FIELD_REMOTE_ADDRESS = 1 << 0
_EP_PARAM_FIELD_ERR_HANDLING_MODE = 1 << 1
_ERR_HANDLING_MODE_NONE = 0


class _Iov(ctypes.Structure):
    _fields_ = [("buffer", ctypes.c_void_p), ("length", ctypes.c_size_t)]


class _TagRecvInfo(ctypes.Structure):
    _fields_ = [("sender_tag", ctypes.c_uint64), ("length", ctypes.c_size_t)]


_SEND_CB = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p)
_RECV_CB = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(_TagRecvInfo), ctypes.c_void_p)


class _Api:
    """The libucp functions this module calls."""

    # set from libucp by __init__ (the "ucp_" prefix dropped)
    get_version: Any
    config_read: Any
    config_release: Any
    init_version: Any
    cleanup: Any
    worker_create: Any
    worker_destroy: Any
    worker_get_address: Any
    worker_release_address: Any
    worker_get_efd: Any
    worker_arm: Any
    worker_progress: Any

    def __init__(self) -> None:
        try:
            import libucx  # type: ignore[import-untyped]
        except ImportError as exc:
            raise TransportUnavailable(
                f"the rdma transport needs the UCX libraries (the libucx wheel that ucxx installs), which are "
                f"missing ({exc}); install them with: {INSTALL_HINT}"
            ) from None
        try:
            loaded = libucx.load_library()
        except OSError as exc:
            raise TransportUnavailable(f"cannot load the UCX libraries: {exc}; reinstall with: {INSTALL_HINT}") from None
        names = [getattr(x, "_name", "") or "" for x in loaded or []]
        path = next((n for n in names if "libucp" in n), None) or self._loaded_libucp()
        try:
            lib = ctypes.CDLL(path)
        except OSError as exc:
            raise TransportUnavailable(f"cannot open libucp ({path}): {exc}; reinstall with: {INSTALL_HINT}") from None
        P = ctypes.POINTER(_Param)
        vp, u64, sz = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t
        pvp, ci, cu = ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint
        for name, args, res in (
            ("ucp_get_version", [ctypes.POINTER(cu)] * 3, None),
            ("ucp_config_read", [ctypes.c_char_p, ctypes.c_char_p, pvp], ci),
            ("ucp_config_release", [vp], None),
            ("ucp_init_version", [cu, cu, vp, vp, pvp], ci),
            ("ucp_cleanup", [vp], None),
            ("ucp_worker_create", [vp, vp, pvp], ci),
            ("ucp_worker_destroy", [vp], None),
            ("ucp_worker_get_address", [vp, pvp, ctypes.POINTER(sz)], ci),
            ("ucp_worker_release_address", [vp, vp], None),
            ("ucp_worker_get_efd", [vp, ctypes.POINTER(ci)], ci),
            ("ucp_worker_arm", [vp], ci),
            ("ucp_worker_progress", [vp], cu),
        ):
            fn = getattr(lib, name)
            fn.argtypes = args
            fn.restype = res
            setattr(self, name[4:], fn)
        self.tag_send_nbx = lib.ucp_tag_send_nbx
        self.tag_send_nbx.argtypes = [vp, vp, sz, u64, P]
        self.tag_send_nbx.restype = vp
        self.tag_recv_nbx = lib.ucp_tag_recv_nbx
        self.tag_recv_nbx.argtypes = [vp, vp, sz, u64, u64, P]
        self.tag_recv_nbx.restype = vp
        self.request_cancel = lib.ucp_request_cancel
        self.request_cancel.argtypes = [vp, vp]
        self.request_cancel.restype = None
        self.request_free = lib.ucp_request_free
        self.request_free.argtypes = [vp]
        self.request_free.restype = None
        self.ep_create = lib.ucp_ep_create
        self.ep_create.argtypes = [vp, ctypes.POINTER(_EpParams), ctypes.POINTER(ctypes.c_void_p)]
        self.ep_create.restype = ctypes.c_int
        self.ep_close_nbx = lib.ucp_ep_close_nbx
        self.ep_close_nbx.argtypes = [vp, P]
        self.ep_close_nbx.restype = vp

    @staticmethod
    def _loaded_libucp() -> str:
        """The libucp already in this process (wheel or system), if the loader did not
        name it: one library instance for everything."""
        try:
            with open("/proc/self/maps") as f:
                for line in f:
                    if "libucp.so" in line:
                        return line.split(None, 5)[-1].strip()
        except OSError:
            pass
        return "libucp.so.0"


def _check(status: int, what: str) -> None:
    if status != UCS_OK:
        raise TransportUnavailable(f"cannot initialise UCX: {what} failed with status {status}")


_FEATURE_TAG, _FEATURE_WAKEUP = 1 << 0, 1 << 4
_PARAM_FIELD_FEATURES = 1 << 0


def _create_worker(api: "_Api") -> tuple[int, int]:
    """A UCX context (tag + wakeup features; configuration from ``UCX_*`` variables)
    and one single-threaded worker on it: ``(ucp_context_h, ucp_worker_h)``."""
    major, minor, release = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()
    api.get_version(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(release))
    config = ctypes.c_void_p()
    _check(api.config_read(None, None, ctypes.byref(config)), "ucp_config_read")
    # ucp_params_t / ucp_worker_params_t: UCX reads only the fields field_mask names
    # (the first two u64 here); the rest of each buffer stays zero.
    params = (ctypes.c_uint64 * 64)(_PARAM_FIELD_FEATURES, _FEATURE_TAG | _FEATURE_WAKEUP)
    context = ctypes.c_void_p()
    try:
        _check(api.init_version(major.value, minor.value, ctypes.addressof(params), config, ctypes.byref(context)),
               "ucp_init")
    finally:
        api.config_release(config)
    worker_params = (ctypes.c_uint64 * 64)()  # field_mask 0: defaults (single-threaded)
    worker = ctypes.c_void_p()
    status = api.worker_create(context, ctypes.addressof(worker_params), ctypes.byref(worker))
    if status != UCS_OK or not worker.value:
        api.cleanup(context)
        _check(status or -1, "ucp_worker_create")
    assert context.value is not None and worker.value is not None
    return context.value, worker.value


def _destroy(api: "_Api", context: int | None, worker: int | None) -> None:
    if worker:
        api.worker_destroy(worker)
    if context:
        api.cleanup(context)


_API: _Api | None = None
_PARKED: list[Any] = []  # workers that could not be destroyed safely (see UcxWorker.close)


def api() -> _Api:
    global _API
    if _API is None:
        _API = _Api()
    return _API


def _status_of(ptr: int | None) -> int:
    """UCS_PTR_STATUS for a returned ``ucs_status_ptr_t``."""
    if ptr is None:
        return UCS_OK
    signed = ptr - (1 << 64) if ptr >= (1 << 63) else ptr
    if _ERR_LAST <= signed < 0:
        return signed
    return UCS_INPROGRESS


class UcxWorker:
    """One UCX context + worker, progressed by a task on the running loop.

    Buffers are given as ``(address, nbytes)`` pieces; the caller keeps the memory
    alive (``keep``) until the completion callback ran — this class holds ``keep``
    for exactly that long.
    """

    def __init__(self, *, spin_s: float = 0.0, idle_timeout_s: float = 0.05) -> None:
        self._api = api()
        self._context: int | None
        self._worker: int | None
        self._context, self._worker = _create_worker(self._api)
        try:
            fd = ctypes.c_int(-1)
            _check(self._api.worker_get_efd(self._worker, ctypes.byref(fd)), "ucp_worker_get_efd")
            self._fd: int = fd.value
            addr, n = ctypes.c_void_p(), ctypes.c_size_t()
            _check(self._api.worker_get_address(self._worker, ctypes.byref(addr), ctypes.byref(n)), "ucp_worker_get_address")
            self.address: bytes = ctypes.string_at(addr.value or 0, n.value)
            self._api.worker_release_address(self._worker, addr)
        except TransportUnavailable:
            _destroy(self._api, self._context, self._worker)
            raise
        self.handle: int = self._worker  # type: ignore[assignment]  # set just above
        self._spin_s = spin_s
        self._idle_timeout_s = idle_timeout_s
        # token -> (request pointer, callback, keepalive)
        self._inflight: dict[int, tuple[int, Completion, Any]] = {}
        self._next_token = 1
        self._done: list[tuple[int, int, int, int]] = []  # (token, status, length, tag)
        self._send_cb = _SEND_CB(self._on_send)
        self._recv_cb = _RECV_CB(self._on_recv)
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

    # -- lifecycle ------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._loop = asyncio.get_running_loop()
            self._task = self._loop.create_task(self._progress_loop(), name="pdgrpc-ucx-progress")

    @property
    def inflight(self) -> int:
        """Everything UCX still owes a completion for (requests and endpoint closes)."""
        return len(self._inflight)

    @property
    def inflight_requests(self) -> int:
        """Tag sends and receives in flight (endpoint closes not counted)."""
        return len(self._inflight) - len(self._closing)

    async def close(self, timeout: float = 5.0, destroy_timeout: float = 5.0) -> None:
        """Cancel everything in flight, wait (bounded) for the cancellations, stop the
        progress task, close endpoints and release the worker.

        ``timeout`` is generous because a send to a live but busy peer (a loaded host)
        completes only when that peer progresses: with 1 s, the conformance suite saw a
        worker parked (and its fds kept) under a full test run on 2 cores."""
        if self._closed:
            return
        for token in list(self._inflight):
            if token not in self._closing:
                self.cancel(token)
        for ep in list(self._endpoints):
            self.drop_endpoint(ep)
        deadline = time.monotonic() + timeout
        while (self._inflight or self._abandoned) and time.monotonic() < deadline:
            self._progress_once()
            if self._inflight or self._abandoned:
                await asyncio.sleep(0.001)
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        self._set_reader(False)
        if self._closing or self._abandoned or self._inflight:
            # UCX still owes completions (an endpoint close a hung peer never
            # confirms, a rendezvous send it never answered). Destroying the worker
            # now can block inside UCX waiting for them, so it is parked instead: a
            # bounded leak (one worker and its buffers) in a pathological case,
            # never a hung event loop.
            logging.getLogger("pdgrpc.transport.rdma").warning(
                "UCX worker parked at close: %d endpoint closes and %d requests still pending",
                len(self._closing), len(self._inflight) + len(self._abandoned) - len(self._closing))
            _PARKED.append((self._worker, self._context, self._inflight, self._abandoned, self._send_cb, self._recv_cb))
            self._worker = self._context = None
            return
        api_, context, worker = self._api, self._context, self._worker
        # Destroy the worker and context off the loop thread: ucp_worker_destroy tears
        # down endpoints and can wait on a transport that a departed peer left behind
        # (seen rarely with shared memory on a loaded host). Normally this takes
        # milliseconds and the thread is gone before close() returns.
        self._worker = self._context = None
        finished = threading.Event()

        def destroy() -> None:
            _destroy(api_, context, worker)
            finished.set()

        t = threading.Thread(target=destroy, name="pdgrpc-ucx-destroy", daemon=True)
        t.start()
        deadline = time.monotonic() + destroy_timeout
        while not finished.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.002)
        if finished.is_set():
            t.join(1.0)
        else:
            logging.getLogger("pdgrpc.transport.rdma").warning(
                "UCX worker destruction still blocked after %.1f s; left to a daemon thread", destroy_timeout)

    # -- endpoints ------------------------------------------------------------------
    def endpoint(self, address: bytes) -> int:
        """An endpoint (``ucp_ep_h``) to the worker at ``address``, error handling off
        (the fast shared-memory path; peer death is detected by the liveness side
        channel). Created through the C API rather than ucxx's ``UCXEndpoint`` so that
        closing it never blocks: ucxx closes endpoints by progressing until the peer
        confirms, which never happens when the peer is hung."""
        if self._closed or self._worker is None:
            raise UcxError("UCX worker is closed")
        raw = ctypes.create_string_buffer(bytes(address), len(address))
        params = _EpParams()
        params.field_mask = _EP_PARAM_FIELD_REMOTE_ADDRESS | _EP_PARAM_FIELD_ERR_HANDLING_MODE
        params.address = ctypes.addressof(raw)
        params.err_mode = _ERR_HANDLING_MODE_NONE
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
        token = self._next_token
        self._next_token += 1
        param = _Param()
        param.op_attr_mask = _OP_ATTR_FIELD_CALLBACK | _OP_ATTR_FIELD_USER_DATA | _OP_ATTR_FIELD_FLAGS
        param.flags = _EP_CLOSE_FLAG_FORCE if force else 0
        param.user_data = token
        param.cb = self._send_cb_ptr
        ptr = self._api.ep_close_nbx(ep, ctypes.byref(param))
        if _status_of(ptr) == UCS_INPROGRESS and ptr is not None:
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
        """Post a tag receive into ``pieces`` on the worker (any sender).
        ``background``: a receive kept posted for whatever comes (control messages);
        it does not make the progress task spin."""
        token = self._post(False, self.handle, pieces, tag, mask, cb, keep)
        if background:
            self._background.add(token)
        return token

    def cancel(self, token: int) -> None:
        """Cancel a pending request; its callback then runs with UCS_ERR_CANCELED (or
        UCS_OK if it had already completed)."""
        entry = self._inflight.get(token)
        if entry is not None and self._worker is not None:
            self._api.request_cancel(self.handle, entry[0])
            self.kick()

    def abandon(self, token: int) -> None:
        """Stop waiting for a request UCX cannot cancel (a rendezvous send to a hung
        peer, with error handling off, stays pending even after a forced endpoint
        close). Its callback is never run; if UCX ever completes it, the request is
        freed then, and its buffers stay referenced until that or :meth:`close`."""
        entry = self._inflight.pop(token, None)
        if entry is not None:
            self._abandoned[token] = entry

    def _post(self, is_send: bool, target: int, pieces: Pieces, tag: int, mask: int,
              cb: Completion, keep: Any) -> int:
        if self._closed or self._worker is None:
            raise UcxError("UCX worker is closed")
        token = self._next_token
        self._next_token += 1
        param = _Param()
        param.op_attr_mask = _OP_ATTR_FIELD_CALLBACK | _OP_ATTR_FIELD_USER_DATA | _OP_ATTR_FIELD_DATATYPE \
            | _OP_ATTR_FLAG_NO_IMM_CMPL
        param.user_data = token
        iov: Any = None
        if isinstance(pieces, np.ndarray):
            # (n, 2) uint64 rows {address, length}: the exact layout of ucp_dt_iov_t,
            # so UCX reads the array in place (no per-entry Python work).
            if pieces.ndim != 2 or pieces.shape[1] != 2 or pieces.dtype != np.uint64 \
                    or not pieces.flags.c_contiguous or len(pieces) == 0:
                raise ValueError("iov array must be a non-empty C-contiguous (n, 2) uint64 array")
            if len(pieces) == 1:
                param.datatype = _DATATYPE_CONTIG_BYTES
                buf, count = int(pieces[0, 0]), int(pieces[0, 1])
            else:
                iov = pieces
                param.datatype = _DATATYPE_IOV
                buf, count = pieces.ctypes.data, len(pieces)
        elif len(pieces) == 1:
            param.datatype = _DATATYPE_CONTIG_BYTES
            buf, count = pieces[0]
        else:
            iov = (_Iov * len(pieces))(*[_Iov(a, n) for a, n in pieces])
            param.datatype = _DATATYPE_IOV
            buf, count = ctypes.addressof(iov), len(pieces)
        if is_send:
            param.cb = self._send_cb_ptr
            ptr = self._api.tag_send_nbx(target, buf, count, tag, ctypes.byref(param))
        else:
            param.cb = self._recv_cb_ptr
            ptr = self._api.tag_recv_nbx(target, buf, count, tag, mask, ctypes.byref(param))
        status = _status_of(ptr)
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
        if not self._done:
            return False
        done, self._done = self._done, []
        for token, status, length, tag in done:
            entry = self._inflight.pop(token, None)
            self._closing.discard(token)
            self._background.discard(token)
            if entry is None:
                gone = self._abandoned.pop(token, None)
                if gone is not None:
                    self._api.request_free(gone[0])
                continue
            ptr, cb, _keep = entry
            self._api.request_free(ptr)
            try:
                cb(status, length, tag)
            except Exception:  # a callback bug must not stop progress for everyone
                import logging

                logging.getLogger("pdgrpc.transport.rdma").exception("completion callback failed")
        return True

    # -- progress -------------------------------------------------------------------
    def kick(self) -> None:
        """Make the progress task run a round soon (new work was posted)."""
        self._last_activity = time.monotonic()
        w = self._wake
        if w is not None and not w.done():
            w.set_result(None)

    def _on_timer(self) -> None:
        # Safety net against a missed wakeup; not counted as activity, so an idle
        # worker goes straight back to sleep after one progress round.
        w = self._wake
        if w is not None and not w.done():
            w.set_result(None)

    def _progress_once(self) -> bool:
        if self._worker is None:
            return False
        progress = self._api.worker_progress
        while progress(self._worker):
            pass
        return self._dispatch()

    def _busy(self) -> bool:
        """A transfer is pending: a send or data receive (not an always-posted
        control receive, not an endpoint close)."""
        return len(self._inflight) > len(self._closing) + len(self._background)

    def _set_reader(self, on: bool) -> None:
        if self._loop is None or on == self._reader_on:
            return
        if on:
            self._loop.add_reader(self._fd, self.kick)
        else:
            self._loop.remove_reader(self._fd)
        self._reader_on = on

    async def _progress_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._closed:
            if self._progress_once():
                self._last_activity = time.monotonic()
            elif self._worker is not None and (
                    not self._busy() or time.monotonic() - self._last_activity > self._spin_s):
                # Idle: arm the worker and sleep until its epoll fd fires. arm() is
                # False when events are pending, in which case we progress again.
                if self._api.worker_arm(self._worker) == UCS_OK:  # else UCS_ERR_BUSY: events pending
                    fut: asyncio.Future[None] = loop.create_future()
                    self._wake = fut
                    self._set_reader(True)
                    timer = loop.call_later(self._idle_timeout_s, self._on_timer)
                    try:
                        await fut
                    finally:
                        timer.cancel()
                        self._wake = None
                        self._set_reader(False)
                    continue
            await asyncio.sleep(0)
