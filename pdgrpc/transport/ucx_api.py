"""UCX's C API through :mod:`ctypes`: the ``libucp`` entry points, structures and
constants :mod:`pdgrpc.transport.ucx` uses (layouts checked against UCX 1.21's
headers), loaded once from the ``libucx`` wheel."""

from __future__ import annotations

import asyncio
import ctypes
import functools
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
OP_ATTR_FIELD_CALLBACK = 1 << 1
OP_ATTR_FIELD_USER_DATA = 1 << 2
OP_ATTR_FIELD_DATATYPE = 1 << 3
OP_ATTR_FIELD_FLAGS = 1 << 4
EP_CLOSE_FLAG_FORCE = 1 << 0
OP_ATTR_FLAG_NO_IMM_CMPL = 1 << 16
_DATATYPE_IOV = 2  # ucp_dt_make_iov()
DATATYPE_CONTIG_BYTES = (1 << 3) | 0  # ucp_dt_make_contig(1)
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


class Param(ctypes.Structure):
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


class EpParams(ctypes.Structure):
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


EP_PARAM_FIELD_REMOTE_ADDRESS = 1 << 0
EP_PARAM_FIELD_ERR_HANDLING_MODE = 1 << 1
ERR_HANDLING_MODE_NONE = 0


class _Iov(ctypes.Structure):
    _fields_ = [("buffer", ctypes.c_void_p), ("length", ctypes.c_size_t)]


def message_buffer(pieces: Pieces) -> tuple[int, int, int, Any]:
    """``(datatype, buffer, count, keepalive)`` of a tag message made of ``pieces``: one
    piece is a contiguous message (buffer = its address, count = its bytes), several an
    iov message (buffer = the address of their ``ucp_dt_iov_t`` table, count = entries).
    ``keepalive`` is that table (None for one piece): it must outlive the request."""
    if isinstance(pieces, np.ndarray):
        # (n, 2) uint64 rows {address, length}: the exact layout of ucp_dt_iov_t, so
        # UCX reads the array in place (no per-entry Python work).
        if pieces.ndim != 2 or pieces.shape[1] != 2 or pieces.dtype != np.uint64 \
                or not pieces.flags.c_contiguous or len(pieces) == 0:
            raise ValueError("iov array must be a non-empty C-contiguous (n, 2) uint64 array")
        if len(pieces) == 1:
            return DATATYPE_CONTIG_BYTES, int(pieces[0, 0]), int(pieces[0, 1]), None
        return _DATATYPE_IOV, pieces.ctypes.data, len(pieces), pieces
    if len(pieces) == 1:
        return DATATYPE_CONTIG_BYTES, int(pieces[0][0]), int(pieces[0][1]), None
    table = (_Iov * len(pieces))(*[_Iov(a, n) for a, n in pieces])
    return _DATATYPE_IOV, ctypes.addressof(table), len(pieces), table


class TagRecvInfo(ctypes.Structure):
    _fields_ = [("sender_tag", ctypes.c_uint64), ("length", ctypes.c_size_t)]


_STATUS = ctypes.c_int8  # ucs_status_t (ucs/type/status.h): a packed enum, one signed byte
SEND_CB = ctypes.CFUNCTYPE(None, ctypes.c_void_p, _STATUS, ctypes.c_void_p)
RECV_CB = ctypes.CFUNCTYPE(None, ctypes.c_void_p, _STATUS, ctypes.POINTER(TagRecvInfo), ctypes.c_void_p)


class Api:
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
        P = ctypes.POINTER(Param)
        vp, u64, sz = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t
        # ucs_status_t is a packed enum: one signed byte, so that is what is read back
        # (as a wider int the bytes above it are whatever the callee left there)
        pvp, st, cu = ctypes.POINTER(ctypes.c_void_p), _STATUS, ctypes.c_uint
        for name, args, res in (
            ("ucp_get_version", [ctypes.POINTER(cu)] * 3, None),
            ("ucp_config_read", [ctypes.c_char_p, ctypes.c_char_p, pvp], st),
            ("ucp_config_release", [vp], None),
            ("ucp_init_version", [cu, cu, vp, vp, pvp], st),
            ("ucp_cleanup", [vp], None),
            ("ucp_worker_create", [vp, vp, pvp], st),
            ("ucp_worker_destroy", [vp], None),
            ("ucp_worker_get_address", [vp, pvp, ctypes.POINTER(sz)], st),
            ("ucp_worker_release_address", [vp, vp], None),
            ("ucp_worker_get_efd", [vp, ctypes.POINTER(ctypes.c_int)], st),
            ("ucp_worker_arm", [vp], st),
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
        self.request_check_status = lib.ucp_request_check_status
        self.request_check_status.argtypes = [vp]
        self.request_check_status.restype = _STATUS
        self.tag_recv_request_test = lib.ucp_tag_recv_request_test
        self.tag_recv_request_test.argtypes = [vp, ctypes.POINTER(TagRecvInfo)]
        self.tag_recv_request_test.restype = _STATUS
        self.tag_probe_nb = lib.ucp_tag_probe_nb
        self.tag_probe_nb.argtypes = [vp, u64, u64, ctypes.c_int, ctypes.POINTER(TagRecvInfo)]
        self.tag_probe_nb.restype = vp
        self.ep_create = lib.ucp_ep_create
        self.ep_create.argtypes = [vp, ctypes.POINTER(EpParams), ctypes.POINTER(ctypes.c_void_p)]
        self.ep_create.restype = _STATUS
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


def check(status: int, what: str) -> None:
    if status != UCS_OK:
        raise TransportUnavailable(f"cannot initialise UCX: {what} failed with status {status}")


_FEATURE_TAG, _FEATURE_WAKEUP = 1 << 0, 1 << 4
_PARAM_FIELD_FEATURES = 1 << 0


def create_worker(api: "Api") -> tuple[int, int]:
    """A UCX context (tag + wakeup features; configuration from ``UCX_*`` variables)
    and one single-threaded worker on it: ``(ucp_context_h, ucp_worker_h)``."""
    major, minor, release = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()
    api.get_version(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(release))
    config = ctypes.c_void_p()
    check(api.config_read(None, None, ctypes.byref(config)), "ucp_config_read")
    # ucp_params_t / ucp_worker_params_t: UCX reads only the fields field_mask names
    # (the first two u64 here); the rest of each buffer stays zero.
    params = (ctypes.c_uint64 * 64)(_PARAM_FIELD_FEATURES, _FEATURE_TAG | _FEATURE_WAKEUP)
    context = ctypes.c_void_p()
    try:
        check(api.init_version(major.value, minor.value, ctypes.addressof(params), config, ctypes.byref(context)),
               "ucp_init")
    finally:
        api.config_release(config)
    worker_params = (ctypes.c_uint64 * 64)()  # field_mask 0: defaults (single-threaded)
    worker = ctypes.c_void_p()
    status = api.worker_create(context, ctypes.addressof(worker_params), ctypes.byref(worker))
    if status != UCS_OK or not worker.value:
        api.cleanup(context)
        check(status or -1, "ucp_worker_create")
    assert context.value is not None and worker.value is not None
    return context.value, worker.value


def destroy_worker(api: "Api", context: int | None, worker: int | None) -> None:
    if worker:
        api.worker_destroy(worker)
    if context:
        api.cleanup(context)


async def destroy_off_loop(api: "Api", context: int | None, worker: int | None, timeout: float) -> None:
    """Destroy ``worker`` and ``context`` off the loop thread: ``ucp_worker_destroy`` tears
    down endpoints and can wait on a transport that a departed peer left behind (seen
    rarely with shared memory on a loaded host). Normally this takes milliseconds and the
    thread is gone before this returns; after ``timeout`` seconds it is left to finish
    (a daemon thread), with a warning."""
    finished = threading.Event()

    def destroy() -> None:
        destroy_worker(api, context, worker)
        finished.set()

    t = threading.Thread(target=destroy, name="pdgrpc-ucx-destroy", daemon=True)
    t.start()
    deadline = time.monotonic() + timeout
    while not finished.is_set() and time.monotonic() < deadline:
        await asyncio.sleep(0.002)
    if finished.is_set():
        t.join(1.0)
    else:
        logging.getLogger("pdgrpc.transport.rdma").warning(
            "UCX worker destruction still blocked after %.1f s; left to a daemon thread", timeout)


PARKED: list[Any] = []  # workers that could not be destroyed safely (see UcxWorker.close)


@functools.cache
def api() -> Api:
    """The process's one loaded libucp; a failed load is not kept, so ``api.cache_clear()``
    makes the next call load it again."""
    return Api()


def status_of(ptr: int | None) -> int:
    """UCS_PTR_STATUS for a returned ``ucs_status_ptr_t``."""
    if ptr is None:
        return UCS_OK
    signed = ptr - (1 << 64) if ptr >= (1 << 63) else ptr
    if _ERR_LAST <= signed < 0:
        return signed
    return UCS_INPROGRESS


