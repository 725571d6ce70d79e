"""glibc malloc settings for a process that runs the engine's compute.

Why: glibc serves every allocation above its mmap threshold (128 KiB at start, raised
on the fly up to 32 MiB) with a fresh ``mmap`` and hands it back with ``munmap`` on
free, and it returns the top of the heap to the kernel once more than the trim
threshold is free there. A forward pass allocates and frees the same large temporaries
again and again, so each one page-faults its memory in anew. With the mmap threshold
at its 32 MiB ceiling and freed memory kept, the temporaries are reused instead, in the
main thread and in a compute thread alike, and two processes' computes run at the same
speed.

:func:`keep_freed_memory` applies that (``mallopt``) once per process; the servers
that host an engine call it at start-up (``--malloc-keep-mib``, default 256; 0 leaves
glibc's defaults). The cost is memory: up to that many MiB of freed heap stay in the
process. An operator's own glibc settings win: if ``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_TOP_PAD_`` or a ``glibc.malloc`` tunable is set,
nothing is changed. Other C libraries (musl, macOS): nothing is changed.
"""

from __future__ import annotations

import ctypes
import os

from pdgrpc.errors import ConfigError

__all__ = ["KEEP_MAX_MIB", "MMAP_THRESHOLD_MAX", "keep_freed_memory", "release_freed_memory"]

_M_TRIM_THRESHOLD = -1  # <malloc.h>
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit hosts (4 MiB * sizeof(long))
_TRIM_MAX = 2**31 - 1  # mallopt takes an int
KEEP_MAX_MIB = _TRIM_MAX >> 20  # the most freed memory, in whole MiB, keep_freed_memory can keep
_USER_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def keep_freed_memory(keep_bytes: int) -> str:
    """Serve allocations up to :data:`MMAP_THRESHOLD_MAX` from the heap and keep up to
    ``keep_bytes`` of freed heap memory instead of returning it to the kernel.

    Returns what happened, for the start-up log: ``"applied"``, or ``"skipped: <why>"``.
    ``keep_bytes`` 0 changes nothing."""
    if keep_bytes < 0:
        raise ConfigError(f"keep_bytes must be >= 0, got {keep_bytes}")
    if keep_bytes == 0:
        return "skipped: disabled (0)"
    user = [v for v in _USER_VARS if v in os.environ]
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        user.append("GLIBC_TUNABLES")
    if user:
        return f"skipped: the environment sets {', '.join(user)}"
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc only: mallopt's parameters differ elsewhere
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "skipped: not glibc"
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    trim = min(int(keep_bytes), _TRIM_MAX)
    if not mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) or not mallopt(_M_TRIM_THRESHOLD, trim):
        return "skipped: mallopt refused"
    return "applied"


def release_freed_memory() -> bool:
    """Return every whole free page of the heap to the kernel (glibc's ``malloc_trim(0)``),
    those between live blocks too: loading a checkpoint frees its plain weights once they
    are repacked, and the trim threshold only ever returns the heap's top. Call once after
    a load; False where this is not glibc."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    trim(0)
    return True
