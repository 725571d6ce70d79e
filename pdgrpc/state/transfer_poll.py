"""The steps of the decode transfer poll, and the poll tensor TP ranks reduce.

The poll runs, on every TP rank, in this order (DESIGN.md step 6):

1. local poll: each rank's transport state per slot;
2. :func:`metadata_gate` — SUCCESS becomes TRANSFERRING while the slot's room is
   still 0, and a non-zero room that is not the expected one is FAILED (corruption);
3. all-reduce MIN across TP ranks (:data:`AllReduceMin`, injected);
4. act on the reduced states, identically on every rank.

The gate must run **before** the reduce: applied after it, a rank whose metadata has
landed commits while a rank whose metadata has not does not, and the ranks' queues diverge
(a hang at the next collective). The corruption check is part of the gate for the same
reason: every rank must agree to abort.

The poll tensor is ``int64[4, num_slots]`` — rows ``STATE``, ``REASON``, ``ROOM`` and
``NEG_ROOM`` — the same shape on every rank whatever its queue holds, so every rank issues
the same collective even when idle. After MIN, ``ROOM == -NEG_ROOM`` iff all ranks hold
the same room in that slot; otherwise the ranks have desynchronized.
"""

from __future__ import annotations

from typing import Callable

import torch

from pdgrpc.kvpoll import KVPoll

__all__ = ["AllReduceMin", "NEG_ROOM", "POLL_ROWS", "REASON", "ROOM", "STATE", "identity_reduce", "metadata_gate"]

STATE, REASON, ROOM, NEG_ROOM = 0, 1, 2, 3
POLL_ROWS = 4

AllReduceMin = Callable[[torch.Tensor], torch.Tensor]
"""Elementwise MIN of the tensor over all TP ranks (returns the result; may work in place).
TP=1: :func:`identity_reduce`. Production: ``dist.all_reduce(t, op=ReduceOp.MIN, group=g)``
over a gloo group, then return ``t``."""


def identity_reduce(t: torch.Tensor) -> torch.Tensor:
    return t


def metadata_gate(state: int, landed_room: int, expected_room: int) -> tuple[int, bool]:
    """Gate one slot's local state on its metadata row: ``(gated state, corrupt)``.

    ``landed_room``: the bootstrap_room read from the slot's row (0: not written yet);
    ``expected_room``: the room the slot was allocated for. A row holding another room is
    corruption (FAILED); SUCCESS waits as TRANSFERRING until the row has landed."""
    if landed_room != 0 and landed_room != expected_room:
        return KVPoll.FAILED, True
    if landed_room == 0 and state == KVPoll.SUCCESS:
        return KVPoll.TRANSFERRING, False
    return state, False
