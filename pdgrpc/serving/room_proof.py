"""Per-request secrets: proof that a Handshake or AbortRoom comes from the chosen decode.

The router draws a secret with each room (:func:`draw_secret`) and gives it to the one
prefill and the one decode it chose (``PrefillRequest.room_secret``,
``DecodeRequest.room_secret``), over the authenticated control plane. The decode signs
each ``HandshakeRequest`` (:func:`handshake_proof`) and ``AbortRoomRequest``
(:func:`abort_proof`) with it; a prefill worker whose Prefill carries the secret checks
the proof before the message may change anything (:func:`verify`).

A proof is HMAC-SHA256 under the secret over a canonical encoding of what the message
asks for: for a handshake the room, destination pages, slot, decode tp rank and size,
``wants_metadata``, the transport descriptor (where the KV goes) and the data-plane
credential the decode issued (what the worker proves to it), so a forger can neither
redirect the KV, nor reuse a proof for another decode rank, nor swap the credential so
that the worker fails to prove itself to the real decode; for an abort the room, under
its own prefix. A room whose prefill failed is recorded with its bootstrap under a
tag (:func:`failure_tag`, the room under another prefix): only a holder of the secret
can make a record its decode finds, or find one.
A ``Prefill`` or ``Decode`` that reaches a server over gRPC without a secret of
:data:`SECRET_BYTES` bytes is refused (:func:`secret_problem`): without one, the prefill
would accept any handshake for the room. smg's PD legs, whose protocol carries no
secret, derive theirs from smg's request id and call the servers' handlers in-process
(docs/security.md). Pure: no I/O, no clock.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct

from pdgrpc.v1 import handshake_pb2

__all__ = [
    "SECRET_BYTES", "abort_message", "abort_proof", "draw_secret", "failure_tag", "handshake_message", "handshake_proof", "secret_problem", "sign",
    "verify",
]

SECRET_BYTES = 32

_HANDSHAKE = b"pdgrpc.v1 handshake\0"
_ABORT = b"pdgrpc.v1 abort\0"
_FAILED = b"pdgrpc.v1 room failed\0"


def draw_secret() -> bytes:
    """A fresh per-request secret (32 bytes from :mod:`secrets`)."""
    return secrets.token_bytes(SECRET_BYTES)


def secret_problem(secret: bytes) -> str | None:
    """Why ``secret`` cannot be a request's ``room_secret`` (``None`` when it can)."""
    if len(secret) == SECRET_BYTES:
        return None
    if not secret:
        return (f"room_secret is empty: a Prefill or Decode must carry the {SECRET_BYTES}-byte secret its router "
                "drew with the room (docs/security.md)")
    return f"room_secret must be {SECRET_BYTES} bytes, got {len(secret)}"


def handshake_message(req: handshake_pb2.HandshakeRequest) -> bytes:
    """What a ``HandshakeRequest``'s proof signs (every field but the proof, the transport
    name and the compatibility hash, which a worker checks against its own). A forged
    ``cached_pages`` would leave pages unwritten, so it is signed too."""
    pages = req.dst_pages
    return b"".join(
        (
            _HANDSHAKE,
            struct.pack(
                "<QIIII?I", req.bootstrap_room, req.dst_slot, req.decode_tp_rank, req.decode_tp_size, len(pages),
                req.wants_metadata, len(req.transport_descriptor),
            ),
            struct.pack(f"<{len(pages)}I", *pages),
            bytes(req.transport_descriptor),
            struct.pack("<I", len(req.transport_credential)),
            bytes(req.transport_credential),
            # Only when set: a handshake without it signs what it signed before.
            struct.pack("<I", req.cached_pages) if req.cached_pages else b"",
        )
    )


def abort_message(room: int) -> bytes:
    """What an ``AbortRoomRequest``'s proof signs."""
    return _ABORT + struct.pack("<Q", room)


def failure_tag(secret: bytes, room: int) -> bytes:
    """The tag of ``room``'s failure record with its bootstrap (``RoomFailureKey.tag``)."""
    return sign(secret, _FAILED + struct.pack("<Q", room))


def sign(secret: bytes, message: bytes) -> bytes:
    """HMAC-SHA256 of ``message`` under ``secret``."""
    return hmac.new(secret, message, hashlib.sha256).digest()


def handshake_proof(secret: bytes, req: handshake_pb2.HandshakeRequest) -> bytes:
    """The ``room_proof`` of ``req`` under ``secret`` (its own room_proof is ignored)."""
    return sign(secret, handshake_message(req))


def abort_proof(secret: bytes, room: int) -> bytes:
    """The ``room_proof`` of an ``AbortRoomRequest`` for ``room`` under ``secret``."""
    return sign(secret, abort_message(room))


def verify(secret: bytes, message: bytes, proof: bytes) -> bool:
    """Whether ``proof`` is ``message``'s HMAC under ``secret`` (constant-time compare)."""
    return hmac.compare_digest(sign(secret, message), proof)
