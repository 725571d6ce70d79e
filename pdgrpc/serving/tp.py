"""Who sends which KV heads to whom when prefill and decode have different TP sizes.

Both sides derive everything from four numbers -- the prefill TP size ``tp_p``, the
decode TP size ``tp_d``, the model's KV head count ``H`` and the ranks -- so nothing
but ``decode_tp_rank``/``decode_tp_size`` (in each HandshakeRequest) and the prefill's
``tp_size`` (in its ParallelInfo) has to travel.

- Rank ``r`` of a side of size ``n`` holds global KV heads ``[r*H/n, (r+1)*H/n)``.
- Prefill rank ``p`` writes to decode rank ``d`` exactly when their head ranges
  intersect; it writes the intersection (a head slice of every page, strided when the
  sizes differ, whole pages when they are equal).
- A decode rank therefore waits for ``max(1, tp_p / tp_d)`` prefill ranks, and a
  prefill rank writes to ``max(1, tp_d / tp_p)`` decode ranks (one size must divide
  the other).
- Every writer of a room ends its writes with a metadata row (the transports commit a
  room when its row lands after its pages). Exactly one of a decode rank's senders --
  its *designated* sender, the lowest prefill rank it waits for -- writes the row into
  the decode's metadata region (``wants_metadata`` in the handshake); the others write
  the same row into the decode's **sink** region (:data:`METADATA_SINK_REGION_ID`,
  same slot), which nothing reads. So the gated row reaches every decode rank exactly
  once, and the decode rank knows all its senders finished when every one of their
  transfers is SUCCESS.
- Each (prefill rank, decode rank) pair is its own transfer on the transports, keyed
  by :func:`transfer_room` (the room itself when both sides are TP1 or the ranks map
  one to one), so one sender may write to two decode ranks and one decode rank may
  receive from two senders with the transports' one-sender-per-room contract intact.
"""

from __future__ import annotations

from pdgrpc.errors import ConfigError
from pdgrpc.state.room import ROOM_LIMIT

__all__ = [
    "METADATA_SINK_REGION_ID",
    "designated_sender",
    "heads_of",
    "receivers_of",
    "senders_of",
    "check_tp_sizes",
    "transfer_room",
]

# Region id of a decode rank's sink metadata rows (see the module doc).
METADATA_SINK_REGION_ID = 0xFFFE

_ROOM_MAX = ROOM_LIMIT - 1  # a mask: every key it leaves is a room
_MIX = 0x9E3779B97F4A7C15  # odd: j -> j * _MIX is a bijection mod 2**64


def check_tp_sizes(tp_p: int, tp_d: int) -> None:
    """Raise :class:`ConfigError` unless one TP size divides the other."""
    if tp_p < 1 or tp_d < 1:
        raise ConfigError(f"TP sizes must be >= 1, got prefill {tp_p}, decode {tp_d}")
    if max(tp_p, tp_d) % min(tp_p, tp_d):
        raise ConfigError(f"prefill tp_size {tp_p} and decode tp_size {tp_d}: one must divide the other")


def heads_of(rank: int, size: int, num_kv_heads: int) -> tuple[int, int]:
    """Global KV heads ``[start, end)`` held by ``rank`` of ``size``."""
    if not 0 <= rank < size or num_kv_heads % size:
        raise ConfigError(f"rank {rank} of tp_size {size} with {num_kv_heads} KV heads")
    per = num_kv_heads // size
    return rank * per, (rank + 1) * per


def senders_of(d: int, tp_d: int, tp_p: int) -> range:
    """The prefill ranks decode rank ``d`` waits for."""
    check_tp_sizes(tp_p, tp_d)
    if tp_p >= tp_d:
        k = tp_p // tp_d
        return range(d * k, (d + 1) * k)
    return range(d * tp_p // tp_d, d * tp_p // tp_d + 1)


def receivers_of(p: int, tp_p: int, tp_d: int) -> range:
    """The decode ranks prefill rank ``p`` writes to."""
    check_tp_sizes(tp_p, tp_d)
    if tp_d >= tp_p:
        k = tp_d // tp_p
        return range(p * k, (p + 1) * k)
    return range(p * tp_d // tp_p, p * tp_d // tp_p + 1)


def designated_sender(d: int, tp_d: int, tp_p: int) -> int:
    """The prefill rank that writes decode rank ``d``'s gated metadata row."""
    return senders_of(d, tp_d, tp_p)[0]


def transfer_room(room: int, p: int, d: int) -> int:
    """The transport room key of the transfer prefill rank ``p`` -> decode rank ``d``.

    ``room`` itself for the pair (0, 0) and whenever ``p == d`` (TP1, and equal TP sizes);
    otherwise a fixed scramble of ``(room, p, d)`` in ``[1, 2**63)``. Both sides compute
    it; the metadata row still carries ``room``."""
    if p == d:
        return room
    j = (p << 16) | d
    key = (room ^ ((j * _MIX) & _ROOM_MAX)) & _ROOM_MAX
    return key or 1
