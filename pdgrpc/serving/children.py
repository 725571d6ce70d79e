"""Child processes that do not outlive their parent."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

__all__ = ["die_with_parent", "guarded_argv"]

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


# Sets PR_SET_PDEATHSIG, gives up if the parent is already gone, then becomes the child.
_GUARD = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL('libc.so.6').prctl(1, signal.SIGKILL)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def guarded_argv(argv: list[str]) -> list[str]:
    """``argv`` started through a small shim that has the kernel SIGKILL it when this
    process dies, then execs it (same pid). For children started without a
    ``preexec_fn``: such a start runs no fork handler in the child (gRPC's among them),
    whatever this process's gRPC settings."""
    if _LIBC is None:
        return argv
    return [sys.executable, "-I", "-S", "-c", _GUARD, str(os.getpid()), *argv]
