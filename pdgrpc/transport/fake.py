"""``fake``: moves no bytes and succeeds at once.

Used for warm-up requests and tests of everything above the data plane. A receiver's
room is ``SUCCESS`` as soon as it is advertised, a sender's as soon as its metadata row
is "written"; the decode state machine skips the metadata check for fake transfers
(nothing was written into the slot).
"""

from __future__ import annotations

from typing import Any, Sequence

from pdgrpc.errors import ConfigError, PeerFailure
from pdgrpc.kvpoll import KVPoll
from pdgrpc.transport.base import Descriptor, MemoryRegion, Peer, RoomGrant, Transport, WriteOp


class FakeTransport(Transport):
    name = "fake"
    moves_bytes = False

    def __init__(self, **options: Any) -> None:
        if options:
            raise ConfigError(f"fake transport takes no options, got {sorted(options)}")
        super().__init__()
        self._regions: dict[int, MemoryRegion] = {}
        self._peers: dict[str, Peer] = {}
        self._room_peer: dict[int, str] = {}
        self._closed = False

    def _descriptor(self) -> Descriptor:
        return Descriptor("fake", self.instance_id, b"", tuple(r.info() for r in self._regions.values()))

    async def register(self, regions: Sequence[MemoryRegion]) -> bytes:
        for r in regions:
            self._regions[r.region_id] = r
        return self._descriptor().to_bytes()

    async def connect(self, descriptor: bytes) -> Peer:
        d = Descriptor.from_bytes(descriptor)
        if self._closed:
            raise PeerFailure("transport is closed")
        peer = self._peers.get(d.instance_id)
        if peer is None:
            peer = self._peers[d.instance_id] = Peer(d.instance_id, d)
        return peer

    def advertise(self, grant: RoomGrant) -> None:
        self.rooms.create(grant.room, KVPoll.WAITING_FOR_INPUT)
        self.rooms.set(grant.room, KVPoll.SUCCESS)

    async def write(
        self, peer: Peer, room: int, ops: Sequence[WriteOp], *, metadata: WriteOp | None = None
    ) -> None:
        self.rooms.create(room, KVPoll.TRANSFERRING)
        if peer.instance_id not in self._peers:
            self.rooms.fail(room, f"peer {peer.instance_id} is not connected")
            return
        self._room_peer[room] = peer.instance_id
        if metadata is not None:
            self.rooms.set(room, KVPoll.SUCCESS)

    def release(self, room: int) -> None:
        self.rooms.discard(room)
        self._room_peer.pop(room, None)

    def fail_peer(self, instance_id: str, reason: str) -> None:
        self._peers.pop(instance_id, None)
        self.rooms.fail_all(reason, [r for r, p in self._room_peer.items() if p == instance_id], peer_lost=True)

    async def close(self) -> None:
        self._closed = True
        self.rooms.fail_all("transport closed")
        self._peers.clear()
