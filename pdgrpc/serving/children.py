"""Child processes that do not outlive their parent, started without a fork."""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import subprocess
import sys
from typing import IO, Literal, Mapping, Sequence, Union

__all__ = ["Spawned", "die_with_parent", "guarded_argv", "spawn"]

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
    process dies, then execs it (same pid). For children started by :func:`spawn`, or
    otherwise without a ``preexec_fn``."""
    if _LIBC is None:
        return argv
    return [sys.executable, "-I", "-S", "-c", _GUARD, str(os.getpid()), *argv]


# What a child's stdout or stderr may be: a file, a descriptor, subprocess.DEVNULL, or None
# (this process's).
Output = Union[IO[bytes], int, None]


class Spawned:
    """A child started by :func:`spawn`, with the part of ``asyncio.subprocess.Process``
    the launchers use. Its exit is read from a pidfd on the running loop, so no thread
    sits waiting for it."""

    def __init__(self, popen: "subprocess.Popen[bytes]", stdout: asyncio.StreamReader | None = None) -> None:
        self._popen = popen
        self._exited: asyncio.Future[int] | None = None
        self.stdout = stdout  # the child's stdout, when spawn was asked to read it

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        return self._popen.poll()

    def send_signal(self, sig: int) -> None:
        """Signal the child; nothing once it has exited (its pid may be another's)."""
        self._popen.send_signal(sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    async def wait(self) -> int:
        """The child's exit status, once it has exited."""
        code = self._popen.poll()
        if code is not None:
            return code
        if self._exited is None:
            self._exited = self._watch()
        return await asyncio.shield(self._exited)

    def _watch(self) -> "asyncio.Future[int]":
        loop = asyncio.get_running_loop()
        exited: asyncio.Future[int] = loop.create_future()
        try:
            fd = os.pidfd_open(self._popen.pid)
        except OSError:  # a kernel before 5.3: a thread waits instead
            return asyncio.ensure_future(asyncio.to_thread(self._popen.wait))

        def readable() -> None:
            code = self._popen.poll()
            if code is None:
                return
            loop.remove_reader(fd)
            os.close(fd)
            if not exited.done():
                exited.set_result(code)

        loop.add_reader(fd, readable)
        readable()  # it may have exited before the reader was in place
        return exited


async def spawn(
    argv: Sequence[str], *, stdout: Output | Literal["read"], stderr: Output, env: Mapping[str, str] | None = None,
    new_session: bool = False, pass_fds: Sequence[int] = (),
) -> Spawned:
    """Start ``argv`` (stdin from /dev/null) by vfork and exec, which runs none of this
    process's fork handlers in the child. A plain fork runs them, and uvloop's
    ``subprocess_exec`` forks: gRPC's handlers, with its fork support on (its default),
    start threads in the child that abort it once it closes its inherited fds before
    exec. ``stdout="read"``: the child's stdout is :attr:`Spawned.stdout`, read on the
    running loop. ``new_session``: the child leads a session and process group of its
    own. ``pass_fds``: descriptors the child inherits."""
    popen = subprocess.Popen(
        list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE if stdout == "read" else stdout, stderr=stderr,
        env=None if env is None else dict(env), start_new_session=new_session, pass_fds=tuple(pass_fds),
    )
    if stdout != "read":
        return Spawned(popen)
    assert popen.stdout is not None
    reader = asyncio.StreamReader()
    try:
        await asyncio.get_running_loop().connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), popen.stdout)
    except BaseException:
        popen.kill()
        popen.wait()
        raise
    return Spawned(popen, reader)
