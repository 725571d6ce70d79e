"""The ``reason`` label's vocabulary: :class:`pdgrpc.state.outcomes.AbortReason` (the
decode state machines' reasons) followed by :class:`~pdgrpc.metrics.catalog.ServerAbortReason`
(causes outside them).

Built from the enums, never typed out: a reason added to ``AbortReason`` appears here,
and pre-initialised at 0 in every server's exposition, with no change to this package.

A module of its own so that the bootstrap (which records no aborts) never imports
:mod:`pdgrpc.state`. :mod:`pdgrpc.state.outcomes` itself is torch-free (the state package
loads its tensor modules lazily), so the router's facade does not load torch either
(``tests/router`` checks it).
"""

from __future__ import annotations

from typing import Union

from pdgrpc.metrics.catalog import ServerAbortReason
from pdgrpc.state.outcomes import AbortReason

__all__ = ["ABORT_REASON_LABELS", "AnyAbortReason", "SAME_CAUSE", "abort_label"]

AnyAbortReason = Union[AbortReason, ServerAbortReason]

# Server causes that the decode machines also name, with the same meaning and label: a
# peer's death is ``peer_failure`` wherever it is seen (a prefill controller whose worker
# died, a decode whose transport lost the writer).
SAME_CAUSE: frozenset[ServerAbortReason] = frozenset({ServerAbortReason.PEER_FAILURE})


def abort_label(reason: AnyAbortReason) -> str:
    """The ``reason`` label value (``AbortReason.TRANSFER_TIMEOUT`` -> ``transfer_timeout``).
    Anything else -- a bare int, a string -- is a TypeError: the label set stays closed."""
    if isinstance(reason, AbortReason):
        return reason.name.lower()
    if isinstance(reason, ServerAbortReason):
        return reason.value
    raise TypeError(f"abort reason must be an AbortReason or ServerAbortReason, got {reason!r}")


ABORT_REASON_LABELS: tuple[str, ...] = tuple(abort_label(r) for r in AbortReason) + tuple(
    abort_label(r) for r in ServerAbortReason if r not in SAME_CAUSE
)
