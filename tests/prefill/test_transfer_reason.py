"""How a prefill worker counts a room its transport failed: by the transport's typed
status (never its text)."""

from __future__ import annotations

from pdgrpc.kvpoll import KVPoll
from pdgrpc.metrics.catalog import ServerAbortReason
from pdgrpc.prefill.room import transfer_failed_reason
from pdgrpc.state import AbortReason
from pdgrpc.transport.receiver import Refusal
from pdgrpc.transport.rooms import RoomStates, RoomStatus


def test_a_lost_decode_is_a_peer_failure_a_refusal_a_rejected_write_else_a_transfer_failure() -> None:
    rooms = RoomStates()
    for room in (1, 2, 3):
        rooms.create(room, KVPoll.TRANSFERRING)
    rooms.fail_all("tcp peer d lost: connection closed", [1], peer_lost=True)
    rooms.fail(2, "receiver rejected the transfer: page 9 outside the grant", Refusal.OUTSIDE_GRANT)
    rooms.fail(3, "peer lost")  # the text says so, the status does not: a transfer failure
    assert transfer_failed_reason(rooms.status(1)) is ServerAbortReason.PEER_FAILURE
    assert transfer_failed_reason(rooms.status(2)) is ServerAbortReason.REJECTED_WRITE
    assert transfer_failed_reason(rooms.status(3)) is AbortReason.TRANSFER_FAILED
    assert rooms.status(1).peer_lost and not rooms.status(2).peer_lost and not rooms.status(3).peer_lost


def test_only_a_failure_carries_peer_lost() -> None:
    rooms = RoomStates()
    rooms.create(7, KVPoll.TRANSFERRING)
    rooms.set(7, KVPoll.SUCCESS, peer_lost=True)
    assert rooms.status(7) == RoomStatus(KVPoll.SUCCESS)
