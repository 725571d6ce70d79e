"""What a local cluster raises when it cannot start or stop (a dead process is
:class:`pdgrpc.cluster.launcher.ChildDied`)."""

from __future__ import annotations

from pdgrpc.errors import PdgrpcError

__all__ = ["ClusterError"]


class ClusterError(PdgrpcError):
    """The cluster could not start or stop as asked."""
