"""The prefill's errors: :class:`~pdgrpc.errors.RequestFailed` (defined once, in
:mod:`pdgrpc.errors`, for every server) and :class:`WorkerLinkLost`.

Drivers raise ``RequestFailed`` built by :func:`pdgrpc.prefill.statuses.ending` (the
role's one table from why a request fails to its status), with a message naming the
field or the reason and the abort reason for ``pdgrpc_aborts_total``; the servicers turn
it into the RPC's status.
"""

from __future__ import annotations

from pdgrpc.errors import PdgrpcError, RequestFailed

__all__ = ["RequestFailed", "WorkerLinkLost"]


class WorkerLinkLost(PdgrpcError):
    """The controller's link to a worker closed: the worker died (or broke the protocol,
    and then stops)."""
