"""How per-rank and per-report transfer states combine.

Two rules, both load-bearing (see DESIGN.md, "Poll states"):

* **Across ranks: MIN.** A room is only as far along as its least advanced tensor-parallel
  rank, and FAILED (0) on any rank fails the room everywhere.
* **Over time: forward only, FAILED wins.** A transport may report states out of order
  (a late TRANSFERRING after SUCCESS); the room keeps the most advanced one. FAILED
  replaces anything, and nothing replaces FAILED. A report for a room that is no longer
  tracked (already committed, aborted and freed) is ignored: a late FAILED must not fail
  a new request that happens to reuse the same slot or pages.
"""

from __future__ import annotations

from pdgrpc.kvpoll import KVPoll

__all__ = ["KVPoll", "advance", "advance_code"]


def advance_code(cur: int, rep: int) -> int:
    """:func:`advance` on raw codes (the decode queues' per-event hot path)."""
    if cur == 0 or rep == 0:
        return 0
    return cur if cur >= rep else rep


def advance(current: KVPoll | int, reported: KVPoll | int) -> KVPoll:
    """The state a room moves to when ``reported`` arrives while it is in ``current``."""
    return _BY_CODE[advance_code(int(current), int(reported))]


_BY_CODE = tuple(KVPoll)

