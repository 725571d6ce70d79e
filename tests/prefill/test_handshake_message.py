"""What a handshake's room proof signs: cached_pages too, and nothing new without it."""

from __future__ import annotations

from pdgrpc.serving.room_proof import handshake_message, handshake_proof
from pdgrpc.v1 import handshake_pb2


def test_cached_pages_is_signed_and_a_handshake_without_it_signs_what_it_did() -> None:
    req = handshake_pb2.HandshakeRequest(bootstrap_room=5, dst_pages=[1, 2, 3], dst_slot=0, decode_tp_size=1)
    without = handshake_message(req)
    req.cached_pages = 2
    assert handshake_message(req) != without  # a forged cached_pages would leave pages unwritten
    proof = handshake_proof(b"s" * 32, req)
    req.cached_pages = 3
    assert handshake_proof(b"s" * 32, req) != proof
    req.cached_pages = 0
    assert handshake_message(req) == without
