"""The ``rdma`` backend's wire format: messages, tags, and how a write becomes data messages.

Protocol (all UCX tag messages; tags are ``kind:4 | conn:28 | seq:32``)
-----------------------------------------------------------------------
``CTRL`` (to a receiver; all senders share the tag, the body says who) and ``REPLY``
(to a sender) carry small little-endian control messages, each starting with
``type u8 | pad 3 | conn u32 | seq u64 | key u64``.

UCX matches tags, not senders: anything that reaches a worker's address can send it a
tagged message. So connection ids are random, and every control message carries its
connection's key, drawn at random by the side that receives on it: the sender's in its
``HELLO`` (replies must echo it), the receiver's in ``HELLO_OK`` (``WRITE`` and
``META`` must carry it). A message whose key is not its connection's is dropped
unanswered, so a forger that guesses a connection id and sequence number still cannot
write a metadata row, announce a write, or complete or fail a room. Data messages
carry no key (a tag has no room for one); a connection's data sequence starts at a
random number, so their tags hold 60 random bits. The keys travel
inside UCX messages between the two proven peers; they are not secret from an on-path
observer of the data plane, which is not encrypted (docs/security.md).

* ``HELLO`` (sender -> receiver): the sender's local connection id, instance ids, its
  own worker address (for replies), and a proof of the receiver-issued credential
  answering the challenge of the sender's liveness link (:mod:`.peerauth`). ``HELLO_OK`` assigns the receiver-side
  connection id that the sender then puts in every tag, and the connection's key;
  ``HELLO_REFUSED`` says why not.
* ``WRITE``: room, the sequence number of its first data message, how many ops each
  data message carries, flags, then the op table (``region u16 | pad 6 | offset u64 |
  length u64``, destination side). The data messages (tag ``DATA | conn | seq``) follow:
  consecutive ops are batched into scatter/gather messages of about ``zero_copy_min``
  bytes and at most ``iov_max`` ops each, except that an op of ``contiguous_min`` bytes
  or more travels alone, as one contiguous message (see :func:`plan_chunk`).
  With the ``WRITE_AHEAD`` flag the WRITE is announced by ``prepare_write`` while the
  sender still computes the bytes: the receiver checks it and posts its receives at
  once, the data messages come when the sender calls the prepared send, and the room
  turns TRANSFERRING when its first bytes land, not at the announcement.
* ``META``: the room, the number of KV bytes the sender wrote for the room before it,
  the destination of the metadata row, and the row itself (inline).
* ``ACK`` / ``NACK`` (receiver -> sender): the room's metadata row landed / the room
  failed on the receiver, with the reason.
"""

from __future__ import annotations

import secrets
import struct
from typing import Any, NamedTuple

import numpy as np

from pdgrpc.transport.receiver import MessageType

KIND_SHIFT = 60
KIND_MASK = 0xF << KIND_SHIFT
KIND_CTRL, KIND_REPLY, KIND_DATA = 1, 2, 3
CONN_BITS = 28

HELLO, HELLO_OK, HELLO_REFUSED, WRITE, META, ACK, NACK = (
    MessageType.HELLO, MessageType.HELLO_OK, MessageType.HELLO_REFUSED, MessageType.WRITE, MessageType.META,
    MessageType.ACK, MessageType.NACK)
COMMON = struct.Struct("<B3xIQQ")  # type, conn, seq, the connection's key
HELLO_BODY = struct.Struct("<HHI")  # len(sender id), len(target id), len(worker address); then those, then the proof
HELLO_CHANNEL = b"rdma-hello"  # the peerauth channel name of a HELLO's proof
HELLO_OK_BODY = struct.Struct("<IH2xQ")  # assigned conn id, len(receiver id), the connection's key
WRITE_BODY = struct.Struct("<QIIII")  # room, first data seq, n messages, n ops, flags
WRITE_AHEAD = 1  # flag: announced ahead of its data (prepare_write); the data follows later
# then n messages x u32 (ops in each data message), then the op table:
OP_DTYPE = np.dtype([("region", "<u2"), ("pad", "V6"), ("offset", "<u8"), ("length", "<u8")])
META_BODY = struct.Struct("<QQH6xQQ")  # room, kv bytes before, region, offset, length
ROOM_BODY = struct.Struct("<Q")
NACK_BODY = struct.Struct("<QB7x")  # room, refusal code (0: not a refused write); then the reason

CTRL_BUF = 256 * 1024  # largest control message
CTRL_POSTED = 8  # control receives kept posted per kind
MAX_OPS_PER_WRITE = 4096  # keeps a WRITE message well under CTRL_BUF
MAX_ROW = CTRL_BUF - COMMON.size - META_BODY.size
SCRATCH = 1 << 20  # drain buffer for rejected payloads
CLOSE_SEND_GRACE_S = 1.0  # close(): how long in-flight sends to live peers may finish
EARLY_MAX = 1024  # control messages kept per connection ahead of a missing one (and how far ahead)
DROPPED_MAX = 256  # dropped connections remembered, so their in-flight writes are drained
SWEEP_S = 0.1  # how soon after UCX progressed the receiver drops stray messages from its unexpected queue
SWEEP_MAX = 4096  # messages dropped per sweep at most


def new_id(bits: int, taken: Any) -> int:
    """A random non-zero ``bits``-bit id not in ``taken``."""
    while (i := secrets.randbits(bits)) == 0 or i in taken:
        pass
    return i


def new_key() -> int:
    """A random 64-bit connection key."""
    return secrets.randbits(64)


def ctrl_tag(kind: int) -> int:
    return kind << KIND_SHIFT


def data_tag(conn: int, seq: int) -> int:
    return (KIND_DATA << KIND_SHIFT) | (conn << 32) | (seq & 0xFFFFFFFF)


class Plan(NamedTuple):
    """One WRITE's data messages, checked and planned (sequence numbers come at send)."""

    counts: list[int]  # ops per data message
    n_ops: int
    table_bytes: bytes  # the WRITE body after its header: counts, then the op table
    iov: np.ndarray  # (n_ops, 2) uint64 {source address, length}
    nbytes: int
    table: np.ndarray  # the ops: rows of src region, src offset, dst region, dst offset, length


def plan_chunk(table: np.ndarray, ptr_table: np.ndarray, zc_min: int, iov_max: int,
               contiguous_min: int | None = None) -> "Plan | None":
    """One WRITE's data messages for ``table`` (rows: src region, src offset, dst region,
    dst offset, length); ``ptr_table`` maps a region id to its base address.

    Consecutive ops share one scatter/gather message until it holds ``zc_min`` bytes or
    ``iov_max`` ops: few large iov messages, not one rendezvous per op, because the
    per-message handshake, not the bytes, is the cost of small ops. An op of
    ``contiguous_min`` bytes or more (``None``: never)
    is a message of its own: UCX moves a contiguous message between two processes on one
    host with one ``process_vm_readv`` by the receiver (cma), but every iov message as
    fragmented copy-in copy-out through shared memory, which needs both processes on a
    core at once and so collapses whenever the host is busy."""
    lens = table[:, 4]
    n = len(lens)
    if n == 0:
        return None
    if contiguous_min is not None and int(lens.min()) >= contiguous_min:
        counts = [1] * n  # every op travels alone (the contiguous case): nothing to batch
    else:
        # Vectorised: a message starts where an op's start offset crosses into the next
        # zc_min window, at an op that travels alone and right after one, and at every
        # iov_max-th op within a run of ops that share messages.
        window = (np.cumsum(lens) - lens) // zc_min
        brk = np.r_[True, window[1:] != window[:-1]]
        if contiguous_min is not None:
            alone = lens >= contiguous_min
            brk |= alone
            brk[1:] |= alone[:-1]
        starts = np.flatnonzero(brk)
        rank = np.arange(n) - np.repeat(starts, np.diff(np.r_[starts, n]))
        key = (np.cumsum(brk) - 1) * (n + 1) + rank // iov_max
        counts = np.diff(np.r_[np.flatnonzero(np.r_[True, key[1:] != key[:-1]]), n]).tolist()
    ops = np.zeros(len(table), dtype=OP_DTYPE)
    ops["region"], ops["offset"], ops["length"] = table[:, 2], table[:, 3], table[:, 4]
    # iov rows {source address, length}, read in place by UCX
    iov = np.empty((len(table), 2), dtype=np.uint64)
    iov[:, 0] = ptr_table[table[:, 0]] + table[:, 1].astype(np.uint64)
    iov[:, 1] = table[:, 4]
    return Plan(counts, len(table), np.asarray(counts, dtype="<u4").tobytes() + ops.tobytes(), iov, int(lens.sum()),
                table)
