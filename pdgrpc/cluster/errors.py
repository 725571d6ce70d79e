"""What a local cluster raises: it could not start or stop, or one of its processes died."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdgrpc.errors import PdgrpcError

if TYPE_CHECKING:
    from pdgrpc.cluster.launcher import Proc

__all__ = ["ChildDied", "ClusterError"]


class ClusterError(PdgrpcError):
    """The cluster could not start or stop as asked."""


class ChildDied(ClusterError):
    """A cluster process exited while the cluster was meant to run."""

    def __init__(self, proc: "Proc") -> None:
        self.proc = proc
        super().__init__(
            f"{proc.spec.role} process {proc.spec.name!r} (pid {proc.pid}) exited with code {proc.returncode}; "
            f"last lines of {proc.log_path}:\n{proc.log_tail()}"
        )
