"""Child processes that do not outlive their parent."""

from __future__ import annotations

import ctypes
import os
import signal

__all__ = ["die_with_parent", "die_with_parent_in_own_group"]

# Loaded at import, not in the child: between fork and exec only async-signal-safe work
# is safe (a dlopen there could wait forever on a lock another parent thread held).
try:
    _LIBC: ctypes.CDLL | None = ctypes.CDLL("libc.so.6", use_errno=True)
except OSError:  # not glibc Linux: children end with their parent's own stop only
    _LIBC = None
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Have the kernel SIGKILL this process when its parent dies (``PR_SET_PDEATHSIG``).
    As a ``preexec_fn`` (between fork and exec) or first thing in a child's ``main``."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def die_with_parent_in_own_group() -> None:
    """:func:`die_with_parent` in a new session and process group of its own, so the
    parent can kill the child and its children at once (``preexec_fn`` only)."""
    os.setsid()
    die_with_parent()
