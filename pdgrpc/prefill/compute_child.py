"""Starting a prefill worker's compute process (:mod:`pdgrpc.prefill.compute_process`)
as the worker's first act, before the worker imports torch: the child then imports torch
and builds its engine while the worker does the same, not after it.

This module imports no torch, and neither does anything it imports. The child's socket
carries everything else: the engine config and the KV pool's memory come with its first
message (:meth:`pdgrpc.prefill.compute_process.ComputeProcess.start`).
"""

from __future__ import annotations

import dataclasses
import socket
import subprocess
import sys

from pdgrpc.serving.children import guarded_argv

__all__ = ["Child", "spawn"]


@dataclasses.dataclass
class Child:
    """A started compute process and the worker's end of its socket."""

    proc: subprocess.Popen[bytes]
    sock: socket.socket

    def discard(self) -> None:
        """Stop a child that gets no config: EOF on its socket ends it."""
        self.sock.close()
        try:
            self.proc.wait(5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def spawn(name: str) -> Child:
    """Start the compute process of worker ``name``; it waits on its socket for its config."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        # Started without a preexec_fn, so no fork handler (gRPC's) runs in the child.
        proc = subprocess.Popen(
            guarded_argv([sys.executable, "-m", "pdgrpc.prefill.compute_process", "--sock-fd", str(theirs.fileno()),
                          "--name", name]),
            pass_fds=(theirs.fileno(),),
        )
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return Child(proc, ours)
