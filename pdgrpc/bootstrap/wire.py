"""Vectorised protobuf encoding of batched ``DpRankEntry`` lists (numpy).

Building or reading 1,024 ``DpRankEntry`` sub-messages one Python object at a time costs
~0.2 ms each way, as much as the whole gRPC round trip; these functions do it with a
few numpy operations. They write ordinary protobuf wire format that any protobuf
library reads, so nothing changes for clients in other languages. Used where the
per-entry messages are still spoken: ``RegisterDpRanksRequest.entries`` (decoded by the
server; encoded by :class:`BootstrapClient` for a server that predates the packed
fields) and ``QueryDpRanksResponse.entries`` (encoded by the server for clients that ask
for neither ``found_ranks_only`` nor ``packed_reply``). The packed fields
(``packed_rooms``, ``packed_dp_ranks``: little-endian arrays in ``bytes``) need no codec
at all: ``np.frombuffer`` reads them.

Layout written (and the only one the fast decoder accepts) for each entry::

    0x0A len  0x08 varint(bootstrap_room)  0x10 varint(dp_rank)

(field 1, length-delimited; inside it field 1 then field 2, both always present — a
zero rank is written explicitly, which every parser accepts). The decoder *checks*
that the bytes have exactly this layout and returns ``None`` otherwise (another field
order, an omitted zero rank, unknown fields...): the caller then parses with the
generated classes. A layout that passes the checks is, byte for byte, what a
sequential protobuf parser reads, so the fast path never disagrees with the slow one.
Packed repeated fields (``bootstrap_rooms``, ``missing_rooms``, ``found_dp_ranks``)
are left to protobuf's C parser and serializer, which are fast for them already.

A packed ``RegisterDpRanksRequest`` of one room (:func:`encode_one_room`,
:func:`decode_one_room`) is 16 bytes of one fixed layout, what protobuf writes for it::

    0x1A 0x08 room (8 bytes, little-endian)  0x22 0x04 rank (4 bytes, little-endian)

(``packed_rooms``, field 3, then ``packed_dp_ranks``, field 4). One ``struct`` call
reads or writes it: a tenth of the generated class's cost for the commonest call.
"""

from __future__ import annotations

import struct

import numpy as np

from pdgrpc.v1 import bootstrap_pb2 as pb

# x >= 2**(7*i) (i = 1..9) means the varint of x has more than i bytes.
_THRESHOLDS = np.array([1 << (7 * i) for i in range(1, 10)], np.uint64)
_SHIFTS = np.arange(0, 70, 7, dtype=np.uint64)
_COLS = np.arange(10)
_LOW7 = np.uint64(0x7F)
_U32_MAX = np.uint64(0xFFFFFFFF)
_WIDTH = 19  # widest entry: 0x0A, len, 0x08, 10-byte room, 0x10, 5-byte rank
_TAGS = np.array([0x0A, 0x08, 0x10], np.uint8)  # tokens 0, 2, 4 of an entry
_ONE_BYTE = [0, 1, 2, 4]  # tokens of an entry that are one byte long: the tags and len


def _varint_bytes(values: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Each value's varint as a row of ``width`` bytes (padded) and its length."""
    lengths = np.searchsorted(_THRESHOLDS[: width - 1], values, side="right") + 1
    groups = ((values[:, None] >> _SHIFTS[:width]) & _LOW7).astype(np.uint8)
    more = _COLS[:width] < (lengths - 1)[:, None]
    groups |= more.view(np.uint8) << 7  # continuation bit on all but the last byte
    return groups, lengths


def encode_entries(rooms: np.ndarray, ranks: np.ndarray) -> bytes:
    """Repeated field-1 ``DpRankEntry`` bytes: a whole ``RegisterDpRanksRequest``, or
    the ``entries`` part of a ``QueryDpRanksResponse``."""
    k = len(rooms)
    if k == 0:
        return b""
    room_bytes, room_len = _varint_bytes(np.asarray(rooms, np.uint64), 10)
    ranks = np.asarray(ranks, np.uint64)
    small_ranks = bool(ranks.max() < 0x80)  # the usual case: every rank is one byte
    width = 15 if small_ranks else _WIDTH
    rows = np.empty((k, width), np.uint8)
    keep = np.ones((k, width), bool)
    rows[:, 0] = 0x0A
    rows[:, 2] = 0x08
    rows[:, 3:13] = room_bytes
    keep[:, 3:13] = _COLS < room_len[:, None]
    rows[:, 13] = 0x10
    if small_ranks:
        rows[:, 1] = 3 + room_len
        rows[:, 14] = ranks
    else:
        rank_bytes, rank_len = _varint_bytes(ranks, 5)
        rows[:, 1] = 2 + room_len + rank_len
        rows[:, 14:19] = rank_bytes
        keep[:, 14:19] = _COLS[:5] < rank_len[:, None]
    return rows[keep].tobytes()


def encode_query_response(rooms: np.ndarray, ranks: np.ndarray, missing: np.ndarray) -> bytes:
    """``QueryDpRanksResponse`` bytes: found entries, then packed ``missing_rooms``."""
    tail = pb.QueryDpRanksResponse(missing_rooms=missing.tolist()).SerializeToString() if len(missing) else b""
    return encode_entries(rooms, ranks) + tail


def _varint_values(a: np.ndarray, starts: np.ndarray, lengths: np.ndarray, width: int) -> np.ndarray:
    """Values of the varints at ``starts`` (``a`` is padded so every read is in bounds)."""
    parts = (a[starts[:, None] + _COLS[:width]] & 0x7F).astype(np.uint64) << _SHIFTS[:width]
    parts[_COLS[:width] >= lengths[:, None]] = 0
    values: np.ndarray = np.bitwise_or.reduce(parts, axis=1)
    return values


def decode_entries(data: bytes) -> tuple[np.ndarray, np.ndarray, int] | None:
    """Leading entries in the layout above: ``(rooms, ranks, bytes used)``, or None if
    the bytes start with anything else that claims to be an entry."""
    n = len(data)
    a = np.frombuffer(data + bytes(10), np.uint8)
    empty = (np.empty(0, np.uint64), np.empty(0, np.uint32), 0)
    if n == 0:
        return empty
    # Every field here is a varint ("token"): tag, length, value. A token ends at the
    # first byte < 0x80. An entry is six tokens: 0x0A len 0x08 room 0x10 rank.
    ends = np.flatnonzero(a[:n] < 0x80)
    heads = a[ends[0 : len(ends) - len(ends) % 6 : 6]] == 0x0A
    k = len(heads) if heads.all() else int(np.argmin(heads))
    if k == 0:
        return None if a[0] == 0x0A else empty
    e = ends[: 6 * k].reshape(k, 6)  # last byte of each token of each entry
    d = np.diff(ends[: 6 * k], prepend=-1).reshape(k, 6)  # byte length of each token
    ok = (
        (d[:, _ONE_BYTE] == 1).all()  # the three tags and len are one byte each
        and (a[e[:, ::2]] == _TAGS).all()  # tags 0x0A, 0x08, 0x10 where they belong
        and (d[:, 3] <= 10).all()
        and (d[:, 5] <= 5).all()
        and (a[e[:, 1]] == e[:, 5] - e[:, 1]).all()  # len covers exactly the two fields
    )
    if not ok:
        return None
    rooms = _varint_values(a, e[:, 2] + 1, d[:, 3], 10)
    if (d[:, 5] == 1).all():  # the usual case: every rank is one byte
        ranks = a[e[:, 5]].astype(np.uint32)
    else:
        wide = _varint_values(a, e[:, 4] + 1, d[:, 5], 5)
        if (wide > _U32_MAX).any():
            return None
        ranks = wide.astype(np.uint32)
    used = int(e[-1, 5]) + 1
    if used < n and a[used] == 0x0A:
        return None  # another entry follows, in some other layout
    return rooms, ranks, used


def decode_register_request(data: bytes) -> tuple[np.ndarray, np.ndarray] | None:
    """``RegisterDpRanksRequest`` → ``(rooms, ranks)``, or None: parse the slow way."""
    got = decode_entries(data)
    if got is None or got[2] != len(data):
        return None
    return got[0], got[1]


_ONE_ROOM = struct.Struct("<2sQ2sI")
_ONE_ROOM_TAGS = (b"\x1a\x08", b"\x22\x04")  # packed_rooms, 8 bytes; packed_dp_ranks, 4 bytes


def encode_one_room(room: int, rank: int) -> bytes:
    """The packed ``RegisterDpRanksRequest`` of ``room → rank`` (see the module doc);
    ``struct.error`` if either is out of range (uint64, uint32)."""
    return _ONE_ROOM.pack(_ONE_ROOM_TAGS[0], room, _ONE_ROOM_TAGS[1], rank)


def decode_one_room(data: bytes) -> tuple[int, int] | None:
    """``(room, rank)`` of a packed one-room ``RegisterDpRanksRequest`` in exactly the
    layout :func:`encode_one_room` writes; ``None`` for any other message."""
    if len(data) != 16:
        return None
    rooms_tag, room, ranks_tag, rank = _ONE_ROOM.unpack(data)
    if rooms_tag != _ONE_ROOM_TAGS[0] or ranks_tag != _ONE_ROOM_TAGS[1]:
        return None
    return room, rank
