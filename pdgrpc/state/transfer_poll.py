"""The vectorized steps of the decode transfer poll (one tensor op per step, all slots).

The poll runs, on every TP rank, in this order (DESIGN.md step 6):

1. local poll: each rank's transport state per slot;
2. :func:`apply_metadata_gate` — SUCCESS becomes TRANSFERRING while the slot's room is
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

__all__ = ["AllReduceMin", "NEG_ROOM", "POLL_ROWS", "REASON", "ROOM", "STATE", "apply_metadata_gate", "identity_reduce"]

STATE, REASON, ROOM, NEG_ROOM = 0, 1, 2, 3
POLL_ROWS = 4

AllReduceMin = Callable[[torch.Tensor], torch.Tensor]
"""Elementwise MIN of the tensor over all TP ranks (returns the result; may work in place).
TP=1: :func:`identity_reduce`. Production: ``dist.all_reduce(t, op=ReduceOp.MIN, group=g)``
over a gloo group, then return ``t``."""


def identity_reduce(t: torch.Tensor) -> torch.Tensor:
    return t


def apply_metadata_gate(
    states: torch.Tensor, slot_rooms: torch.Tensor, expected: torch.Tensor, checked: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate local states on the metadata rows.

    ``states``: int64 local KVPoll per slot; ``slot_rooms``: int64 bootstrap_room read from
    each row; ``expected``: the room each slot was allocated for; ``checked``: bool, the slots
    to gate (in transfer and not fake). Returns ``(gated, corrupt)``.
    """
    landed = slot_rooms != 0
    corrupt = checked & landed & (slot_rooms != expected)
    not_landed = checked & ~landed & (states == int(KVPoll.SUCCESS))
    gated = torch.where(not_landed, int(KVPoll.TRANSFERRING), states)
    gated = torch.where(corrupt, int(KVPoll.FAILED), gated)
    return gated, corrupt
